"""What a tensor-parallel or pipeline rank reads of a checkpoint tensor: the whole tensor
(`WHOLE`), one equal chunk along a dim (`TensorPart`), a range of rows padded with zeros
(`RowsPart`: a vocab-parallel lane's), or a chunk of each half side by side (`HalvesPart`: gate /
up stored fused in halves). Each cuts an in-memory tensor (`take`, where one applies) and a
safetensors slice handle (`read`: only the part is read), and says the part's shape (`out_shape`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorPart:
    """Chunk `index` of `parts` equal chunks along `dim` of a tensor (what torch.chunk gives for a
    size `parts` divides); parts == 1 is the whole tensor. The one rule both an in-memory
    tensor (`take`) and a checkpoint slice (`read`) are cut by."""
    dim: int = 0
    index: int = 0
    parts: int = 1

    def bounds(self, size: int) -> tuple[int, int]:
        if size % self.parts or not 0 <= self.index < self.parts:
            raise ValueError(f"chunk {self.index} of {self.parts}: a size of {size} does not split evenly")
        n = size // self.parts
        return self.index * n, (self.index + 1) * n

    def take(self, t: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return t
        lo, hi = self.bounds(t.shape[self.dim])
        return t.narrow(self.dim, lo, hi - lo)

    def read(self, tensor_slice, shape: tuple[int, ...]) -> torch.Tensor:
        """This part of a safetensors `get_slice` handle of a tensor of `shape` (only it is read)."""
        index = [slice(None)] * len(shape)
        if self.parts > 1:
            index[self.dim] = slice(*self.bounds(shape[self.dim]))
        return tensor_slice[tuple(index)]

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this part of a tensor of `shape`."""
        out = list(shape)
        if self.parts > 1:
            lo, hi = self.bounds(shape[self.dim])
            out[self.dim] = hi - lo
        return tuple(out)


WHOLE = TensorPart()


@dataclass(frozen=True)
class HalvesPart:
    """Chunk `index` of `parts` equal chunks of each half of a tensor along `dim`, the two side by
    side: a tp rank's share of a gate / up projection stored fused in halves (Llama 4's stacked
    experts), its gate columns and its up columns."""
    dim: int
    index: int
    parts: int

    def _bounds(self, size: int) -> tuple[int, int, int]:
        half = size // 2
        return (half, *TensorPart(self.dim, self.index, self.parts).bounds(half))

    def take(self, t: torch.Tensor) -> torch.Tensor:
        half, lo, hi = self._bounds(t.shape[self.dim])
        return torch.cat([t.narrow(self.dim, lo, hi - lo), t.narrow(self.dim, half + lo, hi - lo)], self.dim)

    def read(self, tensor_slice, shape: tuple[int, ...]) -> torch.Tensor:
        half, lo, hi = self._bounds(shape[self.dim])
        pieces = []
        for a, b in ((lo, hi), (half + lo, half + hi)):
            index = [slice(None)] * len(shape)
            index[self.dim] = slice(a, b)
            pieces.append(tensor_slice[tuple(index)])
        return torch.cat(pieces, self.dim)

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        _, lo, hi = self._bounds(shape[self.dim])
        out = list(shape)
        out[self.dim] = 2 * (hi - lo)
        return tuple(out)


@dataclass(frozen=True)
class RowsPart:
    """Rows [lo, hi) of a tensor, padded with zero rows up to `rows` (a vocab-parallel lane's
    embedding or head rows: raycluster.parallel.vocab.vocab_rows); only [lo, hi) is read."""
    lo: int
    hi: int
    rows: int

    def read(self, tensor_slice, shape: tuple[int, ...]) -> torch.Tensor:
        if not 0 <= self.lo <= self.hi <= shape[0] or self.hi - self.lo > self.rows:
            raise ValueError(f"rows [{self.lo}, {self.hi}) padded to {self.rows} do not fit {shape[0]} rows")
        return tensor_slice[self.lo:self.hi]

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.rows,) + tuple(shape[1:])
