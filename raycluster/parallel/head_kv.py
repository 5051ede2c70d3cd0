"""An EAGLE head's KV on a group's leader (`TPRunner`, `KVPRunner`): the head runs there alone,
unsharded, over the whole hidden states the leader keeps (a TP or KVP leader computes every
row's), so its KV is one tensor of whole heads [layers, N, 2, B, Hkv, D] under the engine's
block ids (a KVP group's global ones), next to the ranks' sharded KV of the model's layers.

Whole blocks as connectors move them are the model's L layers then the head's: `split_load`
writes the head's part of incoming blocks and hands back the model's part for the ranks;
`save_into` fills the head's part of outgoing ones.
"""

from __future__ import annotations

import torch

from kernels.rowcopy import index_copy


class HeadKV:
    def __init__(self, layers: int, model_layers: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        """`block_shape`: (N, 2, B, Hkv, D) of the model's whole blocks; `model_layers`: L."""
        self.model_layers = model_layers
        self.tensor = torch.zeros((layers, *block_shape), dtype=dtype, device=device)

    @property
    def layers(self) -> int:
        return self.tensor.shape[0]

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)

    def split_load(self, block_ids: list[int], data: torch.Tensor) -> torch.Tensor:
        """Write the head's layers of whole blocks `data` [L + layers, n, ...]; returns the
        model's [L, n, ...]."""
        index_copy(self.tensor, 1, self._ids(block_ids), data[self.model_layers:].to(self.tensor.device))
        return data[:self.model_layers]

    def save_into(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Fill the head's layers of whole blocks `out` [L + layers, n, ...] (contiguous)."""
        torch.index_select(self.tensor, 1, self._ids(block_ids), out=out[self.model_layers:])
