"""Machine peaks measured in the benchmark's own process, on its own torch threads.

`memory_bandwidth` streams large fp32 tensors (a read-only reduction and a copy) and returns
bytes moved per second; `matmul_peak` times torch.mm of square fp32 matrices and returns
FLOP/s (2 n^3 per product). Both report the best of several repetitions, the usual
convention for a peak on a noisy machine: the bound is what the machine *can* do.
"""

from __future__ import annotations

import time

import torch


def _best(fn, reps: int, min_time_s: float = 0.0) -> float:
    """Best wall time of `reps` calls of fn (after one untimed call), repeating until min_time_s."""
    fn()
    best = float("inf")
    t_start = time.perf_counter()
    n = 0
    while n < reps or time.perf_counter() - t_start < min_time_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


@torch.inference_mode()
def memory_bandwidth(nbytes: int, reps: int = 5) -> dict:
    """Bandwidth for a working set of `nbytes` (fp32). Large (>> LLC): DRAM; small: cache.

    read_GBps: x.sum() reads nbytes (torch's cascade sum can be compute bound, hence also:)
    gemv_GBps: a [n/1024, 1024] matrix times a vector reads nbytes -- the access pattern of a
    decode step's weights. copy_GBps: y.copy_(x) counts read + write (2 * nbytes; write-allocate
    traffic is not counted). peak_GBps = max of the three, used as the bound.
    """
    n = max(nbytes // 4 // 1024, 1) * 1024
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    a = x.view(-1, 1024)
    v = torch.ones(1024, dtype=torch.float32)
    out = torch.empty(a.shape[0], dtype=torch.float32)
    t_read = _best(lambda: x.sum(), reps)
    t_gemv = _best(lambda: torch.mv(a, v, out=out), reps)
    t_copy = _best(lambda: y.copy_(x), reps)
    read = n * 4 / t_read / 1e9
    gemv = n * 4 / t_gemv / 1e9
    copy = 2 * n * 4 / t_copy / 1e9
    return {"bytes": n * 4, "read_GBps": read, "gemv_GBps": gemv, "copy_GBps": copy,
            "peak_GBps": max(read, gemv, copy)}


@torch.inference_mode()
def matmul_peak(n: int = 2048, reps: int = 5) -> dict:
    """fp32 torch.mm of [n, n] x [n, n]; FLOP/s = 2 n^3 / best time."""
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    c = torch.empty(n, n, dtype=torch.float32)
    t = _best(lambda: torch.mm(a, b, out=c), reps)
    return {"n": n, "seconds": t, "peak_GFLOPs": 2 * n ** 3 / t / 1e9}
