"""The vision transformers of Qwen2-VL (transformers 5.24's `Qwen2VisionTransformerPretrainedModel`)
and Qwen2.5-VL (`Qwen2_5_VisionTransformerPretrainedModel`), as one module.

`QwenVisionSpec.from_config(vision_config, version)` reads a checkpoint's `vision_config` with
transformers' defaults ("qwen2_vl": `embed_dim` wide, LayerNorm, fc1 -> `hidden_act` (QuickGELU)
-> fc2 MLP of `mlp_ratio`, the merger out to `hidden_size`; "qwen2_5_vl": `hidden_size` wide,
RMSNorm, SwiGLU gate / up / down MLP of `intermediate_size` with biases, the merger out to
`out_hidden_size`, window attention in all blocks but `fullatt_block_indexes`).
`QwenVisionTower(spec)`'s parameter names are the checkpoint's below `visual.` (patch_embed.proj,
blocks.{i}.norm1 / norm2 / attn.qkv / attn.proj / mlp.*, merger.ln_q / merger.mlp.0 / .2), so a
loader copies tensors in by name.

Patch rows enter `forward(pixels [patches, C * T * P * P], grids [(t, h, w), ...])` (the
processor's rows of every image, concatenated, raycluster.model.qwen_vl_processor) and leave as
[patches / merge^2, out hidden]: each merge x merge block of patches merged into one token, in
the rows' order. Inside, a bias-free Conv3d (a linear map of each row) embeds the patches; every
block's attention is bidirectional within one image's frame (Qwen2.5-VL's windowed blocks: within
one window of window_size pixels), its queries and keys turned by a 2D rotary embedding (half the
rotated pairs by the patch's row, half by its column, theta 10000). Qwen2.5-VL first reorders the
merge blocks window by window (transformers' window_index) and restores the order after the merger.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.clip_vision import activation


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec:
    version: str                 # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    width: int                   # the blocks' hidden size
    heads: int
    mlp_hidden: int
    hidden_act: str
    out_hidden: int              # the merger's output: the text model's hidden size
    channels: int = 3
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0
    window_size: int | None = None                  # Qwen2.5-VL: a window's side in pixels
    fullatt_blocks: tuple[int, ...] = ()            # Qwen2.5-VL: blocks attending over the whole image

    @classmethod
    def from_config(cls, vision: dict, version: str) -> "QwenVisionSpec":
        """From a vision_config dict, with Qwen2VLVisionConfig's / Qwen2_5_VLVisionConfig's defaults."""
        if not isinstance(vision, dict):
            raise ValueError(f"config field 'vision_config' must be an object, got {vision!r}")
        get = vision.get
        if version == "qwen2_vl":
            width = get("embed_dim", 1280)
            fields = dict(width=width, mlp_hidden=int(width * get("mlp_ratio", 4)),
                          hidden_act=get("hidden_act", "quick_gelu"), out_hidden=get("hidden_size", 3584))
        else:
            fields = dict(width=get("hidden_size", 3584), mlp_hidden=get("intermediate_size", 3420),
                          hidden_act=get("hidden_act", "silu"), out_hidden=get("out_hidden_size", 3584),
                          window_size=get("window_size", 112),
                          fullatt_blocks=tuple(get("fullatt_block_indexes", (7, 15, 23, 31))))
        rope = get("rope_parameters") or {}
        spec = cls(version=version, depth=get("depth", 32), heads=get("num_heads", 16), channels=get("in_channels", 3),
                   patch_size=get("patch_size", 14), merge_size=get("spatial_merge_size", 2),
                   temporal_patch_size=get("temporal_patch_size", 2),
                   rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))), **fields)
        spec.validate()
        return spec

    def validate(self) -> None:
        activation(self.hidden_act, "vision_config.hidden_act")
        for name in ("depth", "width", "heads", "mlp_hidden", "out_hidden", "channels", "patch_size", "merge_size",
                     "temporal_patch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision_config: {name} = {value!r} must be a positive int")
        if self.width % self.heads or (self.width // self.heads) % 4:
            raise ValueError(f"vision_config: a width of {self.width} over {self.heads} heads must give a head size "
                             "that is a multiple of 4 (2D rotary embedding)")
        if self.window_size is not None and self.window_size // self.merge_size // self.patch_size < 1:
            raise ValueError(f"vision_config.window_size = {self.window_size}: a window must hold at least one "
                             f"{self.merge_size * self.patch_size}-pixel merge block")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size ** 2


class _RMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm: normalized in float32, cast back before the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.empty(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(spec: QwenVisionSpec, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6) if spec.version == "qwen2_vl" else _RMSNorm(dim)


class _Mlp(nn.Module):
    """Qwen2-VL's fc1 -> act -> fc2."""

    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(spec.width, spec.mlp_hidden), nn.Linear(spec.mlp_hidden, spec.width)
        self.act = activation(spec.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMlp(nn.Module):
    """Qwen2.5-VL's act(gate) * up -> down, all with biases."""

    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.width, spec.mlp_hidden)
        self.up_proj = nn.Linear(spec.width, spec.mlp_hidden)
        self.down_proj = nn.Linear(spec.mlp_hidden, spec.width)
        self.act = activation(spec.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention of [N, heads, D] queries within each run of `lengths` rows; runs of
    one length go through one batched call (a real image has many windows of the same size)."""
    out = torch.empty_like(q)
    starts, at = defaultdict(list), 0
    for n in lengths:
        starts[n].append(at)
        at += n
    for n, firsts in starts.items():
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        q_, k_, v_ = (t[rows].view(len(firsts), n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(q_, k_, v_, scale=q.shape[-1] ** -0.5).transpose(1, 2).reshape(
            -1, *q.shape[1:])
    return out


class _Attention(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.heads = spec.heads
        self.qkv, self.proj = nn.Linear(spec.width, 3 * spec.width), nn.Linear(spec.width, spec.width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        # transformers turns q and k in float32 (cos / sin [N, 1, D]) and casts back.
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        return self.proj(segment_attention(q, k, v, lengths).reshape(n, -1))


class _Block(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.norm1, self.norm2 = _norm(spec, spec.width), _norm(spec, spec.width)
        self.attn = _Attention(spec)
        self.mlp = _Mlp(spec) if spec.version == "qwen2_vl" else _GatedMlp(spec)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """Each merge x merge block's normalized states, side by side, through Linear -> GELU -> Linear."""

    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.merged = spec.width * spec.merge_size ** 2
        self.ln_q = _norm(spec, spec.width)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, spec.out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class _PatchEmbed(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.channels, spec.width, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A kernel as large as its stride over one patch: the conv is a linear map of the row.
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


def rotary_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch in the processor's merge-block order (every frame alike)."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        pos = torch.stack([p.reshape(block).transpose(1, 2).flatten() for p in (rows, cols)], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' get_vision_window_index: the merge blocks (units of merge^2 patches) of every
    image reordered window by window (side x side blocks; windows and blocks in each row-major,
    frame by frame), and each window's patch count."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = torch.arange(t * rows * cols).view(t, rows, cols) + base
        for frame in index:
            for r in range(0, rows, side):
                for c in range(0, cols, side):
                    window = frame[r:r + side, c:c + side].flatten()
                    order.append(window)
                    lengths.append(window.numel() * merge * merge)
        base += t * rows * cols
    return torch.cat(order), lengths


class QwenVisionTower(nn.Module):
    """The whole tower (module docstring)."""

    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        spec, unit = self.spec, self.spec.merge_size ** 2
        x = self.patch_embed(pixels)
        cos, sin = self._rotary(rotary_positions(grids, spec.merge_size).to(x.device))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        windows, order = frames, None
        if spec.window_size is not None:
            side = spec.window_size // spec.merge_size // spec.patch_size      # in merge blocks
            order, windows = window_order(grids, spec.merge_size, side)
            order = order.to(x.device)
            rows = (order[:, None] * unit + torch.arange(unit, device=x.device)).flatten()
            x, cos, sin = x[rows], cos[rows], sin[rows]
        for i, block in enumerate(self.blocks):
            full = spec.window_size is None or i in spec.fullatt_blocks
            x = block(x, cos, sin, frames if full else windows)
        out = self.merger(x)
        return out if order is None else out[torch.argsort(order)]

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos / sin [N, 1, head_dim]: a quarter of the frequencies turned by the row, a
        quarter by the column, the halves repeated (rotate_half pairs dim i with i + D / 2)."""
        quarter = self.spec.head_dim // 2
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float,
                                                                device=positions.device) / quarter))
        freqs = (positions[..., None].float() * inv_freq).flatten(1)        # [N, rows' then columns' freqs]
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()
