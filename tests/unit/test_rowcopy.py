"""kernels.rowcopy.index_copy against torch's own index_copy_: same bytes, same refusals, on
both of its paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.rowcopy as rowcopy
from kernels.rowcopy import index_copy


@pytest.fixture(autouse=True, params=["numpy", "torch"])
def path(request, monkeypatch):
    """Every test on both paths: numpy's (large copies) and torch's (small ones)."""
    monkeypatch.setattr(rowcopy, "NUMPY_MIN_BYTES", 0 if request.param == "numpy" else 1 << 60)
    return request.param


def _pair(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype)
    return t, t.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", ["tensor", "list", "numpy"])
def test_matches_torch_index_copy(dtype, dim, kind):
    shape = (5, 40, 2, 3) if dim == 1 else (40, 2, 3)
    ours, ref = _pair(shape, dtype, 0)
    rng = np.random.default_rng(1)
    ids = rng.choice(40, size=17, replace=False)
    src_shape = list(shape)
    src_shape[dim] = len(ids)
    src = torch.randn(src_shape).to(dtype)
    index = {"tensor": torch.as_tensor(ids), "list": ids.tolist(), "numpy": ids}[kind]
    index_copy(ours, dim, index, src)
    ref.index_copy_(dim, torch.as_tensor(ids), src)
    assert torch.equal(ours.view(torch.uint8) if dtype == torch.bfloat16 else ours,
                       ref.view(torch.uint8) if dtype == torch.bfloat16 else ref)


def test_strided_destination_and_source():
    base, ref_base = _pair((4, 30, 6), torch.float32, 2)
    dst, ref = base[:, :, 1:5], ref_base[:, :, 1:5]           # views with strides
    src = torch.randn(4, 3, 8)[:, :, ::2]                    # non-contiguous source
    index_copy(dst, 1, [7, 0, 29], src)
    ref.index_copy_(1, torch.tensor([7, 0, 29]), src)
    assert torch.equal(base, ref_base)


def test_writes_only_the_indexed_rows():
    dst = torch.zeros(10, 4)
    index_copy(dst, 0, [3, 8], torch.ones(2, 4))
    assert dst.sum(dim=1).tolist() == [0, 0, 0, 4, 0, 0, 0, 0, 4, 0]


def test_empty_index_is_a_no_op():
    dst = torch.zeros(3, 4)
    index_copy(dst, 0, [], torch.zeros(0, 4))
    assert dst.abs().sum() == 0


@pytest.mark.parametrize("index, src_rows, error", [
    ([-1], 1, IndexError),          # numpy would write the last row
    ([10], 1, IndexError),
    ([1, 2], 1, RuntimeError),      # numpy would broadcast one row onto two
])
def test_refuses_what_torch_refuses(index, src_rows, error, path):
    dst = torch.zeros(10, 4)
    with pytest.raises(error if path == "numpy" else (IndexError, RuntimeError)):
        index_copy(dst, 0, index, torch.ones(src_rows, 4))
    with pytest.raises((IndexError, RuntimeError)):
        dst.clone().index_copy_(0, torch.tensor(index), torch.ones(src_rows, 4))
    assert dst.abs().sum() == 0


def test_mixed_dtypes_take_torchs_path():
    ours, ref = _pair((6, 4), torch.bfloat16, 3)
    src = torch.randn(2, 4)                                   # float32 into bfloat16
    index_copy(ours, 0, [1, 4], src)
    ref.index_copy_(0, torch.tensor([1, 4]), src.to(torch.bfloat16))
    assert torch.equal(ours.float(), ref.float())


def test_dim_2_is_refused():
    with pytest.raises(ValueError, match="dim 0 or 1"):
        index_copy(torch.zeros(2, 2, 2), 2, [0], torch.zeros(2, 2, 1))


def test_large_copies_take_numpys_path(monkeypatch):
    """The threshold routes a KV-handoff-sized copy to numpy and a decode step's rows to torch."""
    monkeypatch.undo()
    calls = []
    real = rowcopy.numpy_bits
    monkeypatch.setattr(rowcopy, "numpy_bits", lambda t: calls.append(t.shape) or real(t))
    dst = torch.zeros(4, 256, 8, 64)
    index_copy(dst, 1, list(range(0, 256, 2)), torch.ones(4, 128, 8, 64))    # 1 MiB
    assert len(calls) == 2 and dst.sum() == 4 * 128 * 8 * 64
    index_copy(dst, 1, [1], torch.ones(4, 1, 8, 64))                          # 8 KiB
    assert len(calls) == 2 and dst.sum() == 4 * 129 * 8 * 64
