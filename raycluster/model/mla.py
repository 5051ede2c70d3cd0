"""DeepSeek-V2 / V3's multi-head latent attention (MLA), served in its absorbed form over the
paged KV cache as one latent "KV head".

Each token's keys and values are compressed into a latent c = norm(kv_a(x))[:kv_lora_rank] and
one shared rotary key k_pe (qk_rope_head_dim); per head, k_nope = W_uk c and v = W_uv c come from
kv_b_proj. Absorbing W_uk into the query (q_lat = q_nope W_uk, [kv_lora_rank] per head), the
scores are q_lat . c + q_pe . k_pe, i.e. attention of H query heads over a single KV head of
width kv_lora_rank + qk_rope_head_dim: the cache row of a token is [c, k_pe] (keys) and [c, 0]
(values; the zeros keep the backend's equal K/V widths), the output's first kv_lora_rank dims are
the attended latent, and W_uv turns it into each head's value. So every attention backend,
chunked prefill, decode, prefix caching and KV handoff serve MLA unchanged; the cache holds
2 (kv_lora_rank + qk_rope_head_dim) numbers per token and layer (MLA itself needs half that).

Data enters as the hidden states of a step (the config's `MLASpec`: raycluster.model.mla_config);
leaves as the attention block's output.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raycluster.model.mla_config import MLASpec, softmax_scale
from raycluster.model.quant.linear import dense_weight
from raycluster.model.rope import apply_rope


class MLAttention(nn.Module):
    """MLA with checkpoint names: q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg, norm: Callable[[int], nn.Module], window: int | None = None):
        super().__init__()
        m: MLASpec = cfg.mla
        self.spec, self.window = m, window
        self.num_heads = h = cfg.num_attention_heads
        hidden, qk = cfg.hidden_size, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = norm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_width, bias=cfg.qkv_bias)
        self.kv_a_layernorm = norm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, hidden, bias=cfg.o_bias)
        self.scale = softmax_scale(m, cfg.rope_scaling)
        self.interleaved = cfg.rope_interleaved

    def forward(self, x, cos, sin, layer_kv, meta, backend, lora=None, index: int = 0, q_scale=None):
        m, h, t = self.spec, self.num_heads, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, -1)
        if q_scale is not None:     # a query factor commutes with RoPE and the absorbed W_uk
            q = (q * q_scale).to(q.dtype)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = apply_rope(q_pe, k_pe.view(t, 1, -1), cos, sin, self.interleaved)
        w = dense_weight(self.kv_b_proj).view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :m.qk_nope_head_dim])
        keys = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)                     # [T, 1, L + R]
        values = torch.cat([latent, latent.new_zeros(t, m.qk_rope_head_dim)], dim=-1).unsqueeze(1)
        o = backend.forward(layer_kv, torch.cat([q_lat, q_pe], dim=-1), keys, values, meta, self.scale,
                            window=self.window)
        out = torch.einsum("thl,hvl->thv", o[..., :m.kv_lora_rank], w[:, m.qk_nope_head_dim:])
        return self.o_proj(out.reshape(t, h * m.v_head_dim))
