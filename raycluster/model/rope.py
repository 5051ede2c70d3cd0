"""Rotary position embeddings matching transformers (default, linear, llama3, YaRN and LongRoPE
scaling): inv_freq, an fp32 cos/sin cache (times YaRN's or LongRoPE's attention factor) cast to
the model dtype, and rotate_half application at per-token positions, on a head's first
`rotary_dim` dimensions (all of them unless the config turns only a share: Phi-4-mini's
partial_rotary_factor)."""

from __future__ import annotations

import math

import torch

from raycluster.model.config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's factor on cos/sin (so on q.k): `attention_factor` if given, else 0.1 ln(s) + 1, or
    the ratio of that with `mscale` over with `mscale_all_dim` when both are given."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
    return _yarn_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than `beta_fast`
    times keep their frequency, with a linear ramp over the dimensions between."""
    factor = float(scaling["factor"])
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:        # the dimension whose wave turns `turns` times over orig
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                # weight of the unscaled frequency
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """`head_dim`: the dimensions turned (the rotary dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if scaling and scaling["rope_type"] == "longrope":
        # The factor set fixed for the served context (raycluster.model.rope_config).
        return 1.0 / (torch.tensor(scaling["ext_factors"], dtype=torch.float32, device="cpu") * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if not scaling:
        return inv_freq
    rtype = scaling["rope_type"]
    if rtype == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor
    if rtype == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        low_wavelen = orig / low
        high_wavelen = orig / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope_type {rtype!r}")


class RotaryEmbedding:
    """Holds inv_freq; builds the [max_len, head_dim] cos/sin cache lazily per (device, dtype)
    and grows it if a position exceeds it."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                 interleaved: bool = False):
        self.head_dim = head_dim        # the dims turned: a model's rotary_dim
        self.interleaved = interleaved  # pairs (2i, 2i + 1) turn together (Cohere), not (i, i + d / 2)
        self.inv_freq = compute_inv_freq(head_dim, theta, scaling)
        rtype = scaling["rope_type"] if scaling else None
        self.attention_factor = yarn_attention_factor(scaling) if rtype == "yarn" else \
            float(scaling["attention_factor"]) if rtype == "longrope" else 1.0
        self.max_positions = max_positions
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "RotaryEmbedding":
        return cls(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                   cfg.rope_interleaved)

    def _build(self, n: int, device, dtype):
        t = torch.arange(n, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.repeat_interleave(freqs, 2, dim=-1) if self.interleaved else torch.cat([freqs, freqs], dim=-1)
        if self.attention_factor != 1.0:       # in fp32 before the cast, as transformers
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        key = (positions.device, dtype)
        cached = self._cache.get(key)
        need = int(positions.max().item()) + 1 if positions.numel() else 1
        if cached is None or cached[0].shape[0] < need:
            n = max(need, self.max_positions)
            cached = self._build(n, positions.device, dtype)
            self._cache[key] = cached
        return cached[0][positions], cached[1][positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved layout's rotate: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
    """q [T,Hq,D], k [T,Hkv,D], cos/sin [T,R] (already gathered at the tokens' positions): the
    first R <= D dimensions of each head turn, the rest pass. `interleaved`: the pairs are
    neighbouring dims (the tables built so: RotaryEmbedding(interleaved=True))."""
    rot = rotate_pairs if interleaved else rotate_half
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin
    qr, kr = q[..., :r], k[..., :r]
    return (torch.cat([qr * cos + rot(qr) * sin, q[..., r:]], dim=-1),
            torch.cat([kr * cos + rot(kr) * sin, k[..., r:]], dim=-1))
