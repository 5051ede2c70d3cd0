"""The sentence-transformers Dense modules of an embedding checkpoint, applied to a pooled
vector before it leaves the engine (vLLM's pooler projector): each `y = act(W x + b)`, plus the
input (or a bias-free projection of it) when the module has a residual.

`load_projector(model_dir, pooler, dtype, device)` reads each module's `model.safetensors`
(`linear.weight`, `linear.bias`, `residual.weight`) from the directory its `DenseSpec` names,
checked against the spec's shapes; the engine applies `Projector` to each pooled fp32 vector.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from raycluster.model.pooling import DenseSpec, PoolerConfig

_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu,
                "sigmoid": torch.sigmoid, "silu": F.silu}


class Projector:
    """The Dense modules in order; `__call__` maps a pooled fp32 vector [H] to the output."""

    def __init__(self, layers: list[tuple[DenseSpec, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]):
        self.layers = layers        # (spec, weight [out, in], bias [out] | None, residual [out, in] | None)

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for spec, w, b, r in self.layers:
            y = _ACTIVATIONS[spec.activation](F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)))
            if spec.residual:
                y = y + (x if r is None else F.linear(x, r.to(x.dtype)))
            x = y
        return x


def load_projector(model_dir: str, pooler: PoolerConfig, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Projector | None:
    """The checkpoint's Dense modules (None without any); ValueError naming the file and tensor
    when one is missing or misshapen."""
    if not pooler.dense:
        return None
    layers = []
    for spec in pooler.dense:
        file = os.path.join(model_dir, spec.path, "model.safetensors")
        if not os.path.exists(file):
            raise ValueError(f"Dense module {spec.path!r}: no {file} (only safetensors weights are read)")
        sd = load_file(file, device=str(device))
        want = {"linear.weight": (spec.out_features, spec.in_features)}
        if spec.bias:
            want["linear.bias"] = (spec.out_features,)
        if spec.residual and spec.in_features != spec.out_features:
            want["residual.weight"] = (spec.out_features, spec.in_features)
        for name, shape in want.items():
            if name not in sd or tuple(sd[name].shape) != shape:
                got = tuple(sd[name].shape) if name in sd else "missing"
                raise ValueError(f"Dense module {spec.path!r}: {name} is {got}, its config says {shape}")
        extra = sorted(set(sd) - set(want))
        if extra:
            raise ValueError(f"Dense module {spec.path!r}: unexpected tensors {extra}")
        layers.append((spec, sd["linear.weight"].to(dtype), sd["linear.bias"].to(dtype) if spec.bias else None,
                       sd["residual.weight"].to(dtype) if "residual.weight" in want else None))
    return Projector(layers)
