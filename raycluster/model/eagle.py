"""EAGLE draft heads and their checkpoints (vLLM's speculative `method: eagle` and `eagle3`).

`EagleHead` is EAGLE-1's layout: a one- (or few-) layer Llama decoder that predicts the target
model's next final hidden state from its current one and the token that followed it.
forward(input_ids [T], positions [T], hidden [T, H], kv_cache, meta) -> (x, x):
x = fc(cat(embed(input_ids), hidden)), then the head's decoder layers (the first without its
input_layernorm, as EAGLE trains it) and no final norm; `compute_logits` is the target's output
head on x, and x is also the next drafting pass's hidden. The EAGLE-3 head
(raycluster.model.eagle3) answers the same calls. Row j pairs the target's feature at position j
with the token at j + 1 and runs at position j. The embedding and the output head are the
target's (an EAGLE-1 checkpoint's copies are ignored). A head's layers keep their KV under the
target's block ids, from layer `first_kv_layer` of the tensor the runner gives it (the last
layers of a single process's KV tensor; a TP / KVP leader's own tensor of whole heads): a request's
draft KV lives in its blocks and moves with them (KV handoff, prefix cache, preemption).

Checkpoints (`load_eagle_head(path, target, method)`): a directory with config.json (a Llama
config whose num_hidden_layers is the head's depth) and model.safetensors. EAGLE-1:
architectures LlamaForCausalLM or EagleLlamaForCausalLM, `fc.weight` (`fc.bias` if trained with
one), `layers.{i}.*`, with or without a `model.` prefix. EAGLE-3: architectures
LlamaForCausalLMEagle3 or Eagle3LlamaForCausalLM, `draft_vocab_size` (default the vocabulary),
optional `target_hidden_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids` (top
level or in `eagle_config`, with `use_aux_hidden_state`); tensors `fc.weight`, `midlayer.*` (or
`layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t`, optional `embed_tokens.weight` (`t2d` is
ignored). HASS' extra norms are refused. `save_eagle_head` writes these layouts.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.eagle3 import Eagle3Head, default_aux_layers
from raycluster.model.llama import DecoderLayer
from raycluster.model.checkpoint_files import CheckpointError, copy_into, read_tensors, weight_files
from raycluster.model.rope import RotaryEmbedding

ARCHITECTURES = {"eagle": ("LlamaForCausalLM", "EagleLlamaForCausalLM"),
                 "eagle3": ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")}


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
        self.aux_layers: tuple[int, ...] = ()      # reads the target's final hidden states

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        meta.prepare(kv_cache.device)
        embeds = self._target[0].model.embed_tokens(input_ids)
        x = self.fc(torch.cat((embeds, hidden.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[self.first_kv_layer + i], meta, backend)
        return x, x


def head_config(path: str | os.PathLike, method: str = "eagle") -> tuple[ModelConfig, dict]:
    """The head's config (a Llama config) and its raw dict; ModelConfigError for what it cannot be."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"EAGLE head directory {os.fspath(path)!r} has no config.json")
    with open(cfg_path) as f:
        data = json.load(f)
    archs = data.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES[method]:
        other = next((m for m, names in ARCHITECTURES.items() if archs and archs[0] in names), None)
        hint = f" (an {other} head: speculative_method {other!r})" if other else ""
        raise ModelConfigError(f"{cfg_path}: architectures {archs!r} is not an {method} head of a Llama-family "
                               f"model{hint}; {method} heads: {', '.join(ARCHITECTURES[method])}")
    if data.get("add_para_norm"):
        raise ModelConfigError(f"{cfg_path}: a HASS head (add_para_norm); not served")
    if method == "eagle" and ("draft_vocab_size" in data or "eagle_aux_hidden_state_layer_ids" in data):
        raise ModelConfigError(f"{cfg_path}: an EAGLE-3 head (draft_vocab_size / aux layers): speculative_method "
                               f"'eagle3'")
    return ModelConfig.from_dict({**data, "architectures": ["LlamaForCausalLM"]}), data


def _aux_layers(data: dict, num_target_layers: int) -> tuple[int, ...]:
    eagle_config = data.get("eagle_config") or {}
    ids = data.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else default_aux_layers(num_target_layers)
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"speculative_model: EAGLE-3 aux layers {list(ids)} are not three of the target's "
                         f"{num_target_layers} layers")
    return ids


def _head_tensors(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the head's own names (`model.` dropped, `midlayer.` ->
    `layers.0.`, `t2d` and rotary buffers dropped)."""
    tensors = {}
    for file in weight_files(path):
        for name, tensor in read_tensors(file):
            name = name.removeprefix("model.")
            if name.startswith("midlayer."):
                name = "layers.0." + name.removeprefix("midlayer.")
            if name != "t2d" and not name.endswith("rotary_emb.inv_freq"):
                tensors[name] = tensor
    return tensors


def load_eagle_head(path: str | os.PathLike, target, method: str = "eagle", dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", first_kv_layer: int | None = None):
    """The `method` ("eagle" or "eagle3") head at `path` for `target` (a loaded
    LlamaForCausalLM, or one holding just its embedding and head: `shard.load_vocab`), its KV
    from layer `first_kv_layer` of the tensor it is given (default: after the target's layers).
    ValueError when it does not fit the target (hidden size, vocabulary, KV heads, aux layers)."""
    path = os.fspath(path)
    (cfg, data), tcfg = head_config(path, method), target.config
    same = ("vocab_size", "num_key_value_heads", "head_dim") + (("hidden_size",) if method == "eagle" else ())
    for name in same:
        if getattr(cfg, name) != getattr(tcfg, name):
            raise ValueError(f"speculative_model: the EAGLE head's {name} is {getattr(cfg, name)}, the target's "
                             f"{getattr(tcfg, name)}; a head is trained for one target model")
    tensors = _head_tensors(path)
    first = tcfg.num_hidden_layers if first_kv_layer is None else first_kv_layer
    with torch.device("meta"):
        if method == "eagle":
            for name in ("embed_tokens.weight", "lm_head.weight"):      # the target's are used
                tensors.pop(name, None)
            head = EagleHead(cfg, target, first, fc_bias="fc.bias" in tensors)
        else:
            use_aux = (data.get("eagle_config") or {}).get("use_aux_hidden_state", True)
            if data.get("target_hidden_size", tcfg.hidden_size) != tcfg.hidden_size:
                raise ValueError(f"speculative_model: the EAGLE-3 head's target_hidden_size is "
                                 f"{data['target_hidden_size']}, the target's {tcfg.hidden_size}")
            if not use_aux and cfg.hidden_size != tcfg.hidden_size:
                raise ValueError(f"speculative_model: the EAGLE-3 head's hidden_size is {cfg.hidden_size}, the "
                                 f"target's {tcfg.hidden_size}, and it reads the target's last hidden state")
            head = Eagle3Head(cfg, target, first, _aux_layers(data, tcfg.num_hidden_layers) if use_aux else (),
                              int(data.get("draft_vocab_size") or cfg.vocab_size),
                              own_embedding="embed_tokens.weight" in tensors, target_hidden_size=tcfg.hidden_size,
                              norm_before_residual=bool(data.get("norm_before_residual", False)), use_aux=use_aux)
    head.to_empty(device=device)
    head.to(dtype)
    state = {**dict(head.named_parameters()), **dict(head.named_buffers())}
    copy_into(state, tensors, f"EAGLE head {path!r}", dtype, as_stored=("d2t",))
    missing = sorted(set(state) - set(tensors) - ({"d2t"} if method == "eagle3" else set()))
    if missing:
        raise CheckpointError(f"missing tensors in EAGLE head {path!r}: {', '.join(missing[:5])}")
    if method == "eagle3" and "d2t" not in tensors:
        if head.lm_head.out_features != cfg.vocab_size:
            raise CheckpointError(f"EAGLE head {path!r}: a draft vocabulary of {head.lm_head.out_features} tokens "
                                  f"needs its d2t mapping")
        head.d2t.zero_()
    head.eval()
    head.requires_grad_(False)
    return head


def save_eagle_head(head, config: dict, path: str | os.PathLike) -> None:
    """Write `head` (EAGLE-1 or EAGLE-3) as a checkpoint (`config`: its HF config dict) that
    `load_eagle_head` and vLLM read (EAGLE-3's first layer under the original `midlayer.`)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    state = {}
    for name, t in [*head.named_parameters(), *head.named_buffers()]:
        if isinstance(head, Eagle3Head) and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        state[name] = t.detach().contiguous().cpu()
    save_file(state, os.path.join(path, "model.safetensors"))
