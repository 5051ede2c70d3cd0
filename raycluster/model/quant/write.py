"""Quantize a dense Hugging Face checkpoint into one of the layouts the server reads
(`raycluster quantize SRC DST --scheme NAME`): round-to-nearest weights, the same tensors and
config.json `quantization_config` the real tools write, so a quantized model can be served and
compared on machines that cannot download one.

Schemes (`SCHEMES`), after the presets users meet:
- `w4a16` / `w4a16-asym`: compressed-tensors pack-quantized int4 weights by group (llm-compressor's
  W4A16 preset; asymmetric with packed zero points); `w8a16`: int8 weights by channel, packed.
- `w8a8`: compressed-tensors int-quantized int8 weights by channel, with dynamic per-token int8
  activations declared (the server runs it weight-only).
- `fp8`: compressed-tensors float-quantized FP8 weights by channel, dynamic per-token FP8
  activations declared (llm-compressor's FP8_DYNAMIC); `fp8-block`: `quant_method: fp8` with
  square weight blocks of the group size (128 x 128 by default: DeepSeek-V3 / Qwen3-FP8's layout).
- `gptq`: GPTQ's layout (v1: zeros stored minus one), 4 bits, symmetric, by group; `awq`: AutoAWQ's
  GEMM layout, 4 bits with zero points. The values are rounded to nearest: this writes those
  layouts, not the GPTQ / AWQ algorithms' error-compensated weights.

Data flow: `quantize_checkpoint(src, dst, scheme)` reads every safetensors file of `src`, replaces
each `<layer>.weight` the scheme quantizes (decoder-layer linears but MoE routers) with the
layout's tensors from `quantize_weight`, writes one model.safetensors and config.json with the
scheme's `quantization_config`, and copies every other file (tokenizer, generation config).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raycluster.model.config import FP8_ONLY, UNQUANTIZABLE
from raycluster.model.multimodal_config import MULTIMODAL_ARCHITECTURES, text_module_name
from raycluster.model.quant.config import QuantConfig, parse_quant_config
from raycluster.model.quant.formats import AWQ_ORDER

FP8_MAX = 448.0     # the largest finite float8_e4m3fn


def _ct(weights: dict, fmt: str, acts: dict | None = None) -> dict:
    # MoE routers stay dense, as llm-compressor's MoE recipes leave them.
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"],
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights,
                                          "input_activations": acts, "output_activations": None}}}


def _int_weights(bits: int, group: int | None, symmetric: bool = True) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
            "strategy": "group" if group else "channel", "group_size": group}


_TOKEN_ACTS = {"dynamic": True, "strategy": "token", "symmetric": True}


def scheme_config(scheme: str, group_size: int = 128, multimodal: bool = False) -> dict:
    """The config.json `quantization_config` a scheme writes; `multimodal`: it also names the
    vision tower and projector (and the wrapper's output head) as left dense."""
    raw = _scheme_config(scheme, group_size)
    if multimodal:
        key = {"compressed-tensors": "ignore", "fp8": "modules_to_not_convert",
               "awq": "modules_to_not_convert"}.get(raw["quant_method"])
        if key is not None:
            dense = _VISION_IGNORE if key == "ignore" else ("visual", "vision_tower", "multi_modal_projector", "lm_head")
            raw[key] = list(raw.get(key) or []) + list(dense)
    return raw


# compressed-tensors' ignore entries (regexes over transformers' module names) for what an
# image-text checkpoint keeps dense: Qwen-VL's `visual`, LLaVA's / Gemma 3's `vision_tower` and
# `multi_modal_projector`, the wrapper's `lm_head` (`language_model.lm_head` in some layouts).
_VISION_IGNORE = ("re:.*visual.*", "re:.*vision_tower.*", "re:.*multi_modal_projector.*", "re:.*lm_head$")


def _scheme_config(scheme: str, group_size: int) -> dict:
    if scheme == "w4a16":
        return _ct(_int_weights(4, group_size), "pack-quantized")
    if scheme == "w4a16-asym":
        return _ct(_int_weights(4, group_size, symmetric=False), "pack-quantized")
    if scheme == "w8a16":
        return _ct(_int_weights(8, None), "pack-quantized")
    if scheme == "w8a8":
        return _ct(_int_weights(8, None), "int-quantized", {**_TOKEN_ACTS, "num_bits": 8, "type": "int"})
    if scheme == "fp8":
        return _ct({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
                   "float-quantized", {**_TOKEN_ACTS, "num_bits": 8, "type": "float"})
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group_size, group_size]}
    if scheme == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True, "desc_act": False,
                "checkpoint_format": "gptq"}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    raise ValueError(f"scheme: {scheme!r} is not one of {', '.join(SCHEMES)}")


SCHEMES = ("w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8", "fp8-block", "gptq", "awq")


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned b-bit values along the last dim into int32 words, value j of a word at bits
    [b j, b j + b) (the inverse of formats.unpack_words); the last dim is padded with zeros to
    whole words."""
    per = 32 // bits
    v = values.to(torch.int64)
    pad = -v.shape[-1] % per
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], -1, per) << (torch.arange(per) * bits)
    words = v.sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _grouped(w: torch.Tensor, group: int | None) -> torch.Tensor:
    """w [N, K] as [N, G, group] (one group of K per row when `group` is None)."""
    n, k = w.shape
    return w.reshape(n, 1 if group is None else k // group, -1)


def _round_int(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """(q unsigned [N, K], scale [N, G], zero unsigned [N, G]) with w ~ (q - zero) * scale."""
    wg = _grouped(w.float(), group)
    top = (1 << bits) - 1
    if symmetric:      # zero at the middle code, as compressed-tensors' and GPTQ's symmetric schemes
        scale = wg.abs().amax(-1) / (top / 2)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale.clamp(min=1e-12)).clamp(0, top)
    scale = scale.clamp(min=1e-12)
    q = torch.round(wg / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, top)
    return q.reshape(w.shape).to(torch.int32), scale, zero.to(torch.int32)


def quantize_weight(w: torch.Tensor, qc: QuantConfig, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One linear weight [N, K] as the tensors of `qc`'s layout (`formats.checkpoint_tensors`)."""
    n, k = w.shape
    b, group = qc.bits, qc.group_size
    if group and k % group:
        raise ValueError(f"group size {group} does not divide the {k} input columns")
    if qc.layout == "awq" and n % 8:
        raise ValueError(f"AWQ packs 8 output rows per word; {n} rows do not fill whole words")
    if qc.layout in ("ct-packed", "ct-int8"):
        q, scale, zero = _round_int(w, b, group, qc.symmetric)
        out = {"weight_scale": scale.to(scale_dtype)}
        offset = 1 << (b - 1)
        if qc.layout == "ct-packed":
            out["weight_packed"] = pack_words(q, b)
            out["weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not qc.symmetric:
                out["weight_zero_point"] = pack_words(zero.t(), b).t().contiguous()
        else:
            out["weight"] = (q - offset).to(torch.int8)
            if not qc.symmetric:
                out["weight_zero_point"] = (zero - offset).to(torch.int8)
        return out
    if qc.layout == "gptq":
        q, scale, zero = _round_int(w, b, group, qc.symmetric)
        zeros = (zero - qc.gptq_zero_offset) & ((1 << b) - 1)
        groups = torch.arange(k, dtype=torch.int32) // (group or k)
        return {"qweight": pack_words(q, b).t().contiguous(), "qzeros": pack_words(zeros.t(), b),
                "scales": scale.t().contiguous().to(scale_dtype), "g_idx": groups}
    if qc.layout == "awq":
        q, scale, zero = _round_int(w, 4, group, symmetric=False)
        order = torch.tensor(AWQ_ORDER)
        cols = (torch.arange(n).view(-1, 8) // 8 * 8 + order).view(-1)     # nibble j holds column ORDER[j]
        return {"qweight": pack_words(q.t()[:, cols], 4), "qzeros": pack_words(zero.t()[:, cols], 4),
                "scales": scale.t().contiguous().to(scale_dtype)}
    # FP8: one scale per tensor, row or block, so the largest magnitude maps to FP8_MAX.
    w32 = w.float()
    if qc.strategy == "block":
        bn, bk = qc.block
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w32.abs()
        scale = padded.reshape(rows, bn, cols, bk).amax((1, 3)) / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif qc.strategy == "channel":
        scale = w32.abs().amax(1, keepdim=True) / FP8_MAX
        full = scale
    else:
        scale = w32.abs().amax().reshape(1) / FP8_MAX
        full = scale
    scale = scale.clamp(min=1e-12)
    fp8 = (w32 / full.clamp(min=1e-12)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    name = "weight_scale_inv" if qc.layout == "fp8" and qc.strategy == "block" else "weight_scale"
    return {"weight": fp8, name: scale.to(torch.float32)}


def _read_all(src: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {src!r}")
    tensors = {}
    for fn in files:
        with safe_open(os.path.join(src, fn), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def quantize_checkpoint(src: str, dst: str, scheme: str, group_size: int = 128) -> QuantConfig:
    """Write `src` quantized by `scheme` into directory `dst`; returns the config written."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src!r} is already quantized ({config['quantization_config'].get('quant_method')})")
    arch = next(iter(config.get("architectures") or ()), None)
    multimodal = arch in MULTIMODAL_ARCHITECTURES
    raw = scheme_config(scheme, group_size, multimodal)
    qc = parse_quant_config(raw)
    if arch in UNQUANTIZABLE and not (arch in FP8_ONLY and not qc.integer):
        raise ValueError(f"{src!r} is a {arch} checkpoint: its quantized form is not served (Phi-3's fused "
                         "projections, DeepSeek's latent attention beyond FP8, gpt-oss's stacked experts)")
    tensors = _read_all(src)
    out = {}
    for name, t in tensors.items():
        prefix, _, param = name.rpartition(".")
        # An image-text checkpoint's text layers only (their names as the text model's): the tower
        # and projector stay dense, as released quantized image-text checkpoints keep them.
        local = text_module_name(prefix) if multimodal else prefix
        if param == "weight" and t.dim() == 2 and local.startswith("model.layers.") and qc.quantizes(local):
            try:
                packed = quantize_weight(t, qc, t.dtype)
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from None
            for key, value in packed.items():
                out[f"{prefix}.{key}"] = value.contiguous()
        else:
            out[name] = t.contiguous()
    os.makedirs(dst, exist_ok=True)
    for fn in os.listdir(src):
        if fn == "config.json" or fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            continue
        path = os.path.join(src, fn)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, fn))
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = raw
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return qc
