"""From-scratch ModernBERT encoder (gte-modernbert, modernbert-embed, gte-reranker-modernbert) over a
flat batch of whole prompts, with Hugging Face's parameter names.

The same interface as raycluster.model.bert's encoder: forward(input_ids [T], lengths,
token_type_ids ignored) -> final hidden states [T, H]; `classify(rows)`. Pre-norm layers (the first
has no attention norm), RoPE with one base for global and one for local layers, GeGLU feed-forward,
and local layers attending only within `local_window` positions on either side (inclusive, as HF's
bidirectional sliding-window mask); a final norm. Prompts attend in length groups
(raycluster.model.bert.LengthGroups), a local layer's mask the group's padding mask and the band.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.bert import ACT_FNS, LengthGroups
from raycluster.model.config import ModelConfig


def _norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.encoder.layer_norm_eps, bias=cfg.encoder.norm_bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, local: bool):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.encoder.attention_bias
        self.Wqkv = nn.Linear(h, 3 * h, bias=bias)
        self.Wo = nn.Linear(h, h, bias=bias)
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.local = local

    def forward(self, x, cos, sin, batch: LengthGroups, bands: dict[int, torch.Tensor]):
        t = x.shape[0]
        qkv = self.Wqkv(x).view(t, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        # HF rotates in fp32 and casts back.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype).reshape(t, -1)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype).reshape(t, -1)
        v = v.reshape(t, -1)
        o = torch.empty_like(q)
        for i, g in enumerate(batch.groups):
            mask = g.mask
            if self.local:
                band = bands[i]
                mask = band if mask is None else mask & band
            out = g.unpad(F.scaled_dot_product_attention(*(g.pad(y, self.heads, self.head_dim) for y in (q, k, v)),
                                                         attn_mask=mask))
            if len(batch.groups) == 1:
                o = out
            else:
                o[g.rows] = out
        return self.Wo(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.encoder.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.encoder.mlp_bias)
        self.act = ACT_FNS[cfg.encoder.hidden_act]

    def forward(self, x):
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg)
        self.attn = Attention(cfg, index in cfg.encoder.sliding_layers)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, batch, bands):
        cos, sin = rope[self.attn.local]
        x = x + self.attn(self.attn_norm(x), cos, sin, batch, bands)
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """ModernBertPredictionHead: LayerNorm(act(dense(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.encoder.classifier_bias)
        self.act = ACT_FNS[cfg.encoder.classifier_activation]
        self.norm = _norm(cfg)

    def forward(self, x):
        return self.norm(self.act(self.dense(x)))


class ModernBertEncoderModel(nn.Module):
    """Parameter names are HF ModernBertModel's (`embeddings.*`, `layers.N.*`, `final_norm.*`) and
    its classifiers' (`head.*`, `classifier.*`); the loader strips the `model.` a *For* class stores
    the encoder under."""

    def __init__(self, config: ModelConfig, backend=None):
        super().__init__()
        self.config = config
        enc = config.encoder
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)
        self.head = Head(config) if enc.head else None
        self.classifier = nn.Linear(config.hidden_size, len(config.labels)) if enc.head else None
        self.projector = None           # sentence-transformers Dense modules, set by the loader
        self.backend = None             # attention is this module's own: no backend, no KV

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (0, num_blocks, 2, block_size, c.num_attention_heads, c.head_dim)

    def _rope(self, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.config.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]          # [T, 1, D]: broadcast over heads
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, lengths: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        enc, dev = self.config.encoder, input_ids.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        rope = {False: self._rope(positions, enc.rope_theta_global), True: self._rope(positions, enc.rope_theta_local)}
        batch = LengthGroups(lengths, dev)
        bands = {}
        if enc.sliding_layers:
            for i, g in enumerate(batch.groups):
                pos = torch.arange(g.lmax, device=dev)
                bands[i] = ((pos[:, None] - pos[None, :]).abs() <= enc.local_window)[None, None]
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer in self.layers:
            x = layer(x, rope, batch, bands)
        return self.final_norm(x)

    @torch.inference_mode()
    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [n, labels] from pooled rows [n, H] (or, for a token
        classifier, any token's rows)."""
        if self.classifier is None:
            raise RuntimeError("this encoder has no classification head")
        return self.classifier(self.head(rows))
