"""The EAGLE draft head (EAGLE-1's layout, vLLM's speculative `method: eagle`): a one- (or few-)
layer Llama decoder that predicts the target model's next final hidden state from its current
one and the token that followed it.

forward(input_ids [T], positions [T], features [T, H], kv_cache, meta) -> hidden [T, H]:
x = fc(cat(embed(input_ids), features)), then the head's decoder layers (the first without its
input_layernorm, as EAGLE trains it) and no final norm; `compute_logits` is the target's output
head on that hidden. Row j pairs the target's feature at position j with the token at j + 1 and
runs at position j. The embedding and the output head are the target's (a head checkpoint's
copies are ignored). The head's layers keep their KV in the target's KV tensor, after the
target's own layers (`first_kv_layer`): a request's draft KV lives in its blocks and moves with
them (KV handoff, prefix cache, preemption).

Checkpoint (`load_eagle_head`): a directory with config.json (a Llama config whose
num_hidden_layers is the head's depth; architectures LlamaForCausalLM or EagleLlamaForCausalLM)
and model.safetensors holding `fc.weight` (`fc.bias` if trained with one) and `layers.{i}.*`, with
or without a `model.` prefix. EAGLE-3 heads (several target layers' features, a draft
vocabulary) and HASS' extra norms are refused. `save_eagle_head` writes that layout.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.llama import DecoderLayer
from raycluster.model.loader import CheckpointError, _read_tensors, _weight_files
from raycluster.model.rope import RotaryEmbedding

EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
_IGNORED = ("embed_tokens.weight", "lm_head.weight")    # the target's are used


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, target, first_kv_layer: int, fc_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = RotaryEmbedding.from_config(config)
        # The target's embedding and output head, shared: held in a tuple so that they are not
        # submodules (the head's `to_empty`, `to` and parameters never touch the target's).
        self._target = (target,)
        self.first_kv_layer = first_kv_layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                kv_cache: torch.Tensor, meta, backend) -> torch.Tensor:
        meta.prepare(kv_cache.device)
        embeds = self._target[0].model.embed_tokens(input_ids)
        x = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[self.first_kv_layer + i], meta, backend)
        return x


def head_config(path: str | os.PathLike) -> ModelConfig:
    """The head's config (a Llama config); ModelConfigError for what it cannot be."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"EAGLE head directory {os.fspath(path)!r} has no config.json")
    with open(cfg_path) as f:
        data = json.load(f)
    archs = data.get("architectures") or []
    if not archs or archs[0] not in EAGLE_ARCHITECTURES:
        raise ModelConfigError(f"{cfg_path}: architectures {archs!r} is not an EAGLE head of a Llama-family model "
                               f"(supported: {', '.join(EAGLE_ARCHITECTURES)})")
    if data.get("add_para_norm") or "draft_vocab_size" in data or "eagle_aux_hidden_state_layer_ids" in data:
        raise ModelConfigError(f"{cfg_path}: an EAGLE-3 or HASS head; only EAGLE-1 heads are served")
    return ModelConfig.from_dict({**data, "architectures": ["LlamaForCausalLM"]})


def load_eagle_head(path: str | os.PathLike, target, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> EagleHead:
    """The head at `path` for `target` (a loaded LlamaForCausalLM), its KV after the target's
    layers. ValueError when it does not fit the target (hidden size, vocabulary, KV heads)."""
    path = os.fspath(path)
    cfg, tcfg = head_config(path), target.config
    for name in ("hidden_size", "vocab_size", "num_key_value_heads", "head_dim"):
        if getattr(cfg, name) != getattr(tcfg, name):
            raise ValueError(f"speculative_model: the EAGLE head's {name} is {getattr(cfg, name)}, the target's "
                             f"{getattr(tcfg, name)}; a head is trained for one target model")
    tensors = {}
    for file in _weight_files(path):
        for name, tensor in _read_tensors(file):
            name = name.removeprefix("model.")
            if name not in _IGNORED and not name.endswith("rotary_emb.inv_freq"):
                tensors[name] = tensor
    with torch.device("meta"):
        head = EagleHead(cfg, target, tcfg.num_hidden_layers, fc_bias="fc.bias" in tensors)
    head.to_empty(device=device)
    head.to(dtype)
    params = dict(head.named_parameters())
    for name, tensor in tensors.items():
        p = params.get(name)
        if p is None:
            raise CheckpointError(f"unexpected tensor {name!r} in EAGLE head {path!r}")
        if tuple(tensor.shape) != tuple(p.shape):
            raise CheckpointError(f"shape mismatch for EAGLE head tensor {name!r}: checkpoint {tuple(tensor.shape)}, "
                                  f"head expects {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor.to(dtype))
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensors in EAGLE head {path!r}: {', '.join(missing[:5])}")
    head.eval()
    head.requires_grad_(False)
    return head


def save_eagle_head(head: EagleHead, config: dict, path: str | os.PathLike) -> None:
    """Write `head` as an EAGLE-1 checkpoint (`config`: its HF config dict) that
    `load_eagle_head` and vLLM read."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = {n: p.detach().contiguous().cpu() for n, p in head.named_parameters()}
    save_file(state, os.path.join(path, "model.safetensors"))
