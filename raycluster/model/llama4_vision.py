"""Llama 4's vision tower and its pixel-shuffle adapter (transformers 5.24's `Llama4VisionModel`,
the model's `vision_model`), as Llama4ForConditionalGeneration reads image features off it
(raycluster.model.llama4_image adds the projector and the prompt layout).

`Llama4VisionSpec.from_config(vision_config, field="vision_config")` reads a checkpoint's
`vision_config` with transformers' Llama4VisionConfig defaults for the fields it leaves out (errors:
ValueError naming the field), and refuses the shapes transformers' modules could not run: heads of
a width that is not a multiple of 4 (the 2-D rotary turns half the pairs by the column, half by the
row), a `pixel_shuffle_ratio` that is not 1 / k for an integer k dividing the patch grid, an
`intermediate_size` other than hidden_size x k^2 (the adapter's first linear takes the shuffled
patches), `projector_input_dim` != `projector_output_dim` (the adapter's second linear is square
over the first's output) and `vision_output_dim` != `projector_output_dim` (the projector's input).
The rotary's base is `rope_parameters.rope_theta` (or the older top-level `rope_theta`; 10000).
transformers ignores `hidden_act` (its MLPs are exact GELU), `norm_eps` (its LayerNorms keep
torch's 1e-5), `vision_feature_layer` / `vision_feature_select_strategy` and
`multi_modal_projector_bias` (the last layer's output always, no bias): so does this module.

`Llama4VisionModel(spec)` holds the tower under transformers' names below the wrapper's
`vision_model.`: `patch_embedding.linear.weight` (unfolded patches, no bias), `class_embedding`,
`positional_embedding_vlm`, `layernorm_pre`, `layernorm_post`, `model.layers.{i}.` {`self_attn.
{q,k,v,o}_proj`, `mlp.fc1`, `mlp.fc2` (biases), `input_layernorm`, `post_attention_layernorm`}, and
`vision_adapter.mlp.{fc1,fc2}.weight`, so a loader copies tensors in by name. Tiles enter
`Llama4VisionModel(tiles)` as [N, C, S, S] (S = image_size); each is cut into patches (row-major),
a class token appended after them, position embeddings added; the layers attend within each tile,
unmasked, each patch turned by the rotary of its (column, row) (the class token not at all); the
class token is dropped, the grid shuffled (each k x k block of patches into one token of k^2 times
the width) and run through the adapter (fc1 -> GELU -> fc2 -> GELU). They leave as
[N, tokens_per_tile, projector_output_dim].
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.clip_vision import positive_int

# transformers' Llama4VisionConfig defaults, for the fields a config leaves out.
LLAMA4_VISION_DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 34, "num_attention_heads": 16, "num_channels": 3,
                          "intermediate_size": 5632, "vision_output_dim": 7680, "image_size": 448, "patch_size": 14,
                          "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096, "projector_output_dim": 4096}
DEFAULT_ROPE_THETA = 10_000.0
# Every LayerNorm of transformers' tower is nn.LayerNorm(hidden) with torch's default epsilon.
NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Llama4VisionSpec:
    """A Llama 4 tower's shape (module docstring); `shuffle` is k = 1 / pixel_shuffle_ratio."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    vision_output_dim: int
    projector_input_dim: int
    projector_output_dim: int
    shuffle: int
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches along a tile's side (Unfold drops a remainder, as transformers' does)."""
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return (self.grid // self.shuffle) ** 2

    @classmethod
    def from_config(cls, vision_config, field: str = "vision_config") -> "Llama4VisionSpec":
        if not isinstance(vision_config, dict):
            raise ValueError(f"config field {field!r} must be an object, got {vision_config!r}")
        kind = vision_config.get("model_type", "llama4_vision_model")
        if kind != "llama4_vision_model":
            raise ValueError(f"config field '{field}.model_type' = {kind!r}: expected 'llama4_vision_model'")
        c = {**LLAMA4_VISION_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                 "image_size", "patch_size", "vision_output_dim", "projector_input_dim", "projector_output_dim")
        ints = {name: positive_int(c[name], f"{field}.{name}") for name in names}
        hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
        if hidden % heads or (hidden // heads) % 4:
            raise ValueError(f"config field '{field}.hidden_size' = {hidden} must be {field}.num_attention_heads "
                             f"({heads}) heads of a width divisible by 4 (the 2-D rotary's column and row halves)")
        grid = ints["image_size"] // ints["patch_size"]
        if grid < 1:
            raise ValueError(f"config field '{field}.image_size' = {ints['image_size']} is smaller than a "
                             f"{ints['patch_size']}-pixel patch")
        k = _shuffle(c["pixel_shuffle_ratio"], hidden, grid, f"{field}.pixel_shuffle_ratio")
        if ints["intermediate_size"] != hidden * k * k:
            raise ValueError(f"config field '{field}.intermediate_size' = {ints['intermediate_size']}: the adapter's "
                             f"fc1 takes the shuffled patches, hidden_size x {k * k} = {hidden * k * k} wide")
        if ints["projector_input_dim"] != ints["projector_output_dim"]:
            raise ValueError(f"config field '{field}.projector_input_dim' = {ints['projector_input_dim']} must equal "
                             f"projector_output_dim ({ints['projector_output_dim']}): the adapter's fc2 is square")
        if ints["vision_output_dim"] != ints["projector_output_dim"]:
            raise ValueError(f"config field '{field}.vision_output_dim' = {ints['vision_output_dim']} must equal "
                             f"projector_output_dim ({ints['projector_output_dim']}), the projector's input")
        return cls(**ints, shuffle=k, rope_theta=_rope_theta(vision_config, field))


def _shuffle(ratio, hidden: int, grid: int, field: str) -> int:
    """k of a pixel_shuffle_ratio 1 / k whose shuffle transformers can run on this grid exactly (its
    int() of each shuffled size must be the true one), else ValueError naming the field."""
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1:
        k = round(1 / ratio)
        if abs(1 / ratio - k) < 1e-9 and grid % k == 0 and int(grid * ratio) == grid // k and \
                int(hidden / ratio) == hidden * k and int(hidden / ratio ** 2) == hidden * k * k:
            return k
    raise ValueError(f"config field {field!r} = {ratio!r}: expected 1 / k for an integer k dividing the "
                     f"{grid}-patch grid (0.5 as released)")


def _rope_theta(vision_config: dict, field: str) -> float:
    rope = vision_config.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"config field '{field}.rope_parameters' = {rope!r}: expected an object")
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"config field '{field}.rope_parameters.rope_type' = {kind!r}: Llama 4's tower takes only "
                         "its own 2-D rotary ('default')")
    name = "rope_parameters.rope_theta" if rope.get("rope_theta") is not None else "rope_theta"
    theta = rope.get("rope_theta", vision_config.get("rope_theta"))
    theta = DEFAULT_ROPE_THETA if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"config field '{field}.{name}' = {theta!r}: expected a positive number")
    return float(theta)


class _PatchEmbedding(nn.Module):
    """Llama4UnfoldConvolution: unfolded patches (channel, row, column within a patch) -> linear."""

    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.patch_size = spec.patch_size
        self.linear = nn.Linear(spec.num_channels * spec.patch_size ** 2, spec.hidden_size, bias=False)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        return self.linear(F.unfold(tiles, kernel_size=self.patch_size, stride=self.patch_size).permute(0, 2, 1))


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (proj(x).view(n, length, self.heads, self.head_dim) for proj in (self.q_proj, self.k_proj,
                                                                                   self.v_proj))
        # vision_apply_rotary_emb: adjacent pairs as complex numbers, turned in float32, cast back.
        q, k = (torch.view_as_real(torch.view_as_complex(t.float().reshape(n, length, self.heads, -1, 2))
                                   * freqs[None, :, None]).flatten(3).type_as(t) for t in (q, k))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.self_attn = _Attention(spec.hidden_size, spec.num_attention_heads)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.mlp = _MLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), freqs)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Encoder(nn.Module):
    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_hidden_layers))


class _AdapterMLP(nn.Module):
    """Llama4VisionMLP2: fc1 -> GELU -> fc2 -> GELU, no biases."""

    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.fc1 = nn.Linear(spec.intermediate_size, spec.projector_input_dim, bias=False)
        self.fc2 = nn.Linear(spec.projector_output_dim, spec.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class _Adapter(nn.Module):
    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.shuffle = spec.shuffle
        self.mlp = _AdapterMLP(spec)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """transformers' pixel_shuffle with ratio 1 / k, step for step (its block order), then the MLP."""
        n, count, c = patches.shape
        g, k = int(count ** 0.5), self.shuffle
        x = patches.reshape(n, g, g // k, c * k).permute(0, 2, 1, 3).contiguous()
        x = x.view(n, g // k, g // k, c * k * k).permute(0, 2, 1, 3).contiguous()
        return self.mlp(x.view(n, -1, c * k * k))


class Llama4VisionModel(nn.Module):
    """[N, C, S, S] tiles -> [N, tokens_per_tile, projector_output_dim] (module docstring)."""

    def __init__(self, spec: Llama4VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embedding = _PatchEmbedding(spec)
        self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(spec.grid ** 2 + 1, spec.hidden_size))
        self.layernorm_pre = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.layernorm_post = nn.LayerNorm(spec.hidden_size, eps=NORM_EPS)
        self.model = _Encoder(spec)
        self.vision_adapter = _Adapter(spec)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.linear.weight.dtype

    def rotary(self) -> torch.Tensor:
        """complex64 [grid^2 + 1, head_dim / 2]: Llama4VisionRotaryEmbedding's freqs_ci (the first
        quarter of a head's pairs turned by the patch's column + 1, the second by its row + 1, the
        class token by nothing). Computed here in float32, not kept as a buffer a meta-device build
        or a dtype cast would spoil."""
        s, device = self.spec, self.class_embedding.device
        idx = torch.arange(s.grid ** 2 + 1, device=device)
        columns, rows = idx % s.grid + 1, idx // s.grid + 1
        freq_dim = s.head_dim // 2
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, freq_dim, 2, device=device)[:freq_dim // 2].float() / freq_dim))
        freqs = torch.cat([columns[:, None] * inv, rows[:, None] * inv], dim=-1).float()
        freqs[-1] = 0       # the class token (transformers' id -2)
        return torch.view_as_complex(torch.stack([freqs.cos(), freqs.sin()], dim=-1))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (s.num_channels, s.image_size, s.image_size):
            raise ValueError(f"tiles must be [N, {s.num_channels}, {s.image_size}, {s.image_size}], "
                             f"got {list(tiles.shape)}")
        x = self.patch_embedding(tiles.to(self.dtype))
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1) + self.positional_embedding_vlm
        x = self.layernorm_pre(x)
        freqs = self.rotary()
        for layer in self.model.layers:
            x = layer(x, freqs)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])
