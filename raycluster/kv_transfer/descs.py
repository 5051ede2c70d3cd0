"""Pure-numpy transfer descriptors for block-wise copies between two layer-major KV tensors.

Input: the two tensors' base address, block count and device id, the bytes of one block of one
layer, and the paired source/destination block ids. Output: Nx3 uint64 (addr, len, devid) arrays,
the form NIXL builds descriptor lists from fastest. Kept free of nixl so it is testable anywhere.
"""

from __future__ import annotations

import numpy as np


def block_runs(src_ids: list[int], dst_ids: list[int]) -> np.ndarray:
    """[(src_start, dst_start, length)] covering the pairs, merging runs consecutive on both sides."""
    s = np.asarray(src_ids, dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    if len(s) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return np.stack([s[starts], d[starts], lengths], axis=1)


def paired_descs(src: dict[str, int], dst: dict[str, int], num_layers: int, block_bytes: int,
                 src_ids: list[int], dst_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, devid) arrays for source and destination, pairwise equal lengths.

    `src`/`dst` are {"base", "num_blocks", "devid"} of a layer-major [L, N, ...] tensor, so block
    b of layer l starts at base + (l * N + b) * block_bytes."""
    runs = block_runs(src_ids, dst_ids)
    layers = np.arange(num_layers, dtype=np.uint64)[:, None]

    def side(base: int, n: int, dev: int, starts: np.ndarray) -> np.ndarray:
        addr = np.uint64(base) + (layers * np.uint64(n) + starts.astype(np.uint64)[None, :]) \
            * np.uint64(block_bytes)
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0] = addr.reshape(-1)
        out[:, 1] = np.tile(runs[:, 2].astype(np.uint64) * np.uint64(block_bytes), num_layers)
        out[:, 2] = dev
        return out

    return (side(src["base"], src["num_blocks"], src["devid"], runs[:, 0]),
            side(dst["base"], dst["num_blocks"], dst["devid"], runs[:, 1]))
