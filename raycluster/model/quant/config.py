"""`QuantConfig`: what a checkpoint's `quantization_config` (config.json) says about its weights,
read for the four formats vLLM users meet most, with errors that name the field.

- `compressed-tensors` (llm-compressor's output): one config group whose `weights` are
  `int` of 4 or 8 bits (`pack-quantized`: packed into int32; `int-quantized`: one int8 each) by
  `channel` or `group`, symmetric or not, optionally with `actorder` (`weight_g_idx`); or
  `float` 8-bit (`float-quantized`, FP8 E4M3) by `tensor`, `channel` or `block`. `ignore` lists
  module names or `re:` patterns left dense.
- `gptq` (AutoGPTQ / GPTQModel): `bits` 4 or 8, `group_size` (-1: per channel), `sym`,
  `desc_act` (act order), `checkpoint_format` gptq (zeros stored minus one) or gptq_v2.
- `awq` (AutoAWQ GEMM): `bits` 4, `group_size`, `zero_point`; `modules_to_not_convert`.
- `fp8` (DeepSeek-V3 / Qwen3-FP8 style): FP8 weights with `weight_block_size` [n, k] block scales
  (`weight_scale_inv`), or one per-tensor `weight_scale` without it; `ignored_layers` /
  `modules_to_not_convert`.

Activation quantization (W8A8 schemes' `input_activations`, `activation_scheme`) is read and
not applied: activations stay in the compute dtype, so such a checkpoint runs weight-only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class QuantConfigError(ValueError):
    """A `quantization_config` this server cannot serve, naming the field."""


METHODS = ("compressed-tensors", "gptq", "awq", "fp8")


@dataclass(frozen=True)
class QuantConfig:
    """One weight scheme for every quantized linear layer of a checkpoint.

    `layout` names the checkpoint tensors (raycluster.model.quant.formats): `ct-packed`,
    `ct-int8`, `ct-fp8`, `gptq`, `awq` or `fp8`. `bits`: 4 or 8. `strategy`: what one scale
    covers. `group_size`: input columns per scale ('group'; None otherwise); `block`: the
    [rows, cols] one FP8 scale covers ('block'). `symmetric`: no zero points stored. `act_order`: a `g_idx` tensor maps each
    input column to its group. `gptq_zero_offset`: 1 when GPTQ's (v1) zeros are stored minus one.
    `ignore`: module names / `re:` patterns that stay dense. `input_scale`: each quantized layer
    also stores a static activation scale (a W8A8 scheme), which is read and not applied."""

    method: str
    layout: str
    bits: int
    strategy: str                   # scales per: 'group' | 'channel' (int); 'tensor' | 'channel' | 'block' (FP8)
    group_size: int | None = None
    symmetric: bool = True
    act_order: bool = False
    block: tuple[int, int] | None = None
    gptq_zero_offset: int = 0
    ignore: tuple[str, ...] = ()
    input_scale: bool = False       # static activation scales are stored (`input_scale`), and not used

    def quantizes(self, name: str) -> bool:
        """Whether the linear layer called `name` (its full parameter prefix, e.g.
        `model.layers.0.self_attn.q_proj`) is stored quantized. A MoE router (`gate`,
        `shared_expert_gate`) never is, as in vLLM; nor the output head (the loader refuses a
        checkpoint that quantizes it)."""
        last = name.rsplit(".", 1)[-1]
        if last in ("gate", "shared_expert_gate") or name == "lm_head":
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], name):
                    return False
            elif name == pattern or name.endswith("." + pattern) or last == pattern:
                return False
        return True

    @property
    def integer(self) -> bool:
        """Integer weights (unpacked to int values with scales and zero points) vs FP8 ones."""
        return self.layout in ("ct-packed", "ct-int8", "gptq", "awq")


def parse_quant_config(raw: dict[str, Any] | None) -> QuantConfig | None:
    """The `quantization_config` of a config.json as a QuantConfig (None: not quantized)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QuantConfigError(f"config field 'quantization_config' must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    if method == "fp8":
        return _fp8(raw)
    raise QuantConfigError(f"config field 'quantization_config.quant_method' = {method!r} is not supported "
                           f"(supported: {', '.join(METHODS)})")


def _field(raw: dict, name: str, prefix: str = "quantization_config"):
    if name not in raw:
        raise QuantConfigError(f"config field '{prefix}.{name}' is required but missing")
    return raw[name]


def _int(raw: dict, name: str, prefix: str = "quantization_config", default=None) -> int | None:
    v = raw.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise QuantConfigError(f"config field '{prefix}.{name}' must be an integer, got {v!r}")
    return v


def _ignore_list(raw: dict, *names: str) -> tuple[str, ...]:
    out: list[str] = []
    for name in names:
        v = raw.get(name) or []
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise QuantConfigError(f"config field 'quantization_config.{name}' must be a list of module names")
        out.extend(v)
    return tuple(out)


def _group(group_size: int | None, field: str) -> int | None:
    """-1 / None / 0 mean one scale per output row."""
    if group_size in (None, -1, 0):
        return None
    if group_size < 1:
        raise QuantConfigError(f"config field '{field}' = {group_size} must be -1 or at least 1")
    return group_size


def _compressed_tensors(raw: dict) -> QuantConfig:
    groups = _field(raw, "config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError("config field 'quantization_config.config_groups' must name at least one group")
    if len(groups) > 1:
        raise QuantConfigError(f"config field 'quantization_config.config_groups' has {len(groups)} groups "
                               f"({', '.join(groups)}); one weight scheme for every layer is supported")
    gname, group = next(iter(groups.items()))
    prefix = f"quantization_config.config_groups.{gname}"
    if not isinstance(group, dict):
        raise QuantConfigError(f"config field '{prefix}' must be an object")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise QuantConfigError(f"config field '{prefix}.targets' = {targets!r}: only ['Linear'] is supported")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise QuantConfigError(f"config field '{prefix}.weights' is required (weight quantization)")
    wp = f"{prefix}.weights"
    fmt = group.get("format") or raw.get("format")
    kind, bits = w.get("type"), _int(w, "num_bits", wp)
    strategy = w.get("strategy")
    symmetric = bool(w.get("symmetric", True))
    actorder = w.get("actorder")
    act_order = actorder in ("group", "weight", True)
    if w.get("dynamic"):
        raise QuantConfigError(f"config field '{wp}.dynamic': dynamically quantized weights are not supported")
    ignore = _ignore_list(raw, "ignore")
    input_scale = _static_inputs(group.get("input_activations"), f"{prefix}.input_activations")
    if kind == "int":
        if bits not in (4, 8):
            raise QuantConfigError(f"config field '{wp}.num_bits' = {bits}: int weights of 4 or 8 bits are supported")
        if strategy not in ("channel", "group"):
            raise QuantConfigError(f"config field '{wp}.strategy' = {strategy!r}: int weights by 'channel' or "
                                   "'group' are supported")
        group_size = _group(_int(w, "group_size", wp), f"{wp}.group_size") if strategy == "group" else None
        if strategy == "group" and group_size is None:
            raise QuantConfigError(f"config field '{wp}.group_size' is required for strategy 'group'")
        if fmt == "pack-quantized":
            layout = "ct-packed"
        elif fmt in ("int-quantized", "naive-quantized") and bits == 8:
            layout = "ct-int8"
        else:
            raise QuantConfigError(f"config field 'quantization_config.format' = {fmt!r}: int weights are read "
                                   "from 'pack-quantized' (4 or 8 bits) or 'int-quantized' (8 bits)")
        return QuantConfig("compressed-tensors", layout, bits, strategy, group_size, symmetric, act_order,
                           ignore=ignore, input_scale=input_scale)
    if kind == "float":
        if bits != 8:
            raise QuantConfigError(f"config field '{wp}.num_bits' = {bits}: float weights of 8 bits (FP8) are supported")
        if fmt not in ("float-quantized", "naive-quantized", None):
            raise QuantConfigError(f"config field 'quantization_config.format' = {fmt!r}: FP8 weights are read "
                                   "from 'float-quantized'")
        block = None
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
                raise QuantConfigError(f"config field '{wp}.block_structure' must be [rows, cols], got {bs!r}")
            block = (bs[0], bs[1])
        elif strategy not in ("tensor", "channel"):
            raise QuantConfigError(f"config field '{wp}.strategy' = {strategy!r}: FP8 weights by 'tensor', "
                                   "'channel' or 'block' are supported")
        if not symmetric:
            raise QuantConfigError(f"config field '{wp}.symmetric': asymmetric FP8 weights are not supported")
        return QuantConfig("compressed-tensors", "ct-fp8", 8, strategy, None, True, False, block=block,
                           ignore=ignore, input_scale=input_scale)
    raise QuantConfigError(f"config field '{wp}.type' = {kind!r}: 'int' or 'float' weights are supported")


def _static_inputs(acts, field: str) -> bool:
    """Whether a scheme's activation quantization stores static scales (they are not applied)."""
    if acts is None:
        return False
    if not isinstance(acts, dict):
        raise QuantConfigError(f"config field '{field}' must be an object or null")
    if acts.get("dynamic", False) not in (True, "local"):
        if not acts.get("symmetric", True):
            raise QuantConfigError(f"config field '{field}.symmetric': static asymmetric activations are not supported")
        return True
    return False


def _gptq(raw: dict) -> QuantConfig:
    bits = _int(raw, "bits")
    if bits not in (4, 8):
        raise QuantConfigError(f"config field 'quantization_config.bits' = {bits}: 4 or 8 bits are supported")
    group_size = _group(_int(raw, "group_size", default=-1), "quantization_config.group_size")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"config field 'quantization_config.checkpoint_format' = {fmt!r}: 'gptq' or "
                               "'gptq_v2' are supported")
    if raw.get("lm_head"):
        raise QuantConfigError("config field 'quantization_config.lm_head': a quantized output head is not supported")
    if raw.get("dynamic"):
        raise QuantConfigError("config field 'quantization_config.dynamic': per-module overrides are not supported")
    return QuantConfig("gptq", "gptq", bits, "channel" if group_size is None else "group", group_size,
                       bool(raw.get("sym", True)), bool(raw.get("desc_act", False)),
                       gptq_zero_offset=1 if fmt == "gptq" else 0,
                       ignore=_ignore_list(raw, "modules_to_not_convert"))


def _awq(raw: dict) -> QuantConfig:
    bits = _int(raw, "bits", default=_int(raw, "w_bit"))
    if bits != 4:
        raise QuantConfigError(f"config field 'quantization_config.bits' = {bits}: AWQ weights of 4 bits are supported")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantConfigError(f"config field 'quantization_config.version' = {version!r}: the 'gemm' layout is supported")
    group_size = _group(_int(raw, "group_size", default=_int(raw, "q_group_size")), "quantization_config.group_size")
    if group_size is None:
        raise QuantConfigError("config field 'quantization_config.group_size' is required for AWQ")
    if not raw.get("zero_point", True):
        raise QuantConfigError("config field 'quantization_config.zero_point': AWQ without zero points is not supported")
    return QuantConfig("awq", "awq", 4, "group", group_size, False, False,
                       ignore=_ignore_list(raw, "modules_to_not_convert"))


def _fp8(raw: dict) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"config field 'quantization_config.fmt' = {fmt!r}: FP8 E4M3 weights are supported")
    bs = raw.get("weight_block_size")
    block = None
    if bs is not None:
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
            raise QuantConfigError(f"config field 'quantization_config.weight_block_size' must be [rows, cols], got {bs!r}")
        block = (bs[0], bs[1])
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantConfigError(f"config field 'quantization_config.activation_scheme' = {scheme!r}: 'dynamic' or "
                               "'static' are supported")
    return QuantConfig("fp8", "fp8", 8, "tensor" if block is None else "block", None, True, False, block=block,
                       ignore=_ignore_list(raw, "ignored_layers", "modules_to_not_convert"),
                       input_scale=scheme == "static")
