"""The CLIP vision transformer (transformers' `CLIPVisionModel`), as LLaVA reads features off it.

`ClipVisionTower(vision_config, num_layers=None, post_layernorm=False)` is built from a
checkpoint's `vision_config` dict; its parameter names are the checkpoint's below the tower's
prefix (`embeddings.*`, `pre_layrnorm.*`, `encoder.layers.{i}.*`, `post_layernorm.*`), so a
loader copies tensors in by name. `num_layers` keeps only the first layers (LLaVA reads the
second-to-last layer, so the last is never built nor loaded); `post_layernorm` (applied by
transformers to the pooled CLS vector only) exists only when asked for, to write checkpoints.

Pixels enter `hidden_states(pixel_values [N, C, S, S], indices)` and leave as the hidden states
transformers' `hidden_states[k]` would hold for each index: k = 0 is the embeddings after
`pre_layrnorm` (the encoder's input), k the output of layer k, negative k counted from the end of
the full tower's num_hidden_layers + 1 states. Only the layers up to the deepest index run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN entries a CLIP tower or LLaVA projector may name.
ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


def positive_int(value, field: str) -> int:
    """`value` if it is a positive int, else ValueError naming the config field (vision towers' specs)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {field!r} = {value!r}: expected a positive int")
    return value


def activation(name: str, field: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"config field {field!r} = {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def hidden_state_index(index: int, num_hidden_layers: int) -> int:
    """transformers' hidden_states index (negative: from the end of num_hidden_layers + 1 states)
    as the number of layers run before that state; ValueError out of range."""
    count = num_hidden_layers + 1
    if not -count <= index < count:
        raise ValueError(f"vision feature layer {index} is out of range for a tower of {num_hidden_layers} layers "
                         f"({count} hidden states)")
    return index % count


class _Embeddings(nn.Module):
    def __init__(self, hidden: int, channels: int, image_size: int, patch: int):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((image_size // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)     # [N, P, H], row-major patches
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision_config.hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (p(x).view(n, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                      self.v_proj))
        # Every token sees every token (no mask), as transformers' sdpa path computes it.
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float, act):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn, self.mlp = _Attention(hidden, heads), _MLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, layers: list[_EncoderLayer]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class ClipVisionTower(nn.Module):
    """CLIPVisionModel's layers (module docstring); `num_hidden_layers` is the full tower's depth."""

    def __init__(self, vision_config: dict, num_layers: int | None = None, post_layernorm: bool = False):
        super().__init__()
        c = vision_config
        try:
            hidden, intermediate = int(c["hidden_size"]), int(c["intermediate_size"])
            self.num_hidden_layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
            self.image_size, self.patch_size = int(c["image_size"]), int(c["patch_size"])
        except KeyError as e:
            raise ValueError(f"config field 'vision_config.{e.args[0]}' is missing") from e
        self.hidden_size, self.num_channels = hidden, int(c.get("num_channels", 3))
        eps, act = float(c.get("layer_norm_eps", 1e-5)), activation(c.get("hidden_act", "quick_gelu"),
                                                                    "vision_config.hidden_act")
        built = self.num_hidden_layers if num_layers is None else num_layers
        if not 0 <= built <= self.num_hidden_layers:
            raise ValueError(f"cannot build {built} of the tower's {self.num_hidden_layers} layers")
        self.embeddings = _Embeddings(hidden, self.num_channels, self.image_size, self.patch_size)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps)
        self.encoder = _Encoder([_EncoderLayer(hidden, intermediate, heads, eps, act) for _ in range(built)])
        if post_layernorm:
            self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def hidden_states(self, pixel_values: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """The hidden state [N, 1 + patches, hidden] at each of `indices` (module docstring)."""
        wanted = [hidden_state_index(i, self.num_hidden_layers) for i in indices]
        deepest = max(wanted)
        if deepest > len(self.encoder.layers):
            raise ValueError(f"hidden state {deepest} needs layers this tower was built without "
                             f"({len(self.encoder.layers)} built)")
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for k, layer in enumerate(self.encoder.layers[:deepest], start=1):
            x = layer(x)
            states[k] = x
        return [states[k] for k in wanted]
