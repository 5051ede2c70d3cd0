"""The EAGLE-3 draft head (vLLM's speculative `method: eagle3`): drafts from a fusion of three of
the target's intermediate hidden states instead of its last one.

`combine(aux [T, 3 * H_target]) -> [T, H]` fuses the target's residual stream at the input of
three of its layers (`aux_layers`; vLLM's default 2, L // 2, L - 3, or the checkpoint's
`eagle_aux_hidden_state_layer_ids`) through `fc`. forward(input_ids, positions, hidden [T, H],
kv_cache, meta, backend) -> (normed [T, H], prenorm [T, H]); with h = hidden_norm(hidden):

    x = (h if norm_before_residual else hidden) + attn(cat(input_layernorm(embed(ids)), h))
    x = x + mlp(post_attention_layernorm(x))        # then any further (plain) decoder layers
    prenorm = x, normed = norm(x)

The first layer's q/k/v projections take 2H inputs. Logits come from the head's own `lm_head`
over its draft vocabulary, mapped to the target's by `d2t` (target id = draft id + d2t[draft
id]) with every other token at -inf. A drafting pass feeds `prenorm` back as the next hidden
(no `fc`). The embedding is the head's own when its checkpoint has one, else the target's; as
for EAGLE-1 (raycluster.model.eagle) the head's KV is an extra layer of the target's KV tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.llama import MLP, Attention, DecoderLayer, RMSNorm
from raycluster.model.rope import RotaryEmbedding


class Eagle3Layer(nn.Module):
    """The head's first decoder layer: attention over [normed embedding, normed hidden]."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * h, attn.num_heads * attn.head_dim, bias=cfg.qkv_bias)
        attn.k_proj = nn.Linear(2 * h, attn.num_kv_heads * attn.head_dim, bias=cfg.qkv_bias)
        attn.v_proj = nn.Linear(2 * h, attn.num_kv_heads * attn.head_dim, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's 2H input, the residual it adds to)."""
        h = self.hidden_norm(hidden)
        return torch.cat((self.input_layernorm(embeds), h), dim=-1), h if self.norm_before_residual else hidden

    def forward(self, embeds, hidden, cos, sin, layer_kv, meta, backend):
        x, residual = self.attention_input(embeds, hidden)
        x = residual + self.self_attn(x, cos, sin, layer_kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    def __init__(self, config: ModelConfig, target, first_kv_layer: int, aux_layers: tuple[int, ...],
                 draft_vocab_size: int, own_embedding: bool = False, target_hidden_size: int | None = None,
                 norm_before_residual: bool = False, use_aux: bool = True) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.aux_layers = aux_layers if use_aux else ()
        self.fc = nn.Linear(3 * (target_hidden_size or h), h, bias=False) if use_aux else None
        self.layers = nn.ModuleList([Eagle3Layer(config, norm_before_residual),
                                     *(DecoderLayer(config) for _ in range(config.num_hidden_layers - 1))])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long), persistent=True)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.rotary = RotaryEmbedding.from_config(config)
        self._target = (target,)        # not a submodule (see EagleHead)
        self.first_kv_layer = first_kv_layer

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._target[0].model.embed_tokens)(input_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [T, 3 H] -> the head's hidden input [T, H]."""
        return aux if self.fc is None else self.fc(aux.to(self.fc.weight.dtype))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        meta.prepare(kv_cache.device)
        embeds = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        x = self.layers[0](embeds, hidden.to(embeds.dtype), cos, sin, kv_cache[self.first_kv_layer], meta, backend)
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer(x, cos, sin, kv_cache[self.first_kv_layer + i], meta, backend)
        return self.norm(x), x

    @torch.inference_mode()
    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(normed)
        if draft.shape[-1] == self.config.vocab_size and not self.d2t.any():
            return draft
        out = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        out[:, torch.arange(draft.shape[-1], device=draft.device) + self.d2t] = draft
        return out


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)
