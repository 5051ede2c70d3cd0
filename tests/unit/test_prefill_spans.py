"""Bidirectional prefill spans (Gemma 3's images): a chunk's span queries see every key of their
span, against the plain attention formula, with and without a sliding window, capped scores,
earlier KV and a decode beside the chunk."""

import pytest
import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend, paged_prefill_attention

BS, NB, HKV, HQ, D, SCALE = 4, 16, 2, 4, 8, 0.3


def _formula(kv, table, q, prefix, length, window, spans, softcap=None):
    ids = torch.tensor(table)
    k = kv[:, 0][ids].flatten(0, 1)[:length].repeat_interleave(HQ // HKV, 1)
    v = kv[:, 1][ids].flatten(0, 1)[:length].repeat_interleave(HQ // HKV, 1)
    qp, kp = torch.arange(prefix, length), torch.arange(length)
    visible = kp[None] <= qp[:, None]
    if window is not None:
        visible &= kp[None] > qp[:, None] - window
    for a, b in spans:
        visible[a:b, prefix + a:prefix + b] = True
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [None, 6, 40])
@pytest.mark.parametrize("spans", [[], [(2, 7)], [(0, 3), (5, 12)], [(0, 14)]])
@pytest.mark.parametrize("prefix", [0, 9])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_spans_match_the_formula(window, spans, prefix, softcap):
    torch.manual_seed(0)
    kv = torch.randn(NB, 2, BS, HKV, D)
    n = 14
    length = prefix + n
    table = list(range(NB))[::-1][:-(-length // BS)]
    q = torch.randn(n, HQ, D)
    meta = AttentionMetadata(n, 0, [n], [length], [table], [], [], torch.zeros(n, dtype=torch.long), BS,
                             prefill_spans=[spans])
    out, _ = paged_prefill_attention(q, kv, meta, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(out, _formula(kv, table, q, prefix, length, window, spans, softcap),
                               atol=1e-5, rtol=1e-5)


def test_spans_apply_per_request_beside_a_decode():
    """Two chunks, only the second with a span, and a decode row: each row as the formula says."""
    torch.manual_seed(1)
    kv = torch.zeros(NB, 2, BS, HKV, D)
    lens, prefixes = [6, 10], [3, 5]
    tables = [[0, 1, 2], [3, 4, 5, 6]]
    n_tok = sum(lens) + 1
    q, k, v = torch.randn(n_tok, HQ, D), torch.randn(n_tok, HKV, D), torch.randn(n_tok, HKV, D)
    slots = []
    for (n, p, t) in zip(lens, prefixes, tables):
        pos = torch.arange(p, p + n)
        slots.append(torch.tensor(t)[pos // BS] * BS + pos % BS)
    decode_table = [7, 8]
    slots.append(torch.tensor([decode_table[1] * BS + 2]))
    for t, p in zip(tables + [decode_table], prefixes + [6]):     # earlier KV: random
        for pos in range(p):
            kv[t[pos // BS], :, pos % BS] = torch.randn(2, HKV, D)
    meta = AttentionMetadata(sum(lens), 1, lens, [p + n for p, n in zip(prefixes, lens)], tables, [7], [decode_table],
                             torch.cat(slots), BS, prefill_spans=[[], [(1, 8)]])
    out = TorchAttentionBackend().forward(kv, q, k, v, meta, SCALE)
    row = 0
    for n, p, t, spans in zip(lens, prefixes, tables, [[], [(1, 8)]]):
        want = _formula(kv, t, q[row:row + n], p, p + n, None, spans)
        torch.testing.assert_close(out[row:row + n], want, atol=1e-5, rtol=1e-5)
        row += n
    torch.testing.assert_close(out[row:], _formula(kv, decode_table, q[row:], 6, 7, None, []), atol=1e-5, rtol=1e-5)


def test_spans_outside_the_chunk_are_refused():
    with pytest.raises(ValueError, match="outside its chunk"):
        AttentionMetadata(4, 0, [4], [4], [[0]], [], [], torch.zeros(4, dtype=torch.long), BS, prefill_spans=[[(2, 5)]])
