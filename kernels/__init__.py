"""Attention kernels: paged KV writes, chunked prefill, batched decode and LSE merging.

`get_attention_backend(device)` picks flashinfer on CUDA when it imports, else the torch backend.
A model with sliding-window layers or soft-capped attention scores (Gemma 2) gets the torch
backend everywhere (`torch_only`): the flashinfer backend passes neither to its kernels.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(device: torch.device | str = "cpu", torch_only: bool = False):
    device = torch.device(device)
    if device.type == "cuda" and not torch_only:
        try:
            from kernels.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available
            if flashinfer_available():
                return FlashInferAttentionBackend(device)
        except ImportError:
            pass
    return TorchAttentionBackend()
