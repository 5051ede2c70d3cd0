"""How a model turns a prompt's final hidden states into one embedding vector, as vLLM's pooler
does for an embedding model (`--runner pooling`): the pooling type (LAST token, MEAN over the
prompt, CLS: the first token), whether vectors are L2-normalised, and which shorter (Matryoshka)
vector sizes the model was trained for.

`read_pooler_config(dir, config_json)` builds a `PoolerConfig` from a checkpoint: a
sentence-transformers layout (`modules.json` naming a Pooling module, whose `config.json` gives
the mode in either the current `pooling_mode` or the legacy `pooling_mode_*` booleans, and an
optional Normalize module) decides type and normalisation; without one a decoder pools its LAST
token, normalised (vLLM's defaults for a causal LM served as an embedding model). config.json's
`is_matryoshka` / `matryoshka_dimensions` say which `dimensions` a request may ask for. Modules
that would change the vector further (Dense projections, LayerNorm, ...) are refused rather than
silently skipped.

The engine (raycluster.engine.model_runner) pools: `chunk_sum` / `pooled` accumulate a request's
rows chunk by chunk; the raw pooled vector travels to the API, where `finish_vector` truncates to
the requested dimensions and normalises.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' pooling modes (current names and the legacy booleans) -> ours.
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


class PoolerConfigError(ValueError):
    """A checkpoint's pooling setup that we cannot reproduce."""


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"          # one of POOLING_TYPES
    normalize: bool = True              # the default; a request's `normalize` overrides it
    matryoshka: bool = False            # may a request ask for fewer `dimensions`
    matryoshka_dimensions: tuple[int, ...] | None = None   # only these (None: any size <= hidden)
    source: str = "default"             # where it came from: "default" | "sentence-transformers"

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip (LAST reads the last one,
        which is always computed)."""
        return self.pooling_type != "last"


def read_pooler_config(model_dir: str | None, config: dict[str, Any]) -> PoolerConfig:
    """The pooler of a checkpoint directory whose config.json holds `config`."""
    dims = config.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not dims
                             or not all(isinstance(d, int) and d > 0 for d in dims)):
        raise PoolerConfigError(f"config field 'matryoshka_dimensions' must be a list of positive ints, got {dims!r}")
    matryoshka = bool(config.get("is_matryoshka", False)) or dims is not None
    base = dict(matryoshka=matryoshka, matryoshka_dimensions=tuple(sorted(set(dims))) if dims else None)
    st = _sentence_transformers(model_dir) if model_dir else None
    if st is None:
        return PoolerConfig(**base)
    pooling_type, normalize = st
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, source="sentence-transformers", **base)


def _sentence_transformers(model_dir: str) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers `modules.json`, or None."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
    except json.JSONDecodeError as e:
        raise PoolerConfigError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(modules, list):
        raise PoolerConfigError(f"{path}: expected a list of modules")
    pooling_type, normalize = None, False
    for m in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _st_pooling_mode(os.path.join(model_dir, m.get("path", ""), "config.json"))
        else:
            raise PoolerConfigError(f"{path}: module {m.get('path') or m.get('name')!r} of type {m.get('type')!r} "
                                    "is not supported (only Transformer, Pooling and Normalize)")
    if pooling_type is None:
        raise PoolerConfigError(f"{path}: no Pooling module")
    return pooling_type, normalize


def _st_pooling_mode(path: str) -> str:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PoolerConfigError(f"{path}: cannot read the Pooling module's config: {e}") from e
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY.items() if cfg.get(key)]
        mode = modes[0] if len(modes) == 1 else modes or "mean"
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else mode
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise PoolerConfigError(f"{path}: pooling mode {mode!r} is not supported (lasttoken, mean or cls)")
    if cfg.get("include_prompt", True) is False:
        raise PoolerConfigError(f"{path}: include_prompt false is not supported (every prompt token is pooled)")
    return _ST_MODES[mode]


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, hidden_size: int) -> str | None:
    """Why a request's `dimensions` cannot be served (None: it can)."""
    if dimensions is None or dimensions == hidden_size:
        return None
    if not pooler.matryoshka:
        return (f"this model's embeddings have {hidden_size} dimensions and it was not trained for shorter "
                "(Matryoshka) vectors")
    if dimensions > hidden_size:
        return f"must be at most this model's {hidden_size}"
    if pooler.matryoshka_dimensions is not None and dimensions not in pooler.matryoshka_dimensions:
        return f"must be one of this model's Matryoshka sizes {list(pooler.matryoshka_dimensions)}"
    return None


def finish_vector(raw: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A pooled vector as the API returns it: its first `dimensions` values (Matryoshka), then
    L2-normalised if asked (truncating first, as vLLM's pooler head does)."""
    v = torch.tensor(raw, dtype=torch.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.tolist()


def pool_chunk(state: torch.Tensor | None, pooling_type: str, rows: torch.Tensor, start: int) -> torch.Tensor | None:
    """A request's pooling state after a prefill chunk of final hidden `rows` [n, H] at positions
    start.. (MEAN: the running fp32 sum; CLS: position 0's row; LAST: the chunk's last row).
    A chunk at position 0 starts over (a preempted request recomputes its prompt)."""
    if pooling_type == "last":
        return rows[-1].float()
    if start == 0:
        state = None
    if pooling_type == "cls":
        return rows[0].float() if start == 0 else state
    total = rows.float().sum(0)
    return total if state is None else state + total


def pooled(state: torch.Tensor, pooling_type: str, num_prompt_tokens: int) -> torch.Tensor:
    """The raw pooled vector once the whole prompt has been through `pool_chunk`."""
    return state / num_prompt_tokens if pooling_type == "mean" else state
