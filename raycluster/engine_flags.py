"""EngineConfig's fields as command-line flags, as vLLM's engine arguments are (`--max-model-len`,
`--dtype`, `--kv-cache-tokens`, `--max-num-seqs`, `--tp`, ...).

`add_engine_flags(parser, skip)` adds one `--field-name` per field (help from the field's
description, choices from a Literal); `engine_overrides(args)` returns the ones given, values as
typed (strings, or None for "none" on an optional field) for EngineConfig to validate and
coerce; `check_overrides` raises ValueError naming the flag when one is invalid. `raycluster
engine-server` builds its engine from them; `raycluster up` / `apply` apply them to every pool's
engine options (a pool's own `engine` options in the app file still win, as for
--enable-prefix-caching). vLLM's `--speculative-config JSON` is taken too: its `method`,
`model`, `num_speculative_tokens`, `prompt_lookup_max` and `prompt_lookup_min` become the fields
of the same names (`method` is `speculative_method`, `model` is `speculative_model`; a `model`
without a `method` means "draft_model", as in vLLM; vLLM's `deepseek_mtp` is `mtp`).
"""

from __future__ import annotations

import argparse
import json
import typing

from pydantic import ValidationError

from raycluster.engine.config import EngineConfig

_PREFIX = "engine_"       # where the values land on the argparse namespace: no clash with other flags
# vLLM's --speculative-config keys -> EngineConfig fields.
_SPEC_KEYS = {"method": "speculative_method", "model": "speculative_model",
              "num_speculative_tokens": "num_speculative_tokens",
              "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min"}
_SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
_SPEC_ALIASES = {"deepseek_mtp": "mtp"}     # vLLM's name for the checkpoint's MTP layers


def _literal_choices(annotation) -> list[str] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return [str(a) for a in typing.get_args(arg)]
    return None


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine options (EngineConfig; `none` unsets an optional one)")
    for name, field in EngineConfig.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = (field.description or "").replace("%", "%%")      # argparse formats help with %
        if field.annotation is bool:
            group.add_argument(flag, dest=_PREFIX + name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            continue
        if typing.get_origin(field.annotation) is list:
            group.add_argument(flag, dest=_PREFIX + name, default=None, nargs="+", metavar="ITEM", help=help_text)
            continue
        group.add_argument(flag, dest=_PREFIX + name, default=None, metavar=name.upper(),
                           choices=_literal_choices(field.annotation), help=help_text)
    if "speculative_method" not in skip:
        group.add_argument("--speculative-config", dest="speculative_config", default=None, metavar="JSON",
                           help="vLLM's: e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                                "\"prompt_lookup_max\": 4}' or '{\"model\": \"DRAFT_DIR\", "
                                "\"num_speculative_tokens\": 4}' (the same as the flags of those names)")


def engine_overrides(args: argparse.Namespace) -> dict:
    """{field: value} of the engine flags given on the command line."""
    out = {}
    for key, value in vars(args).items():
        if key.startswith(_PREFIX) and value is not None:
            name = key[len(_PREFIX):]
            optional = type(None) in typing.get_args(EngineConfig.model_fields[name].annotation)
            out[name] = None if optional and value == "none" else value
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        for name, value in speculative_config(spec).items():
            if name in out and str(out[name]) != str(value):
                raise ValueError(f"--speculative-config: {name} is also given as --{name.replace('_', '-')}")
            out[name] = value
    return out


def speculative_config(text: str) -> dict:
    """vLLM's --speculative-config JSON as EngineConfig fields; ValueError naming what is wrong."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config: must be a JSON object")
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported (the keys taken: "
                         f"{', '.join(_SPEC_KEYS)})")
    if "model" in spec and "method" not in spec:
        spec = {**spec, "method": "draft_model"}
    if spec.get("method") in _SPEC_ALIASES:
        spec = {**spec, "method": _SPEC_ALIASES[spec["method"]]}
    if spec.get("method") not in _SPEC_METHODS:
        raise ValueError(f"--speculative-config: method {spec.get('method')!r} not supported (\"ngram\", "
                         "\"draft_model\", \"eagle\", \"eagle3\" or \"mtp\" / \"deepseek_mtp\")")
    return {_SPEC_KEYS[k]: v for k, v in spec.items()}


def check_overrides(overrides: dict) -> dict:
    """The overrides, validated on their own (other fields at their defaults); ValueError naming
    the flag otherwise."""
    try:
        EngineConfig(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err.get("loc") else ""
        flag = "--" + name.replace("_", "-") if name in overrides else name or "engine options"
        raise ValueError(f"{flag}: {err['msg'].removeprefix('Value error, ')}") from None
    return overrides
