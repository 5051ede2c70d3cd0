"""Plain-formula attention used only by tests: dense per-request K/V,
softmax(cap(Q K^T * scale) + bottom-right causal (optionally sliding-window) mask) V, with the LSE
converted to base 2 (cap: Gemma 2's softcap * tanh(x / softcap), or none; sinks: gpt-oss's
per-head logit joining each softmax as one more column whose value is dropped)."""

from __future__ import annotations

import math

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool = True, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None,
                        chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n,Hq,D] (the last n tokens of the request), k/v [L,Hkv,D] (all its KV, L >= n).
    `window` (with causal): each query sees only the `window` latest keys up to itself, as
    Hugging Face's sliding-window mask (key position > query position - window); `chunk`: only
    the keys of its own chunk (key position >= floor(query position / chunk) * chunk).
    Returns out [n,Hq,D] and base-2 lse [n,Hq] (of the scores without the sink), computed in fp64."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)  # [L,Hq,D]
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        # Query i sits at absolute position L - n + i and sees keys 0..L-n+i.
        qpos = torch.arange(L - n, L)[:, None]
        mask = torch.arange(L)[None, :] > qpos
        if window is not None:
            mask |= torch.arange(L)[None, :] <= qpos - window
        if chunk is not None:           # Llama 4's: only the keys of the query's own chunk
            mask |= torch.arange(L)[None, :] < qpos // chunk * chunk
        scores = scores.masked_fill(mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    if sinks is None:
        p = torch.softmax(scores, dim=-1)
    else:
        sink_col = sinks.double()[:, None, None].expand(hq, n, 1)
        p = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hnl,lhd->nhd", p, vv)
    return out.to(q.dtype), (lse.T / math.log(2.0)).float()
