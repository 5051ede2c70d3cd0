"""The vision transformer of Qwen3-VL and Qwen3-VL-MoE (transformers 5.24's `Qwen3VLVisionModel`,
`Qwen3VLMoeVisionModel`: the same module), with its DeepStack mergers.

`Qwen3VisionSpec.from_config(vision_config)` reads a checkpoint's `vision_config` with
`Qwen3VLVisionConfig`'s defaults (LayerNorm blocks `hidden_size` wide, fc1 -> `hidden_act`
(gelu_pytorch_tanh) -> fc2 MLP of `intermediate_size`, a learned table of
`num_position_embeddings` positions (a square grid), axial 2D rotary, the mergers out to
`out_hidden_size`, a DeepStack merger after each block in `deepstack_visual_indexes`) and refuses
what the tower cannot run with a ValueError naming the field. `Qwen3VisionTower(spec)`'s parameter
names are the checkpoint's below `visual.` / `model.visual.` (patch_embed.proj, pos_embed,
blocks.{i}.norm1 / norm2 / attn.qkv / attn.proj / mlp.linear_fc1 / mlp.linear_fc2,
merger.norm / linear_fc1 / linear_fc2, deepstack_merger_list.{k}.*), so a loader copies tensors in
by name.

Patch rows enter `forward(pixels [patches, C * T * P * P], grids [(t, h, w), ...])` (the
processor's rows of every image, concatenated, raycluster.model.qwen_vl_processor) and leave as
(merged [patches / merge^2, out hidden], [one such tensor per DeepStack level]): each merge x merge
block of patches becomes one token, in the rows' order; level k is the merger output of the k-th
DeepStack block in depth order (what the text model adds after its decoder layer k). Inside, a
Conv3d with bias (a linear map of each row) embeds the patches; the learned position table is
resampled bilinearly (align_corners) to each image's patch grid and added; every block's attention
is bidirectional within one image's frame, queries and keys turned by the 2D rotary embedding
Qwen2-VL uses (raycluster.model.qwen_vision, whose attention module this reuses).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.clip_vision import activation
# Qwen2-VL's attention (qkv with bias, rotary turned in float32, attention per frame) and the
# patches' (row, column) in merge-block order are Qwen3-VL's as they are.
from raycluster.model.qwen_vision import _Attention, rotary_positions


@dataclasses.dataclass(frozen=True)
class Qwen3VisionSpec:
    depth: int = 27
    width: int = 1152                # the blocks' hidden size
    heads: int = 16
    mlp_hidden: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    out_hidden: int = 3584           # the mergers' output: the text model's hidden size
    num_positions: int = 2304        # the learned position table: a square grid of side sqrt(this)
    deepstack: tuple[int, ...] = (8, 16, 24)
    channels: int = 3
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, vision: dict) -> "Qwen3VisionSpec":
        """From a vision_config dict, with Qwen3VLVisionConfig's defaults."""
        if not isinstance(vision, dict):
            raise ValueError(f"config field 'vision_config' must be an object, got {vision!r}")
        defaults, get = cls(), vision.get
        rope = get("rope_parameters") or {}
        kind = rope.get("rope_type", "axial")
        if kind != "axial":
            raise ValueError(f"config field 'vision_config.rope_parameters.rope_type' = {kind!r}: the Qwen3-VL tower "
                             "turns queries and keys by the axial 2D rotary embedding only")
        indexes = get("deepstack_visual_indexes", defaults.deepstack)
        if not isinstance(indexes, (list, tuple)):
            raise ValueError(f"config field 'vision_config.deepstack_visual_indexes' = {indexes!r}: expected a list")
        spec = cls(depth=get("depth", defaults.depth), width=get("hidden_size", defaults.width),
                   heads=get("num_heads", defaults.heads), mlp_hidden=get("intermediate_size", defaults.mlp_hidden),
                   hidden_act=get("hidden_act", defaults.hidden_act),
                   out_hidden=get("out_hidden_size", defaults.out_hidden),
                   num_positions=get("num_position_embeddings", defaults.num_positions), deepstack=tuple(indexes),
                   channels=get("in_channels", 3), patch_size=get("patch_size", 16),
                   merge_size=get("spatial_merge_size", 2), temporal_patch_size=get("temporal_patch_size", 2),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))
        spec.validate()
        return spec

    def validate(self) -> None:
        activation(self.hidden_act, "vision_config.hidden_act")
        fields = {"depth": "depth", "width": "hidden_size", "heads": "num_heads", "mlp_hidden": "intermediate_size",
                  "out_hidden": "out_hidden_size", "num_positions": "num_position_embeddings",
                  "channels": "in_channels", "patch_size": "patch_size", "merge_size": "spatial_merge_size",
                  "temporal_patch_size": "temporal_patch_size"}
        for name, field in fields.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field 'vision_config.{field}' = {value!r} must be a positive int")
        if self.width % self.heads or (self.width // self.heads) % 4:
            raise ValueError(f"vision_config: a hidden_size of {self.width} over {self.heads} heads must give a head "
                             "size that is a multiple of 4 (2D rotary embedding)")
        # transformers builds a merger per index but runs only those of blocks it has, once each:
        # any other list would leave the text model fewer levels than the mergers stored.
        bad = [i for i in self.deepstack if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.depth]
        if bad or len(set(self.deepstack)) != len(self.deepstack):
            raise ValueError(f"config field 'vision_config.deepstack_visual_indexes' = {list(self.deepstack)!r}: "
                             f"expected distinct block indexes in [0, {self.depth})")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        """The position table's side, as transformers takes it (int(sqrt(num_position_embeddings)))."""
        return int(self.num_positions ** 0.5)


class _Mlp(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec):
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.width, spec.mlp_hidden)
        self.linear_fc2 = nn.Linear(spec.mlp_hidden, spec.width)
        self.act = activation(spec.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(spec.width, eps=1e-6), nn.LayerNorm(spec.width, eps=1e-6)
        self.attn = _Attention(spec)
        self.mlp = _Mlp(spec)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """Each merge x merge block's states side by side through LayerNorm -> Linear -> GELU -> Linear;
    the final merger normalizes each patch's state before joining them, a DeepStack merger
    (`postshuffle`) the joined row."""

    def __init__(self, spec: Qwen3VisionSpec, postshuffle: bool):
        super().__init__()
        self.merged, self.postshuffle = spec.width * spec.merge_size ** 2, postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else spec.width, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, spec.out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, spec: Qwen3VisionSpec):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.channels, spec.width, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A kernel as large as its stride over one patch: the conv is a linear map of the row.
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' bilinear, align_corners taps of a `side`-long table axis for positions `index`
    on an axis of `size`: [n, 2] table indexes (floor, floor + 1, clamped) and their weights."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    # Written as transformers writes it (|src - tap|), so the weights agree to the bit.
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(positions: torch.Tensor, grids: list[tuple[int, int, int]], side: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[patches, 4] indexes into the flattened side x side position table and their bilinear weights,
    for the patches at `positions` ([patches, 2] (row, column), raycluster.model.qwen_vision's
    rotary_positions of `grids`) (transformers' get_vision_interpolation_indices_and_weights: each
    image's grid spans the whole table)."""
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])
    row_taps, row_weights = _axis_taps(positions[:, 0], heights, side)
    col_taps, col_weights = _axis_taps(positions[:, 1], widths, side)
    indexes = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indexes, weights


class Qwen3VisionTower(nn.Module):
    """The whole tower (module docstring)."""

    def __init__(self, spec: Qwen3VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_positions, spec.width)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.depth))
        self.merger = _Merger(spec, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(_Merger(spec, postshuffle=True) for _ in spec.deepstack)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        spec = self.spec
        x = self.patch_embed(pixels)
        positions = rotary_positions(grids, spec.merge_size)
        indexes, weights = (t.to(x.device) for t in position_taps(positions, grids, spec.grid_side))
        x = x + (self.pos_embed(indexes) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin = self._rotary(positions.to(x.device))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in spec.deepstack:
                # Levels in depth order, each through the merger listed at its index (as transformers).
                levels.append(self.deepstack_merger_list[spec.deepstack.index(i)](x))
        return self.merger(x), levels

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos / sin [N, 1, head_dim]: a quarter of the frequencies turned by the row, a
        quarter by the column, the halves repeated (rotate_half pairs dim i with i + D / 2)."""
        quarter = self.spec.head_dim // 2
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float,
                                                                device=positions.device) / quarter))
        freqs = (positions[..., None].float() * inv_freq).flatten(1)        # [N, rows' then columns' freqs]
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()
