"""Sliding-window attention in the torch backend vs the dense reference formula with Hugging
Face's window mask (key > query - window): prefill chunks before, across and past the window,
query tiling, decode rows and draft rows, fused and portable paths, with LSEs; and what serves
a sliding-window model (the torch backend on every device; KV parallelism refuses one).
(Against transformers: test_model_hf.py and test_engine_hf.py; TP / SPP x TP: test_tp.py.)"""

import pytest
import torch

from kernels import get_attention_backend
from kernels import torch_backend as tb
from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention
from kernels.torch_backend import TorchAttentionBackend, Workspace, paged_decode_attention, paged_prefill_attention
from raycluster.engine.config import EngineConfig
from raycluster.model import load_model, write_tiny_model
from raycluster.parallel.factory import build_runner
from raycluster.parallel.kvp import KVPAttention
from tests.unit.test_kernels import ATOL, PagedSetup, _meta, step_inputs

torch.set_num_threads(2)


def _strided(cache):
    """The same values in non-contiguous storage: the backend's portable path."""
    big = torch.zeros(*cache.shape[:-1], 2 * cache.shape[-1], dtype=cache.dtype)
    big[..., :cache.shape[-1]] = cache
    return big[..., :cache.shape[-1]]


def _refs(q, s, rows, scale, window):
    """Reference per (request, query_len) in token order: out and base-2 lse."""
    outs, lses, off = [], [], 0
    for i, n in rows:
        o, lse = reference_attention(q[off:off + n], s.k[i], s.v[i], scale, window=window)
        outs.append(o)
        lses.append(lse)
        off += n
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("window", [16, 37])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_step_with_window_matches_reference(window, block_size):
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    # Prefills: a first chunk longer than the window; a chunk after a prefix that crosses the
    # window's start; a chunk still inside the window; a chunk far past it; a one-token chunk.
    # Decodes: shorter than, equal to, one past and far past the window.
    kv_lens = [40, 57, 13, 300, 90, 3, window, window + 1, 250]
    prefill = [(0, 40), (1, 7), (2, 3), (3, 100), (4, 1)]
    decode = [5, 6, 7, 8]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=window)
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(1))
    out = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale, window=window)
    ref, ref_lse = _refs(q, s, prefill + [(j, 1) for j in decode], scale, window)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # Not the full-attention answer: the window changes what the long requests see.
    full, _ = _refs(q, s, prefill + [(j, 1) for j in decode], scale, None)
    assert (out - full).abs().max() > 1e-2
    tp = meta.num_prefill_tokens
    for cache in (s.cache, _strided(s.cache)):     # fused path, portable path (chunk read from the cache)
        op, lp = paged_prefill_attention(q[:tp], cache, meta, scale, window=window, workspace=Workspace())
        od, ld = paged_decode_attention(q[tp:], cache, meta, scale, window=window, workspace=Workspace())
        torch.testing.assert_close(torch.cat([op, od]), ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.cat([lp, ld]), ref_lse, atol=ATOL, rtol=0)


def test_long_windowed_chunk_is_attended_in_query_tiles(monkeypatch):
    """A chunk longer than the query tile: every tile sees only its queries' windows."""
    monkeypatch.setattr(tb, "_Q_TILE", 64)
    hq, hkv, d, window = 4, 4, 16, 50
    s = PagedSetup([420], hkv, d, block_size=8, seed=3)
    s.write_history(0, 420 - 300)
    meta = _meta(s, [(0, 300)], [])
    q = torch.randn(300, hq, d, generator=torch.Generator().manual_seed(2))
    out, lse = paged_prefill_attention(q, s.cache, meta, 0.25, k=s.k[0][120:], v=s.v[0][120:], window=window)
    ref, ref_lse = reference_attention(q, s.k[0], s.v[0], 0.25, window=window)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 2, 3, 17])
def test_tiny_windows_match_reference(window):
    """Windows down to one key (each query sees only itself): chunks after a prefix and from
    position 0, tiles of window - 1 queries, decodes."""
    s = PagedSetup([40, 23, 30], 2, 16, block_size=4, seed=window)
    prefill, decode = [(0, 25), (1, 23)], [2]
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, 4, 16, generator=torch.Generator().manual_seed(3))
    out = TorchAttentionBackend().forward(s.cache, q, k, v, meta, 0.25, window=window)
    ref, _ = _refs(q, s, prefill + [(2, 1)], 0.25, window)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_windowed_decode_gathers_only_the_window():
    """A long request's decode row reads the blocks of its window, not its whole history."""
    hq, hkv, d, bs, window = 4, 2, 16, 8, 20
    kv_lens = [1000, 997, 30]
    s = PagedSetup(kv_lens, hkv, d, block_size=bs, seed=4)
    for i, L in enumerate(kv_lens):
        s.write_history(i, L)
    meta = AttentionMetadata(0, 3, [], [], [], kv_lens, s.tables, torch.zeros(3, dtype=torch.long), bs)
    widest = max(b.num_blocks for b in meta.decode_buckets(window=window))
    assert widest <= -(-window // bs) + 1
    assert max(b.num_blocks for b in meta.decode_buckets()) == 1000 // bs     # full attention: everything
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(6))
    out, lse = paged_decode_attention(q, s.cache, meta, 0.3, window=window)
    ref, ref_lse = _refs(q, s, [(0, 1), (1, 1), (2, 1)], 0.3, window)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [16, 3])
def test_windowed_draft_rows_match_reference(block_size):
    """A request's draft rows share one gather; each row's window starts at its own position."""
    hq, hkv, d, window = 8, 2, 32, 24
    kv_lens = [300, 40, 26]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=13)
    for i, L in enumerate(kv_lens):
        s.write_history(i, L)
    layout = [(0, 6), (1, 1), (2, 5)]     # request 2's rows straddle the window length
    lens, tables, refs_o, refs_l = [], [], [], []
    q = torch.randn(12, hq, d, generator=torch.Generator().manual_seed(5))
    for i, rows in layout:
        for j in range(rows):
            kv = kv_lens[i] - rows + 1 + j
            lens.append(kv)
            tables.append(s.tables[i])
            r = len(refs_o)
            o, lse = reference_attention(q[r:r + 1], s.k[i][:kv], s.v[i][:kv], 0.2, window=window)
            refs_o.append(o)
            refs_l.append(lse)
    meta = AttentionMetadata(0, len(lens), [], [], [], lens, tables, torch.zeros(len(lens), dtype=torch.long),
                             block_size)
    for cache in (s.cache, _strided(s.cache)):
        out, lse = paged_decode_attention(q, cache, meta, 0.2, window=window)
        torch.testing.assert_close(out, torch.cat(refs_o), atol=ATOL, rtol=0)
        torch.testing.assert_close(lse, torch.cat(refs_l), atol=ATOL, rtol=0)


def test_window_covering_every_request_is_full_attention():
    """A window at least as long as every request changes nothing (same buckets, same output)."""
    s = PagedSetup([30, 64], 2, 16, block_size=16, seed=8)
    meta = _meta(s, [(0, 30)], [1])
    s.write_history(1, 63)
    q = torch.randn(31, 4, 16, generator=torch.Generator().manual_seed(9))
    k = torch.cat([s.k[0], s.k[1][-1:]])
    v = torch.cat([s.v[0], s.v[1][-1:]])
    a = TorchAttentionBackend().forward(s.cache, q, k, v, meta, 0.25, window=64)
    b = TorchAttentionBackend().forward(s.cache, q, k, v, meta, 0.25)
    assert torch.equal(a, b)
    assert meta.decode_buckets(window=64) is meta.decode_buckets()


def test_sliding_window_models_get_the_torch_backend_and_kvp_refuses_them(tmp_path):
    assert isinstance(get_attention_backend("cuda", torch_only=True), TorchAttentionBackend)
    path = write_tiny_model(tmp_path, seed=1, architectures=["MistralForCausalLM"], sliding_window=32,
                            num_hidden_layers=2)
    model, cfg = load_model(path)
    assert [layer.self_attn.window for layer in model.model.layers] == [32, 32]
    with pytest.raises(ValueError, match="window: 32, chunk: None: KV-parallel attention takes no sliding window"):
        KVPAttention(None).forward(None, None, None, None, None, 1.0, window=32)
    with pytest.raises(ValueError, match="kvp: 2 KVP ranks for a sliding-window model"):
        build_runner(EngineConfig(kvp=2, kv_cache_tokens=1024, policy="fcfs", packer="token", predictor="none"),
                     model, torch.float32)
