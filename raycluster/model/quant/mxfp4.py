"""MXFP4 expert weights as gpt-oss checkpoints store them (OCP microscaling: FP4 e2m1 values in
blocks of 32 sharing a power-of-two scale), dequantized at load.

A weight W [E, out, in] is stored as `{name}_blocks` uint8 [E, out, in / 32, 16] (32 values per
block, two per byte, the low nibble first) and `{name}_scales` uint8 [E, out, in / 32] (each
block's scale, an e8m0 exponent biased by 127). The model's parameter is W transposed,
[E, in, out] (gpt-oss's experts compute x @ W). `dequantize` turns a pair into the parameter,
one expert at a time so the transient stays one expert's size; `pack` is its inverse for weights
that MXFP4 holds exactly, and rounds others to the nearest value (tests write checkpoints with it).
`packed_param(name)` names the parameter a stored tensor of the pair belongs to.
"""

from __future__ import annotations

import torch

# e2m1 by its 4-bit code: sign in bit 3, then the magnitude's index.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
SUFFIXES = ("_blocks", "_scales")
PACKED_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_E2M1_EMAX = 2          # the largest e2m1 value, 6, is 1.5 * 2^2


def packed_param(name: str) -> str | None:
    """The expert weight parameter a stored `_blocks` / `_scales` tensor belongs to, or None."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)].endswith(PACKED_WEIGHTS):
            return name[:-len(suffix)]
    return None


def packed_shapes(param_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of a parameter [E, in, out] stored packed."""
    e, n_in, n_out = param_shape
    return (e, n_out, n_in // BLOCK, BLOCK // 2), (e, n_out, n_in // BLOCK)


def read_packed(read, stored: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The parameter of `shape` stored packed under `stored` (+ SUFFIXES): `read(name)` returns a
    checkpoint tensor (None if absent). ValueError naming the tensor if one is missing or misshapen."""
    tensors = []
    for suffix, want in zip(SUFFIXES, packed_shapes(shape)):
        t = read(stored + suffix)
        if t is None:
            raise ValueError(f"missing tensors in checkpoint: {stored + suffix}")
        if tuple(t.shape) != want:
            raise ValueError(f"shape mismatch for tensor {stored + suffix!r}: checkpoint {tuple(t.shape)}, "
                             f"model expects {want} (MXFP4 of {shape})")
        tensors.append(t)
    return dequantize(*tensors, dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [E, out, G, 16], scales uint8 [E, out, G] -> W^T [E, G * 32, out] in `dtype`
    (exact: every value is an e2m1 number times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    e, n_out, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty((e, groups * BLOCK, n_out), dtype=dtype)
    for i in range(e):
        b = blocks[i].long()
        values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).view(n_out, groups, BLOCK)
        values = torch.ldexp(values, (scales[i].long() - 127).unsqueeze(-1).float())
        out[i].copy_(values.view(n_out, groups * BLOCK).t())
    return out


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T [E, in, out] (in a multiple of 32) -> (blocks, scales): each block's scale 2^(floor(log2
    amax) - 2), values rounded to the nearest e2m1 number (ties to the larger magnitude)."""
    e, n_in, n_out = weight.shape
    if n_in % BLOCK:
        raise ValueError(f"MXFP4 packs blocks of {BLOCK} inputs; {n_in} inputs do not split into them")
    w = weight.detach().float().transpose(1, 2).reshape(e, n_out, n_in // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - _E2M1_EMAX,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = (w / torch.ldexp(torch.ones_like(exp), exp).unsqueeze(-1)).clamp(-6.0, 6.0)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()
