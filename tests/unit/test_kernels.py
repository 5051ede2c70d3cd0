"""Torch (and, on CUDA, flashinfer) paged attention vs the dense reference formula."""

import math

import pytest
import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention
from kernels.torch_backend import (TorchAttentionBackend, Workspace, merge_states, paged_decode_attention,
                                   paged_prefill_attention, write_kv)

torch.set_num_threads(2)
ATOL = 2e-5  # fp32 kernels vs fp64 reference


class PagedSetup:
    """Random per-request KV histories laid out in a shuffled paged cache."""

    def __init__(self, kv_lens, hkv, d, block_size=16, num_blocks=None, seed=0, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        need = sum(-(-L // block_size) for L in kv_lens)
        n = num_blocks or need + 3
        self.block_size = block_size
        self.cache = torch.zeros(n, 2, block_size, hkv, d, dtype=dtype)
        perm = torch.randperm(n, generator=g).tolist()
        self.tables, self.k, self.v = [], [], []
        for L in kv_lens:
            nb = -(-L // block_size)
            self.tables.append([perm.pop() for _ in range(nb)])
            self.k.append(torch.randn(L, hkv, d, generator=g, dtype=dtype))
            self.v.append(torch.randn(L, hkv, d, generator=g, dtype=dtype))

    def slots(self, i, start, end):
        t = self.tables[i]
        return [t[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def write_history(self, i, upto):
        s = torch.tensor(self.slots(i, 0, upto), dtype=torch.long)
        write_kv(self.cache, self.k[i][:upto], self.v[i][:upto], s)


def step_inputs(setup, prefill, decode):
    """A step of prefill chunks (req, query_len) and decodes (req) over `setup`'s histories: the KV
    before the step written, and (meta, the step's new k, its new v)."""
    for i, n in prefill:
        setup.write_history(i, setup.k[i].shape[0] - n)
    for i in decode:
        setup.write_history(i, setup.k[i].shape[0] - 1)
    k = torch.cat([setup.k[i][-n:] for i, n in prefill] + [setup.k[i][-1:] for i in decode])
    v = torch.cat([setup.v[i][-n:] for i, n in prefill] + [setup.v[i][-1:] for i in decode])
    return _meta(setup, prefill, decode), k, v


def _meta(setup, prefill, decode):
    """prefill: list of (req, query_len); decode: list of req. KV len = full history length."""
    slots = []
    for i, n in prefill:
        L = setup.k[i].shape[0]
        slots += setup.slots(i, L - n, L)
    for i in decode:
        L = setup.k[i].shape[0]
        slots += setup.slots(i, L - 1, L)
    return AttentionMetadata(
        num_prefill_tokens=sum(n for _, n in prefill), num_decode_tokens=len(decode),
        prefill_query_lens=[n for _, n in prefill],
        prefill_kv_lens=[setup.k[i].shape[0] for i, _ in prefill],
        prefill_block_tables=[setup.tables[i] for i, _ in prefill],
        decode_kv_lens=[setup.k[i].shape[0] for i in decode],
        decode_block_tables=[setup.tables[i] for i in decode],
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=setup.block_size)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_step_matches_reference(hq, hkv, block_size):
    d = 32
    scale = d ** -0.5
    # Requests 0-3 prefill (chunk 1, 7, 64 with earlier KV, 40 with none); 4-6 decode.
    kv_lens = [30, 7 + 50, 64 + 17, 40, 1, 33, 100]
    prefill = [(0, 1), (1, 7), (2, 64), (3, 40)]
    decode = [4, 5, 6]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=hq)
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(1))
    out = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale)

    refs, ref_lse = [], []
    for i, n in prefill + [(j, 1) for j in decode]:
        o, l = reference_attention(q[len(torch.cat(refs)) if refs else 0:][:n], s.k[i], s.v[i], scale)
        refs.append(o)
        ref_lse.append(l)
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # The lse-returning entry points (cache already written), reading the chunk from the cache too.
    tp = meta.num_prefill_tokens
    op, lp = paged_prefill_attention(q[:tp], s.cache, meta, scale)
    od, ld = paged_decode_attention(q[tp:], s.cache, meta, scale)
    torch.testing.assert_close(torch.cat([op, od]), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([lp, ld]), torch.cat(ref_lse), atol=ATOL, rtol=0)


def _every_path_matches_reference(s, q, k, v, meta, prefill, decode, scale, **opts):
    """The backend's output for the step, and the LSE-returning entry points' (the cache now
    written), against the reference per request under `opts` (window / softcap / chunk). Returns
    the reference output."""
    out = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale, **opts)
    refs, lses, row = [], [], 0
    for i, n in prefill + [(j, 1) for j in decode]:
        o, l = reference_attention(q[row:row + n], s.k[i], s.v[i], scale, **opts)
        refs.append(o)
        lses.append(l)
        row += n
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    tp = meta.num_prefill_tokens
    op, lp = paged_prefill_attention(q[:tp], s.cache, meta, scale, **opts)
    od, ld = paged_decode_attention(q[tp:], s.cache, meta, scale, **opts)
    torch.testing.assert_close(torch.cat([op, od]), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([lp, ld]), torch.cat(lses), atol=ATOL, rtol=0)
    return ref


@pytest.mark.parametrize("softcap", [0.7, 80.0])     # under and over the bounded-exp shortcut's limit
@pytest.mark.parametrize("window", [None, 20])
def test_soft_capped_scores_match_reference(softcap, window):
    """Gemma 2's capped scores through every path: prefill with and without earlier KV (and
    under a window, its banded part), decodes in length buckets, with and without the LSE."""
    hq, hkv, d = 8, 2, 32
    scale = 3.0 * d ** -0.5          # scores wide enough for the cap to bite
    kv_lens = [30, 7 + 50, 64 + 17, 40, 1, 33, 100]
    prefill, decode = [(0, 1), (1, 7), (2, 64), (3, 40)], [4, 5, 6]
    s = PagedSetup(kv_lens, hkv, d, block_size=16, seed=3)
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(2))
    ref = _every_path_matches_reference(s, q, k, v, meta, prefill, decode, scale, window=window, softcap=softcap)
    # The cap matters (at 80 it barely bends these scores): without it the output is off.
    plain = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale, window=window)
    assert (plain - ref).abs().max() > (0.05 if softcap < 1 else 1e-3)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("decode", [[], [4, 5, 6]])
def test_attention_sinks_match_reference(window, decode):
    """gpt-oss's per-head sink logits (each softmax's extra column, its value dropped) through a
    prefill-only step and a mixed one, windowed or not; sinks large and small against the scores."""
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    kv_lens = [30, 7 + 50, 64 + 17, 40, 1, 33, 100]
    prefill = [(0, 1), (1, 7), (2, 64), (3, 40)]
    s = PagedSetup(kv_lens, hkv, d, block_size=16, seed=5)
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(6))
    sinks = torch.tensor([-4.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0])
    out = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale, window=window, sinks=sinks)
    refs, row = [], 0
    for i, n in prefill + [(j, 1) for j in decode]:
        refs.append(reference_attention(q[row:row + n], s.k[i], s.v[i], scale, window=window, sinks=sinks)[0])
        row += n
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # A sink of 6 takes most of each softmax's mass; without sinks the output is far off.
    plain = TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale, window=window)
    assert (plain - ref).abs().max() > 0.1


@pytest.mark.parametrize("chunk", [20, 16, 7])
@pytest.mark.parametrize("block_size", [16, 5])
def test_chunked_attention_matches_reference(chunk, block_size):
    """Llama 4's chunked attention: prefill pieces inside one chunk, crossing chunk boundaries with
    and without earlier KV, a chunk starting exactly at the piece; decodes just past a boundary and
    deep inside a chunk; with and without the LSE."""
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    kv_lens = [30, 7 + 50, 64 + 17, 40, 1, 33, 100, 21, 41]
    prefill = [(0, 1), (1, 7), (2, 64), (3, 40)]
    decode = [4, 5, 6, 7, 8]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=9)
    meta, k, v = step_inputs(s, prefill, decode)
    q = torch.randn(meta.num_tokens, hq, d, generator=torch.Generator().manual_seed(10))
    ref = _every_path_matches_reference(s, q, k, v, meta, prefill, decode, scale, chunk=chunk)
    # The chunks matter: causal attention over every key differs.
    assert (TorchAttentionBackend().forward(s.cache, q, k, v, meta, scale) - ref).abs().max() > 0.05


def test_write_kv_slots():
    cache = torch.zeros(4, 2, 3, 2, 5)
    k = torch.randn(4, 2, 5)
    v = torch.randn(4, 2, 5)
    slots = torch.tensor([0, 5, 7, 11])
    write_kv(cache, k, v, slots)
    for j, sl in enumerate(slots.tolist()):
        assert torch.equal(cache[sl // 3, 0, sl % 3], k[j])
        assert torch.equal(cache[sl // 3, 1, sl % 3], v[j])
    # Exactly the 4 addressed slots (in both K and V) were touched.
    assert cache.abs().sum(dim=(3, 4)).ne(0).sum() == 8


def test_merge_states_equals_attention_over_concatenated_kv():
    g = torch.Generator().manual_seed(3)
    n, h, d, scale = 5, 4, 16, 0.25
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(30, h, d, generator=g)
    v = torch.randn(30, h, d, generator=g)
    full, full_lse = reference_attention(q, k, v, scale, causal=False)
    parts = [(0, 7), (7, 20), (20, 30)]
    vs, ss = zip(*[reference_attention(q, k[a:b], v[a:b], scale, causal=False) for a, b in parts])
    # An empty state (lse -inf, garbage v) must not contribute.
    vs = list(vs) + [torch.full((n, h, d), 123.0)]
    ss = list(ss) + [torch.full((n, h), float("-inf"))]
    mv, ms = merge_states(torch.stack(vs, 1), torch.stack(ss, 1))
    torch.testing.assert_close(mv, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(ms, full_lse, atol=1e-5, rtol=0)
    # Natural-log LSEs merged in base 2 would be wrong: check we are really in the exp2 domain.
    bad, _ = merge_states(torch.stack(vs[:3], 1), torch.stack(ss[:3], 1) * math.log(2.0))
    assert (bad - full).abs().max() > 1e-3


def test_merge_states_all_empty_gives_zeros():
    v = torch.randn(3, 2, 4, 8)
    s = torch.full((3, 2, 4), float("-inf"))
    mv, ms = merge_states(v, s)
    assert torch.equal(mv, torch.zeros(3, 4, 8))
    assert torch.isneginf(ms).all()


def test_long_prefill_two_chunks_tiled_path_matches():
    """Non-CPU path (query tiling) agrees with the fused CPU kernel."""
    from kernels import torch_backend as tb
    g = torch.Generator().manual_seed(5)
    q = torch.randn(300, 8, 32, generator=g)
    k = torch.randn(300, 2, 32, generator=g)
    v = torch.randn(300, 2, 32, generator=g)
    o1, l1 = tb._attend(q, k, v, True, 0.2)
    old = tb._Q_TILE
    tb._Q_TILE = 128
    try:
        o2, l2 = tb._attend_tiled(q, k, v, True, 0.2)
    finally:
        tb._Q_TILE = old
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=0)
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flashinfer needs CUDA")
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_flashinfer_matches_reference(hq, hkv):
    from kernels.flashinfer_backend import FlashInferAttentionBackend
    d, bs = 64, 16
    scale = d ** -0.5
    kv_lens = [30, 57, 81, 40, 1, 33, 100]
    prefill = [(0, 1), (1, 7), (2, 64), (3, 40)]
    decode = [4, 5, 6]
    s = PagedSetup(kv_lens, hkv, d, block_size=bs, dtype=torch.float16)
    meta, k, v = step_inputs(s, prefill, decode)
    dev = torch.device("cuda")
    meta.slot_mapping = meta.slot_mapping.to(dev)
    q = torch.randn(meta.num_tokens, hq, d, dtype=torch.float16)
    out = FlashInferAttentionBackend(dev).forward(s.cache.to(dev), q.to(dev), k.to(dev), v.to(dev), meta, scale)
    refs, off = [], 0
    for i, n in prefill + [(j, 1) for j in decode]:
        refs.append(reference_attention(q[off:off + n], s.k[i], s.v[i], scale)[0])
        off += n
    torch.testing.assert_close(out.cpu().float(), torch.cat(refs).float(), atol=2e-3, rtol=0)


def _decode_only(setup, kv_lens, hq, seed=7):
    for i, L in enumerate(kv_lens):
        setup.write_history(i, L)
    meta = _meta(setup, [], list(range(len(kv_lens))))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(kv_lens), hq, setup.k[0].shape[-1], generator=g)
    return meta, q


@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_buckets_mixed_lengths_match_reference(block_size):
    """Many decode requests of very different KV lengths (several length buckets), GQA, with lse."""
    from kernels.metadata import bucket_by_length
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    g = torch.Generator().manual_seed(11)
    kv_lens = torch.randint(1, 400, (40,), generator=g).tolist() + [1, block_size, block_size + 1, 399]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=2)
    meta, q = _decode_only(s, kv_lens, hq)
    out, lse = paged_decode_attention(q, s.cache, meta, scale)
    buckets = meta.decode_buckets()
    assert len(buckets) > 1
    # Every request lands in exactly one bucket.
    seen = sorted(i for b in buckets for i in (b.index.tolist() if b.index is not None else range(len(kv_lens))))
    assert seen == list(range(len(kv_lens)))
    for i, L in enumerate(kv_lens):
        ro, rl = reference_attention(q[i:i + 1], s.k[i], s.v[i], scale)
        torch.testing.assert_close(out[i:i + 1], ro, atol=ATOL, rtol=0)
        torch.testing.assert_close(lse[i:i + 1], rl, atol=ATOL, rtol=0)
    # The no-lse path (one softmax) gives the same output.
    out2, none = paged_decode_attention(q, s.cache, meta, scale, return_lse=False)
    assert none is None
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=0)
    # Bucketing bounds padding: padded KV / real KV stays small on a mixed batch.
    nbs = [-(-L // 16) for L in range(50, 1201, 18)]
    parts = bucket_by_length(nbs, 16, 1024)
    assert sorted(i for p in parts for i in p) == list(range(len(nbs)))
    padded = sum(len(p) * max(nbs[i] for i in p) * 16 for p in parts)
    assert padded / sum(n * 16 for n in nbs) < 1.3


def test_decode_portable_path_matches_reference():
    """Non-contiguous cache / dtype mismatch use the portable (non-fused) path: same results."""
    hq, hkv, d = 8, 2, 16
    scale = 0.3
    kv_lens = [3, 40, 17, 90]
    s = PagedSetup(kv_lens, hkv, d, block_size=8, seed=4)
    meta, q = _decode_only(s, kv_lens, hq)
    # Same values, non-contiguous storage.
    big = torch.zeros(*s.cache.shape[:-1], 2 * d)
    big[..., :d] = s.cache
    strided = big[..., :d]
    assert not strided.is_contiguous()
    for cache, qq in ((strided, q), (s.cache.double(), q)):
        out, lse = paged_decode_attention(qq, cache, meta, scale)
        for i in range(len(kv_lens)):
            ro, rl = reference_attention(q[i:i + 1], s.k[i], s.v[i], scale)
            torch.testing.assert_close(out[i:i + 1].float(), ro, atol=ATOL, rtol=0)
            torch.testing.assert_close(lse[i:i + 1], rl, atol=ATOL, rtol=0)


def _draft_rows_meta(s, layout):
    """Decode rows as a step with drafts lays them out: layout is a list of (request, rows); a
    request's rows are its positions L-rows .. L-1, all on its one table (the same list object,
    as the engine's plan passes it), or on copies cut to each row's length (`cut`, as a KVP
    rank's share is)."""
    lens, tables = [], []
    for i, rows, cut in layout:
        L = s.k[i].shape[0]
        for j in range(rows):
            kv = L - rows + 1 + j
            lens.append(kv)
            tables.append(s.tables[i][:-(-kv // s.block_size)] if cut else s.tables[i])
    return AttentionMetadata(0, len(lens), [], [], [], lens, tables,
                             torch.zeros(len(lens), dtype=torch.long), s.block_size)


@pytest.mark.parametrize("block_size", [16, 3])
def test_draft_rows_share_one_gather_and_match_reference(block_size):
    """A request's draft rows (consecutive positions on one table) attend as one group of
    queries over one gather of its blocks, each row masked at its own length: every row equals
    the reference over exactly its prefix, with plain decodes in the same step, on the fused
    and the portable path, with and without lse."""
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    kv_lens = [300, 40, 7, 301, 95, 6]
    s = PagedSetup(kv_lens, hkv, d, block_size=block_size, seed=13)
    for i, L in enumerate(kv_lens):
        s.write_history(i, L)
    # request 0: 6 rows, 1 plain, 2: 4 rows (shorter than the bucket's m), 3 plain, 4: 6 rows on
    # tables cut to each row's length, 5: 6 rows from position 0 (its first row sees 1 token).
    layout = [(0, 6, False), (1, 1, False), (2, 4, False), (3, 1, False), (4, 6, True), (5, 6, False)]
    meta = _draft_rows_meta(s, layout)
    q = torch.randn(meta.num_decode_tokens, hq, d, generator=torch.Generator().manual_seed(5))
    refs_o, refs_l = [], []
    for i, rows, _ in layout:
        L = kv_lens[i]
        for j in range(rows):
            kv = L - rows + 1 + j
            r = len(refs_o)
            o, l_ = reference_attention(q[r:r + 1], s.k[i][:kv], s.v[i][:kv], scale)
            refs_o.append(o)
            refs_l.append(l_)
    ref_o, ref_l = torch.cat(refs_o), torch.cat(refs_l)
    buckets = meta.decode_buckets()
    # One gather per request: 4 drafted groups (m = 6) and two plain rows, in buckets of their own.
    groups = sorted((b.num_queries, b.rows.numel() // (2 * b.num_blocks)) for b in buckets)
    assert sum(n for m, n in groups if m == 6) == 4 and sum(n for m, n in groups if m == 1) == 2
    big = torch.zeros(*s.cache.shape[:-1], 2 * d)
    big[..., :d] = s.cache
    for cache in (s.cache, big[..., :d]):      # fused path, portable (non-contiguous) path
        out, lse = paged_decode_attention(q, cache, meta, scale, workspace=Workspace())
        torch.testing.assert_close(out, ref_o, atol=ATOL, rtol=0)
        torch.testing.assert_close(lse, ref_l, atol=ATOL, rtol=0)
        out2, _ = paged_decode_attention(q, cache, meta, scale, return_lse=False)
        torch.testing.assert_close(out2, ref_o, atol=ATOL, rtol=0)


def test_rows_of_different_tables_never_group():
    """Consecutive rows whose tables differ (different requests, or one sharing only a prefix
    block with the next) each keep their own gather."""
    s = PagedSetup([40, 41, 42], 2, 16, block_size=16, seed=3)
    shared = [s.tables[0][0], *s.tables[1][1:]]        # request 1 shares request 0's first block
    meta = AttentionMetadata(0, 3, [], [], [], [40, 41, 42], [s.tables[0], shared, s.tables[2]],
                             torch.zeros(3, dtype=torch.long), 16)
    assert meta._kv_groups() == [([0], 3), ([1], 3), ([2], 3)]
    same = AttentionMetadata(0, 3, [], [], [], [31, 32, 33], [s.tables[0][:2], s.tables[0][:2], s.tables[0]],
                             torch.zeros(3, dtype=torch.long), 16)
    assert same._kv_groups() == [([0, 1, 2], 3)]


def test_outputs_do_not_alias_workspace():
    """Results stay valid after later calls reuse the gather workspace."""
    hq, hkv, d = 4, 2, 16
    scale = 0.25
    s1 = PagedSetup([50, 7, 33], hkv, d, seed=5)
    m1, q1 = _decode_only(s1, [50, 7, 33], hq, seed=1)
    s2 = PagedSetup([200, 120], hkv, d, seed=6)
    m2, q2 = _decode_only(s2, [200, 120], hq, seed=2)
    ws = Workspace()
    o1, l1 = paged_decode_attention(q1, s1.cache, m1, scale, workspace=ws)
    keep = o1.clone(), l1.clone()
    paged_decode_attention(q2, s2.cache, m2, scale, workspace=ws)
    torch.testing.assert_close(o1, keep[0], atol=0, rtol=0)
    torch.testing.assert_close(l1, keep[1], atol=0, rtol=0)


def test_long_prefix_chunk_matches_reference():
    """A chunk after a long prefix (prefix gathered from the cache, merged with the chunk)."""
    hq, hkv, d = 8, 2, 32
    scale = d ** -0.5
    L, n = 700, 96
    s = PagedSetup([L], hkv, d, block_size=16, seed=9)
    s.write_history(0, L)
    meta = _meta(s, [(0, n)], [])
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(3))
    ro, rl = reference_attention(q, s.k[0], s.v[0], scale)
    o, lse = paged_prefill_attention(q, s.cache, meta, scale, k=s.k[0][L - n:], v=s.v[0][L - n:])
    torch.testing.assert_close(o, ro, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, rl, atol=ATOL, rtol=0)
    o2, lse2 = paged_prefill_attention(q, s.cache, meta, scale)
    torch.testing.assert_close(o2, ro, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse2, rl, atol=ATOL, rtol=0)


def _plain_bucket_cost(lens: list[int], overhead: int) -> int:
    """The O(n^2) DP's optimum (the reference for `bucket_by_length`'s hull walk)."""
    lens = sorted(lens)
    best = [0] + [None] * len(lens)
    for j in range(1, len(lens) + 1):
        best[j] = min(best[i] + overhead + (j - i) * lens[j - 1] for i in range(j))
    return best[-1]


def test_bucketing_finds_the_plain_dps_optimum():
    """On random lengths, many equal ones, one request and none: the hull walk's partition
    costs exactly what the O(n^2) DP's optimum does, and covers every request once."""
    from kernels.metadata import bucket_by_length
    rng = torch.Generator().manual_seed(5)
    cases = [torch.randint(1, 130, (n,), generator=rng).tolist() for n in (1, 2, 7, 40, 256)]
    cases += [[8] * 30, [1, 100] * 20, [], [3, 3, 4, 4, 200, 201]]
    for nbs in cases:
        for overhead in (0, 16, 1024, 10 ** 6):
            parts = bucket_by_length(nbs, 16, overhead)
            assert sorted(i for p in parts for i in p) == list(range(len(nbs)))
            cost = sum(overhead + len(p) * max(nbs[i] for i in p) * 16 for p in parts)
            assert cost == _plain_bucket_cost([b * 16 for b in nbs], overhead), (nbs, overhead)
