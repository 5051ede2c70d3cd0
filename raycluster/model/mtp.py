"""DeepSeek-V3's (and GLM-4.5's) multi-token-prediction layer as a draft head (vLLM's speculative
`method: deepseek_mtp`, here `mtp`): the checkpoint's extra layer after the decoder's
(`num_nextn_predict_layers`; the first is used), under its names `model.layers.{L}.*`.

`MTPHead` answers the EAGLE head's calls (raycluster.engine.eagle.EagleProposer):
forward(input_ids [T], positions [T], hidden [T, H], kv_cache, meta, backend) -> (x, x): row j
pairs the target's final hidden state at position j with the token at j + 1 and runs at
position j; x = eh_proj(cat(enorm(embed(token)), hnorm(hidden))) (the embedding zeroed at
position 0, as vLLM's), then the layer's own decoder block (latent attention and routed experts
as the target's layers have) with the residual; `compute_logits(x)` = shared_head.head(
shared_head.norm(x)). Its KV is one extra layer of the engine's own (`first_kv_layer`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from raycluster.model.checkpoint_files import CheckpointError, copy_into, read_prefixed
from raycluster.model.config import ModelConfig
from raycluster.model.llama import DecoderLayer, RMSNorm


class _SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPHead(DecoderLayer):
    """The layer: a decoder block (the inherited modules) plus its input projection and head."""

    def __init__(self, cfg: ModelConfig, target, first_kv_layer: int) -> None:
        index = cfg.num_hidden_layers       # the first MTP layer's place after the decoder's
        if cfg.moe is not None and cfg.moe.layers and index > max(cfg.moe.layers):     # routed, as the layers before it
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, layers=cfg.moe.layers + (index,)))
        super().__init__(cfg, index)
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = _SharedHead(cfg)
        self._target = (target,)            # its RoPE tables (a tuple: not a submodule)
        self.first_kv_layer = first_kv_layer
        self.aux_layers: tuple[int, ...] = ()
        self.num_kv_layers = 1

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        meta.prepare(kv_cache.device)
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))), dim=-1))
        cos, sin = self._target[0].rotary.cos_sin(positions, x.dtype)
        x = super().forward(x, cos, sin, kv_cache[self.first_kv_layer], meta, backend)
        return x, x


def load_mtp_head(path: str | os.PathLike, target, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", first_kv_layer: int = 0) -> MTPHead:
    """The first MTP layer of the checkpoint at `path` (the target's) as a draft head.
    ValueError naming `speculative_method` when the checkpoint has none."""
    cfg = target.config
    if not cfg.raw.get("num_nextn_predict_layers"):
        raise ValueError(f"speculative_method: 'mtp' drafts with the checkpoint's multi-token-prediction layers; "
                         f"{cfg.architecture} at {os.fspath(path)!r} has none (num_nextn_predict_layers)")
    index = cfg.num_hidden_layers
    tensors = read_prefixed(os.fspath(path), f"model.layers.{index}.")
    with torch.device("meta"):
        head = MTPHead(cfg, target, first_kv_layer)
    head.to_empty(device=device)
    head.to(dtype)
    params = dict(head.named_parameters())
    copy_into(params, tensors, f"the MTP layer (model.layers.{index})", dtype)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensors of the MTP layer: {', '.join(f'model.layers.{index}.{m}' for m in missing[:5])}")
    head.eval()
    head.requires_grad_(False)
    return head
