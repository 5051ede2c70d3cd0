"""Paged attention in plain torch (CPU and any device): KV writes, chunked prefill against a
paged cache, batched decode, and flashinfer-compatible LSE merging.

LSEs returned by this module are base 2 (flashinfer's convention), so states from either
backend can be merged with `merge_states`.

Prefill avoids materialising [H, T, T] scores: on CPU it uses torch's fused flash attention
(`_scaled_dot_product_flash_attention_for_cpu`, which returns the natural-log LSE and supports
GQA without expanding K/V); elsewhere it tiles queries. A chunk with earlier KV is computed as
two states -- "all earlier KV, no mask" and "causal within the chunk" -- merged by LSE; this is
exactly the bottom-right aligned causal mask.
"""

from __future__ import annotations

import math

import torch

from kernels.metadata import AttentionMetadata

LOG2E = 1.0 / math.log(2.0)
_Q_TILE = 1024


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             slot_block: torch.Tensor | None = None, slot_offset: torch.Tensor | None = None) -> None:
    """Store k, v [T, Hkv, D] into kv_layer [N, 2, B, Hkv, D] at the given flat slots."""
    if k.shape[0] == 0:
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


def _attend_tiled(q, k, v, causal: bool, scale: float):
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
        qg = qt.view(m, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m * g, d)
        sc = torch.bmm(qg, kf).view(hkv, m, g, L) * scale
        if causal:
            rows = torch.arange(start, start + m, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] > rows[:, None]
            sc = sc.masked_fill(mask[None, :, None, :], float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)  # [Hkv, m, g]
        p = torch.exp(sc - lse[..., None])
        o = torch.bmm(p.view(hkv, m * g, L), vf).view(hkv, m, g, d)
        outs.append(o.permute(1, 0, 2, 3).reshape(m, hq, d))
        lses.append(lse.permute(1, 0, 2).reshape(m, hq))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def _attend(q, k, v, causal: bool, scale: float):
    """Dense attention of q [n,Hq,D] over k/v [L,Hkv,D] (causal: top-left, used with n == L).
    Returns (out [n,Hq,D], natural-log lse [n,Hq] fp32)."""
    if q.device.type == "cpu" and q.dtype == k.dtype:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), 0.0, causal, scale=scale)
        return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1).float()
    return _attend_tiled(q, k, v, causal, scale)


def _gather(kv_layer: torch.Tensor, table: torch.Tensor, length: int):
    """Dense K, V [length, Hkv, D] of one request from its block ids (one copy each)."""
    k = kv_layer[:, 0][table].flatten(0, 1)[:length]
    v = kv_layer[:, 1][table].flatten(0, 1)[:length]
    return k, v


def paged_prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                            scale: float, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            return_lse: bool = True):
    """Attention for the prefill tokens q [Tp,Hq,D]: each chunk sees its request's earlier KV
    plus itself causally. KV must already be written. If the chunk's own k/v [Tp,Hkv,D] are
    given they are used instead of re-reading them from the cache.
    Returns (out [Tp,Hq,D], base-2 lse [Tp,Hq] or None)."""
    c = meta.prepare(kv_layer.device)
    out = torch.empty_like(q)
    lse_all = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    start = 0
    for n, kv_len, (prefix, table) in zip(meta.prefill_query_lens, meta.prefill_kv_lens, c["prefill_prefix"]):
        if n == 0:
            continue
        qi = q[start:start + n]
        if k is not None and v is not None:
            ki, vi = k[start:start + n].to(kv_layer.dtype), v[start:start + n].to(kv_layer.dtype)
        else:
            ki, vi = _gather(kv_layer, table, kv_len)
            ki, vi = ki[prefix:], vi[prefix:]
        o, lse = _attend(qi.to(ki.dtype), ki, vi, True, scale)
        if prefix > 0:
            kp, vp = _gather(kv_layer, table[:-(-prefix // meta.block_size)], prefix)
            op, lsep = _attend(qi, kp, vp, False, scale)
            o, lse2 = merge_states(torch.stack([op, o], 1), torch.stack([lsep, lse], 1) * LOG2E)
            lse = lse2 / LOG2E
        out[start:start + n] = o
        if return_lse:
            lse_all[start:start + n] = lse * LOG2E
        start += n
    return out, lse_all


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                           scale: float, return_lse: bool = True):
    """One query token per decode request, q [Td,Hq,D], batched: all requests' blocks are
    gathered with one index op into a padded [Td, Lmax] layout and masked by length.
    Returns (out [Td,Hq,D], base-2 lse [Td,Hq] or None)."""
    c = meta.prepare(kv_layer.device)
    td, hq, d = q.shape
    if td == 0:
        return q.new_empty(q.shape), (q.new_empty((0, hq), dtype=torch.float32) if return_lse else None)
    table, pad = c["decode_table"], c["decode_pad_mask"]
    # Gather K and V separately: each result is contiguous [Td, nb, B, Hkv, D], so the view to
    # [Td, L, Hkv, D] is free (gathering kv_layer[table] whole would need another copy).
    k = kv_layer[:, 0][table].flatten(1, 2)
    v = kv_layer[:, 1][table].flatten(1, 2)
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    L, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.float().view(td, hkv, g, d)
    sc = q.new_empty((td, hkv, g, L), dtype=torch.float32)
    # A short loop over KV heads keeps bmm on strided views (no K/V transposed copies).
    for h in range(hkv):
        torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2), out=sc[:, h])
    sc.mul_(scale).masked_fill_(pad[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(sc, dim=-1)
    p = torch.exp(sc - lse[..., None])
    out = q.new_empty((td, hkv, g, d), dtype=torch.float32)
    for h in range(hkv):
        torch.bmm(p[:, h], v[:, :, h], out=out[:, h])
    out = out.view(td, hq, d).to(q.dtype)
    return out, (lse.reshape(td, hq) * LOG2E if return_lse else None)


class TorchAttentionBackend:
    """Writes the step's K/V into one layer's paged cache, then attends (prefill + decode)."""

    name = "torch"

    def forward(self, layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        c = meta.prepare(layer_kv.device)
        write_kv(layer_kv, k, v, meta.slot_mapping, c["slot_block"], c["slot_offset"])
        tp, td = meta.num_prefill_tokens, meta.num_decode_tokens
        if td == 0:
            return paged_prefill_attention(q, layer_kv, meta, scale, k=k, v=v, return_lse=False)[0]
        out = torch.empty_like(q)
        if tp:
            out[:tp] = paged_prefill_attention(q[:tp], layer_kv, meta, scale, k=k[:tp], v=v[:tp],
                                               return_lse=False)[0]
        out[tp:tp + td] = paged_decode_attention(q[tp:tp + td], layer_kv, meta, scale, return_lse=False)[0]
        return out
