"""Whether an engine's KV cache fits in the memory its device has free, checked before the KV
manager or the cache tensor is built (the model's weights are loaded by then, so what is free
is what the cache can have).

The default `kv_cache_tokens` (262144) is 512 MiB of KV on the tiny model but 32 GiB on
Llama-3-8B in bf16 (128 KiB per token): allocating it on a smaller host would get the process
killed for memory, silently, in the middle of a Serve replica's start. This turns that into an
error naming `kv_cache_tokens` with the most that fits. Memory enters as the config and the
model's shape; a ValueError leaves when the cache needs more than `FREE_FRACTION` of what is free
(the rest is left for activations, the sampler and the process itself).
"""

from __future__ import annotations

from typing import Callable

import torch

FREE_FRACTION = 0.9


def kv_bytes_per_token(mcfg, dtype: torch.dtype) -> int:
    """Every layer's K and V of one token, over all KV heads (an encoder keeps none)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return mcfg.num_kv_layers * 2 * mcfg.num_key_value_heads * mcfg.head_dim * itemsize


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of the device (CUDA: the driver's free memory; CPU: the kernel's
    MemAvailable), or None where it cannot be read."""
    if device.type == "cuda":       # pragma: no cover - no GPU here
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_kv_fits(tokens: int, mcfg, dtype: torch.dtype, device: torch.device,
                  free: Callable[[torch.device], int | None] = free_memory_bytes) -> None:
    per_token = kv_bytes_per_token(mcfg, dtype)
    need = tokens * per_token
    have = free(device)
    if have is None or need <= have * FREE_FRACTION:
        return
    fits = int(have * FREE_FRACTION // per_token)
    raise ValueError(f"kv_cache_tokens: {tokens} tokens of KV take {need / 2**30:.1f} GiB ({per_token} bytes per "
                     f"token), but {device} has {have / 2**30:.1f} GiB free; set kv_cache_tokens "
                     f"(--kv-cache-tokens) to at most {fits}")
