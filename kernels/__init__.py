"""Attention kernels: paged KV writes, chunked prefill, batched decode and LSE merging.

`get_attention_backend(device)` picks flashinfer on CUDA when it imports, else the torch backend.
A model with sliding-window layers gets the torch backend everywhere: the flashinfer backend
does not pass a window to its kernels.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend

__all__ = ["AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(device: torch.device | str = "cpu", sliding_window: bool = False):
    device = torch.device(device)
    if device.type == "cuda" and not sliding_window:
        try:
            from kernels.flashinfer_backend import FlashInferAttentionBackend, flashinfer_available
            if flashinfer_available():
                return FlashInferAttentionBackend(device)
        except ImportError:
            pass
    return TorchAttentionBackend()
