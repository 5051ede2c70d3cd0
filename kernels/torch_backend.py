"""Paged attention in plain torch (CPU and any device): KV writes, chunked prefill against a
paged cache, batched decode, and flashinfer-compatible LSE merging.

LSEs returned by this module are base 2 (flashinfer's convention), so states from either
backend can be merged with `merge_states`.

Prefill avoids materialising [H, T, T] scores: on CPU it uses torch's fused flash attention
(`_scaled_dot_product_flash_attention_for_cpu`, which returns the natural-log LSE and supports
GQA without expanding K/V); elsewhere it tiles queries. A chunk with earlier KV is computed as
two states -- "all earlier KV, no mask" and "causal within the chunk" -- merged by LSE; this is
exactly the bottom-right aligned causal mask. A sliding-window layer (Mistral, Qwen2's upper
layers) passes `window`: a query at position p sees keys p - window < key <= p (Hugging Face's
mask); a chunk whose request is longer than the window reads only the window's blocks and
attends in query tiles, each to itself causally and to the keys before it under the window's
band; decode gathers from the window's first block. A chunked-attention layer (Llama 4's RoPE
layers) passes `chunk`: a query sees only the keys of its own `chunk`-token chunk (HF's chunked
causal mask); a request's queries split at chunk boundaries, each piece attending itself causally
and its chunk's earlier keys, and decode gathers from the block where the row's chunk begins.
A chunk with `prefill_spans` (Gemma 3's images) attends itself under a mask: causal, and each
span's queries see all of the span's keys.

CPU fast paths (same results): a chunk with earlier KV keeps the two fused passes (one pass over
prefix + chunk with an additive bottom-right causal mask measured no faster: it loses the causal
block skipping) but gathers the prefix into a reused buffer and merges with a few elementwise ops;
decode requests are grouped by KV length into a few buckets (padding stays small) and each bucket is one
fused attention call with an additive pad mask. K/V are gathered with one `index_select` into a
reused workspace buffer: fresh multi-MB allocations per layer cost more in page faults than the copy.
"""

from __future__ import annotations

import math

import torch

from kernels.metadata import AttentionMetadata
from kernels.rowcopy import index_copy

LOG2E = 1.0 / math.log(2.0)
_Q_TILE = 1024
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
class Workspace:
    """Flat scratch buffers reused across layers and steps (grown on demand, never shrunk), owned
    by one backend: fresh multi-MB buffers per layer cost more in page faults than the copies."""

    def __init__(self) -> None:
        self._bufs: dict = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, int(1.25 * (buf.numel() if buf is not None else 0))), dtype=dtype,
                              device=device)
            self._bufs[key] = buf
        return buf[:numel]


def _gather_rows(kv_layer: torch.Tensor, rows: torch.Tensor, name: str, ws: Workspace | None) -> torch.Tensor:
    """kv_layer [N,2,B,Hkv,D] viewed as [N*2, B*Hkv*D]; returns the given rows, copied into the
    workspace buffer `name` (valid until its next use) or, without a workspace, a new tensor."""
    src = kv_layer.view(-1, kv_layer[0, 0].numel())
    if ws is None:
        return src.index_select(0, rows)
    out = ws.get(name, rows.numel() * src.shape[1], src.dtype, src.device).view(rows.numel(), src.shape[1])
    torch.index_select(src, 0, rows, out=out)
    return out


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             slot_block: torch.Tensor | None = None, slot_offset: torch.Tensor | None = None,
             slot_row: torch.Tensor | None = None) -> None:
    """Store k, v [T, Hkv, D] into kv_layer [N, 2, B, Hkv, D] at the given flat slots
    (slot_row: precomputed rows block * 2B + offset of kv_layer viewed as [N*2*B, Hkv*D])."""
    if k.shape[0] == 0:
        return
    if slot_row is not None and kv_layer.is_contiguous():
        bs = kv_layer.shape[2]
        flat = kv_layer.view(-1, kv_layer.shape[3] * kv_layer.shape[4])
        index_copy(flat, 0, slot_row, k.reshape(k.shape[0], -1).to(kv_layer.dtype))
        index_copy(flat, 0, slot_row + bs, v.reshape(v.shape[0], -1).to(kv_layer.dtype))
        return
    if slot_block is None or slot_offset is None:
        bs = kv_layer.shape[2]
        slots = slot_mapping.to(device=kv_layer.device, dtype=torch.long)
        slot_block = torch.div(slots, bs, rounding_mode="floor")
        slot_offset = slots % bs
    kv_layer[slot_block, 0, slot_offset] = k.to(kv_layer.dtype)
    kv_layer[slot_block, 1, slot_offset] = v.to(kv_layer.dtype)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attention states: v [T, S, H, D], s [T, S, H] (base-2 LSE).

    Same maths as flashinfer.merge_states; all-empty states (s = -inf) give zeros and -inf.
    """
    s32 = s.float()
    s_max = s32.amax(dim=1, keepdim=True)
    s_max = torch.where(torch.isneginf(s_max), torch.zeros_like(s_max), s_max)
    w = torch.exp2(s32 - s_max)  # [T, S, H]; -inf -> 0
    denom = w.sum(dim=1)  # [T, H]
    out = torch.einsum("tsh,tshd->thd", w, v.float())
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.where((denom > 0)[..., None], out / safe[..., None], torch.zeros_like(out))
    lse = torch.log2(denom) + s_max.squeeze(1)
    return out.to(v.dtype), lse


def _scale_(scores: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """Fresh raw scores times `scale`, then Gemma 2's cap softcap * tanh(x / softcap), in place
    (these [H, n, L] passes are most of a capped layer's attention time)."""
    if softcap is None:
        return scores.mul_(scale)
    return scores.mul_(scale / softcap).tanh_().mul_(softcap)


_BOUNDED_CAP = 60.0     # exp(60) * 2**40 keys stays far below fp32's max (3.4e38)


def _softmax_lse_(scores: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax over the last dim, natural-log LSE), the scores' buffer reused for the former.
    Capped scores lie within +-softcap, so with a small cap exp cannot overflow and the max
    subtraction (two of logsumexp's passes) is skipped; a row fully masked still gives -inf LSE."""
    if softcap is not None and softcap <= _BOUNDED_CAP:
        total = scores.exp_().sum(-1)
        return scores.div_(total.unsqueeze(-1)), total.log()
    lse = torch.logsumexp(scores, dim=-1)
    return scores.sub_(lse.unsqueeze(-1)).exp_(), lse


def _attend_tiled(q, k, v, causal: bool, scale: float, softcap: float | None = None):
    """Reference-quality attention with query tiling; q [n,Hq,D], k/v [L,Hkv,D]; top-left causal
    (only used with n == L for causal). Returns out [n,Hq,D], natural lse [n,Hq]."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    vf = v.float().permute(1, 0, 2)  # [Hkv, L, D]
    outs, lses = [], []
    for start in range(0, n, _Q_TILE):
        qt = q[start:start + _Q_TILE].float()
        m = qt.shape[0]
        lt = start + m if causal else L     # a causal tile sees no key after its last query
        qg = qt.view(m, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m * g, d)
        sc = _scale_(torch.bmm(qg, kf[:, :, :lt]).view(hkv, m, g, lt), scale, softcap)
        if causal:
            rows = torch.arange(start, start + m, device=q.device)
            mask = torch.arange(lt, device=q.device)[None, :] > rows[:, None]
            sc.masked_fill_(mask[None, :, None, :], float("-inf"))
        p, lse = _softmax_lse_(sc, softcap)  # lse [Hkv, m, g]
        o = torch.bmm(p.view(hkv, m * g, lt), vf[:, :lt]).view(hkv, m, g, d)
        outs.append(o.permute(1, 0, 2, 3).reshape(m, hq, d))
        lses.append(lse.permute(1, 0, 2).reshape(m, hq))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def _attend(q, k, v, causal: bool, scale: float, softcap: float | None = None):
    """Dense attention of q [n,Hq,D] over k/v [L,Hkv,D] (causal: top-left, used with n == L).
    Returns (out [n,Hq,D], natural-log lse [n,Hq] fp32). The fused kernel caps no scores:
    `softcap` takes the tiled path."""
    if q.device.type == "cpu" and q.dtype == k.dtype and softcap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), 0.0, causal, scale=scale)
        return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1).float()
    return _attend_tiled(q, k, v, causal, scale, softcap)


def _attend_masked(q, k, v, visible: torch.Tensor, scale: float, softcap: float | None = None):
    """Attention of q [n,Hq,D] over k/v [L,Hkv,D] where visible [n,L] (bool) says which keys each
    query sees (every row sees at least one). Returns (out [n,Hq,D], natural-log lse [n,Hq] fp32)."""
    if q.device.type == "cpu" and q.dtype == k.dtype and softcap is None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        out, lse = _FLASH_CPU(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                              v.transpose(0, 1).unsqueeze(0), 0.0, False, attn_mask=mask[None, None], scale=scale)
        return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1).float()
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.float().view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
    sc = _scale_(torch.bmm(qg, k.float().permute(1, 2, 0)).view(hkv, n, g, -1), scale, softcap)
    sc.masked_fill_(~visible[None, :, None, :], float("-inf"))
    p, lse = _softmax_lse_(sc, softcap)  # lse [Hkv, n, g]
    o = torch.bmm(p.view(hkv, n * g, -1), v.float().permute(1, 0, 2)).view(hkv, n, g, d)
    return o.permute(1, 0, 2, 3).reshape(n, hq, d).to(q.dtype), lse.permute(1, 0, 2).reshape(n, hq)


def _keys_from(kv_layer, table, prefix: int, ki, vi, lo: int):
    """A request's K, V from position `lo` on: the cached ones before its chunk (positions
    lo .. prefix - 1, only their blocks read), then the chunk's own ki / vi."""
    if lo >= prefix:
        return ki, vi
    bs = kv_layer.shape[2]
    first = lo // bs
    kp, vp = _gather(kv_layer, table[first:-(-prefix // bs)], prefix - first * bs)
    off = lo - first * bs
    return torch.cat([kp[off:], ki]), torch.cat([vp[off:], vi])


def _windowed_prefill(qi, kv_layer, table, prefix: int, ki, vi, window: int, scale: float,
                      softcap: float | None = None):
    """One request's chunk (queries at positions prefix .. prefix + n - 1, its own K/V ki/vi)
    under a sliding window: query p sees keys p - window < key <= p. Only the blocks holding the
    window's earlier keys are read. Queries go in tiles of at most window - 1: each tile attends
    itself causally (every key of the tile is inside every later query's window, so the fused
    kernel's causal block skipping applies) and the keys before it under the banded mask (each
    query then sees at least the key just before the tile), the two states merged by LSE."""
    n = qi.shape[0]
    lo = max(0, prefix - window + 1)            # the earliest key any query of the chunk sees
    k_all, v_all = _keys_from(kv_layer, table, prefix, ki, vi, lo)
    outs, lses = [], []
    tile = min(_Q_TILE, max(1, window - 1))
    for a in range(0, n, tile):
        b = min(n, a + tile)
        qt = qi[a:b].to(k_all.dtype)
        start = prefix + a - lo                 # the tile's own first key, in k_all
        o, lse = _attend(qt, k_all[start:start + b - a], v_all[start:start + b - a], True, scale, softcap)
        before = max(lo, prefix + a - window + 1) - lo
        if window > 1 and before < start:
            q_pos = torch.arange(prefix + a, prefix + b, device=qi.device)
            key_pos = torch.arange(lo + before, lo + start, device=qi.device)
            visible = key_pos[None, :] > q_pos[:, None] - window
            op, lsep = _attend_masked(qt, k_all[before:start], v_all[before:start], visible, scale, softcap)
            o, lse = _merge2(op, lsep, o, lse)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _chunked_prefill(qi, kv_layer, table, prefix: int, ki, vi, chunk: int, scale: float,
                     softcap: float | None = None):
    """One request's chunk (queries at positions prefix .. prefix + n - 1, its own K/V ki/vi) under
    chunked attention: query p sees keys floor(p / chunk) * chunk <= key <= p. The queries split
    at chunk boundaries; each piece attends itself causally and, when its chunk began before it,
    that chunk's earlier keys (from the cache or the piece's predecessors) unmasked, the two
    states merged by LSE. Only the blocks from the first query's chunk on are read."""
    n = qi.shape[0]
    lo = prefix // chunk * chunk                # the earliest key any query of the chunk sees
    k_all, v_all = _keys_from(kv_layer, table, prefix, ki, vi, lo)
    outs, lses = [], []
    a = 0
    while a < n:
        begins = (prefix + a) // chunk * chunk          # this piece's chunk, from its start
        b = min(n, begins + chunk - prefix)
        qt = qi[a:b].to(k_all.dtype)
        own, before = prefix + a - lo, begins - lo      # in k_all: the piece's first key, its chunk's
        o, lse = _attend(qt, k_all[own:own + b - a], v_all[own:own + b - a], True, scale, softcap)
        if before < own:
            op, lsep = _attend(qt, k_all[before:own], v_all[before:own], False, scale, softcap)
            o, lse = _merge2(op, lsep, o, lse)
        outs.append(o)
        lses.append(lse)
        a = b
    return torch.cat(outs), torch.cat(lses)


def _span_visible(n: int, spans, device) -> torch.Tensor:
    """[n, n] keys each of a chunk's queries sees among the chunk's own: the earlier ones and
    itself, and every key of its span (spans: [lo, hi) runs of query rows)."""
    rows = torch.arange(n, device=device)
    visible = rows[None, :] <= rows[:, None]
    for lo, hi in spans:
        visible[lo:hi, lo:hi] = True
    return visible


def _spanned_window_prefill(qi, kv_layer, table, prefix: int, ki, vi, window: int, spans, scale: float,
                            softcap: float | None = None):
    """A sliding-window layer's chunk with spans: query p sees keys p - window < key <= p and
    every key of its span, all under one mask over the window's earliest key onwards (spans are
    images, shorter than any window served, so this is only a chunk by the window's width)."""
    n = qi.shape[0]
    lo = max(0, prefix - window + 1)
    k_all, v_all = _keys_from(kv_layer, table, prefix, ki, vi, lo)
    q_pos = torch.arange(prefix, prefix + n, device=qi.device)
    key_pos = torch.arange(lo, prefix + n, device=qi.device)
    visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
    for a, b in spans:
        visible[a:b, prefix - lo + a:prefix - lo + b] = True
    return _attend_masked(qi.to(k_all.dtype), k_all, v_all, visible, scale, softcap)


def _gather(kv_layer: torch.Tensor, table: torch.Tensor, length: int):
    """Dense K, V [length, Hkv, D] of one request from its block ids (one copy each)."""
    k = kv_layer[:, 0][table].flatten(0, 1)[:length]
    v = kv_layer[:, 1][table].flatten(0, 1)[:length]
    return k, v


def _merge2(o1, l1, o2, l2):
    """Merge two attention states with natural-log LSEs (o [n,H,D], l [n,H] fp32)."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    out = (o1.float() * (w1 / s)[..., None] + o2.float() * (w2 / s)[..., None]).to(o1.dtype)
    return out, torch.log(s) + m


def _fast_cpu(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == kv_layer.dtype and kv_layer.is_contiguous()


def paged_prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                            scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            return_lse: bool = True, workspace: Workspace | None = None,
                            window: int | None = None, softcap: float | None = None, chunk: int | None = None):
    """Attention for the prefill tokens q [Tp,Hq,D]: each chunk sees its request's earlier KV
    plus itself causally (with `window`, only the `window` latest keys up to each query; with
    `chunk`, only the keys of each query's own chunk; with `softcap`, scores capped as Gemma
    2's). KV must
    already be written. If the chunk's own k/v [Tp,Hkv,D] are given they are used instead of
    re-reading them from the cache. Returns (out [Tp,Hq,D], base-2 lse [Tp,Hq] or None)."""
    c = meta.prepare(kv_layer.device)
    out = torch.empty_like(q)
    lse_all = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    fast = _fast_cpu(q, kv_layer)
    bs, hkv, d = meta.block_size, kv_layer.shape[3], kv_layer.shape[4]
    start = 0
    for r, (n, kv_len, (prefix, table)) in enumerate(zip(meta.prefill_query_lens, meta.prefill_kv_lens,
                                                         c["prefill_prefix"])):
        if n == 0:
            continue
        qi = q[start:start + n]
        # Two fused passes -- causal within the chunk, all earlier KV unmasked -- merged by LSE.
        if k is not None and v is not None:
            ki, vi = k[start:start + n].to(kv_layer.dtype), v[start:start + n].to(kv_layer.dtype)
        else:
            ki, vi = _gather(kv_layer, table, kv_len)
            ki, vi = ki[prefix:], vi[prefix:]
        spans = meta.prefill_spans[r] if meta.prefill_spans else ()
        if spans and chunk is not None:
            raise ValueError("bidirectional prefill spans on a chunked-attention layer are not supported")
        local = window is not None and kv_len > window or chunk is not None and kv_len > chunk
        if local:
            if spans:
                o, lse = _spanned_window_prefill(qi, kv_layer, table, prefix, ki, vi, window, spans, scale, softcap)
            elif window is not None:
                o, lse = _windowed_prefill(qi, kv_layer, table, prefix, ki, vi, window, scale, softcap)
            else:
                o, lse = _chunked_prefill(qi, kv_layer, table, prefix, ki, vi, chunk, scale, softcap)
            out[start:start + n] = o
            if return_lse:
                lse_all[start:start + n] = lse * LOG2E
            start += n
            continue
        if spans:
            o, lse = _attend_masked(qi.to(ki.dtype), ki, vi, _span_visible(n, spans, qi.device), scale, softcap)
        else:
            o, lse = _attend(qi.to(ki.dtype), ki, vi, True, scale, softcap)
        if prefix > 0:
            if fast:
                nbp = -(-prefix // bs)
                kv = _gather_rows(kv_layer, c["prefill_prefix_rows"][r], "prefill_kv", workspace)
                kp = kv[:nbp].view(nbp * bs, hkv, d)[:prefix]
                vp = kv[nbp:].view(nbp * bs, hkv, d)[:prefix]
            else:
                kp, vp = _gather(kv_layer, table[:-(-prefix // bs)], prefix)
            op, lsep = _attend(qi.to(kp.dtype), kp, vp, False, scale, softcap)
            o, lse = _merge2(op, lsep, o, lse)
        out[start:start + n] = o
        if return_lse:
            lse_all[start:start + n] = lse * LOG2E
        start += n
    return out, lse_all


def _decode_bucket_manual(qb, k, v, bucket, scale, return_lse, softcap: float | None = None):
    """Portable decode attention of n groups of m queries qb [n*m,Hq,D] over padded k/v
    [n,L,Hkv,D] (fp32 maths). Returns out [n*m,Hq,D] and lse [n*m,Hq] (or None)."""
    n, L, hkv, d = k.shape
    hq, m = qb.shape[1], bucket.num_queries
    g = hq // hkv
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    # The scale goes on the queries (fewer rows than scores) unless scores are capped after it.
    qg = (qb.float() * (scale if softcap is None else 1.0)).view(n, m, hkv, g, d)
    sc = qb.new_empty((n, hkv, m, g, L), dtype=torch.float32)
    # A short loop over KV heads keeps bmm on strided K/V views (no transposed copies).
    for h in range(hkv):
        torch.bmm(qg[:, :, h].reshape(n, m * g, d), k[:, :, h].transpose(1, 2), out=sc[:, h].view(n, m * g, L))
    if softcap is not None:
        _scale_(sc, scale, softcap)
    if bucket.mask is not None:
        sc.masked_fill_(bucket.pad[:, None, :, None, :], float("-inf"))
    lse = None
    if return_lse:
        p, lse = _softmax_lse_(sc, softcap)
    else:
        p = torch.softmax(sc, dim=-1)
    out = qb.new_empty((n, hkv, m, g, d), dtype=torch.float32)
    for h in range(hkv):
        torch.bmm(p[:, h].view(n, m * g, L), v[:, :, h], out=out[:, h].view(n, m * g, d))
    out = out.permute(0, 2, 1, 3, 4).reshape(n * m, hq, d)
    return out, (lse.permute(0, 2, 1, 3).reshape(n * m, hq) if return_lse else None)


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                           scale: float, return_lse: bool = True, workspace: Workspace | None = None,
                           window: int | None = None, softcap: float | None = None, chunk: int | None = None):
    """One query row per decode token, q [Td,Hq,D]. Rows are grouped by KV length into buckets
    (built once per step and window by meta.decode_buckets); each bucket's blocks are gathered
    with one index op into a padded [n, L] layout and attended with a length mask (with `window`
    or `chunk`, from the block of each group's earliest visible key, the keys before each row's
    window or chunk masked too). The rows of one request's drafts share their gather: its m queries attend together,
    each masked at its own length. Returns (out [Td,Hq,D], base-2 lse [Td,Hq] or None)."""
    td, hq, d = q.shape
    if td == 0:
        return q.new_empty(q.shape), (q.new_empty((0, hq), dtype=torch.float32) if return_lse else None)
    fast = _fast_cpu(q, kv_layer)
    bs, hkv = kv_layer.shape[2], kv_layer.shape[3]
    out = torch.empty_like(q)
    lse_all = q.new_empty((td, hq), dtype=torch.float32) if return_lse else None
    for b in meta.decode_buckets(kv_layer.device, window, chunk):
        qb = q if b.index is None else q.index_select(0, b.index)
        m = b.num_queries
        n, L = qb.shape[0] // m, b.num_blocks * bs
        if kv_layer.is_contiguous():
            kv = _gather_rows(kv_layer, b.rows, "decode_kv", workspace)
            half = b.rows.numel() // 2
            k, v = kv[:half].view(n, L, hkv, d), kv[half:].view(n, L, hkv, d)
        else:
            k = kv_layer[:, 0][b.table].flatten(1, 2)
            v = kv_layer[:, 1][b.table].flatten(1, 2)
        if fast and softcap is None:
            mask = b.mask
            if mask is not None and mask.dtype != q.dtype:
                mask = b.mask = mask.to(q.dtype)
            o, lse = _FLASH_CPU(qb.view(n, m, hq, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                0.0, False, attn_mask=mask, scale=scale)
            o = o.transpose(1, 2).reshape(n * m, hq, d)
            lse = lse.transpose(1, 2).reshape(n * m, hq).float() if return_lse else None
        else:
            o, lse = _decode_bucket_manual(qb, k, v, b, scale, return_lse, softcap)
        if b.keep is not None:
            o = o.index_select(0, b.keep)
            lse = lse.index_select(0, b.keep) if return_lse else None
        if b.out_index is None:
            out.copy_(o)
            if return_lse:
                lse_all.copy_(lse * LOG2E)
        else:
            index_copy(out, 0, b.out_index, o.to(out.dtype))
            if return_lse:
                index_copy(lse_all, 0, b.out_index, lse * LOG2E)
    return out, lse_all


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learnt sink logit per head (gpt-oss) from the same attention without one:
    the sink adds e^sink to each row's softmax denominator Z, which scales the row's output by
    Z / (Z + e^sink) = sigmoid(ln Z - sink). out [T,Hq,D], base-2 lse [T,Hq], sinks [Hq]."""
    keep = torch.sigmoid(lse / LOG2E - sinks.float())
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


class TorchAttentionBackend:
    """Writes the step's K/V into one layer's paged cache, then attends (prefill + decode).
    `window`: the layer's sliding window (None: full causal attention); `softcap`: Gemma 2's cap
    on attention scores (None: none; capped layers take the unfused paths, which materialise
    scores); `sinks`: gpt-oss's per-head sink logits [Hq] (None: none), applied through each
    row's LSE (`with_sinks`); `chunk`: Llama 4's attention chunk (None: none)."""

    name = "torch"
    supports_sliding_window = True

    def __init__(self) -> None:
        self.workspace = Workspace()

    def forward(self, layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        c = meta.prepare(layer_kv.device)
        write_kv(layer_kv, k, v, meta.slot_mapping, c["slot_block"], c["slot_offset"], c["slot_row"])
        tp, td = meta.num_prefill_tokens, meta.num_decode_tokens
        lse = sinks is not None
        kw = dict(return_lse=lse, workspace=self.workspace, window=window, softcap=softcap, chunk=chunk)
        if td == 0:
            out, out_lse = paged_prefill_attention(q, layer_kv, meta, scale, k=k, v=v, **kw)
            return out if sinks is None else with_sinks(out, out_lse, sinks)
        out = torch.empty_like(q)
        out_lse = q.new_empty(q.shape[:2], dtype=torch.float32) if lse else None
        if tp:
            o, l_ = paged_prefill_attention(q[:tp], layer_kv, meta, scale, k=k[:tp], v=v[:tp], **kw)
            out[:tp] = o
            if lse:
                out_lse[:tp] = l_
        o, l_ = paged_decode_attention(q[tp:tp + td], layer_kv, meta, scale, **kw)
        out[tp:tp + td] = o
        if lse:
            out_lse[tp:tp + td] = l_
        return out if sinks is None else with_sinks(out, out_lse, sinks)
