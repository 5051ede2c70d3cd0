"""Per-position factors on a layer's queries, after RoPE (`LlamaForCausalLM.layer_ropes` hands
them to each attention layer as [T, 1, 1] tensors for the step's positions).

- `query_temperature` (Llama 4, on its layers without RoPE): log1p(floor((position + 1) /
  floor_scale)) * attn_scale + 1, which sharpens attention as the context grows.
- `ministral3_query_scale` (Ministral 3, on every layer; transformers' get_llama_4_attn_scale):
  1 + beta * ln(1 + floor(position / original_context)), 1 within the pretraining context of its
  YaRN RoPE and growing slowly past it.
"""

from __future__ import annotations

import torch


def query_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """[T, 1, 1] fp32 factors for the queries at `positions`."""
    return (torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0).view(-1, 1, 1)


def ministral3_query_scale(positions: torch.Tensor, beta: float, original_context: int) -> torch.Tensor:
    """[T, 1, 1] fp32 factors for the queries at `positions`."""
    return (1.0 + beta * torch.log1p(torch.floor(positions.float() / original_context))).view(-1, 1, 1)
