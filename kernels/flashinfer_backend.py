"""FlashInfer attention backend (CUDA only): same interface as TorchAttentionBackend.

Per step (one AttentionMetadata) it builds the CSR page tables once and plans a
BatchPrefillWithPagedKVCacheWrapper (causal, bottom-right aligned: chunks see all earlier KV)
and a BatchDecodeWithPagedKVCacheWrapper; every layer then appends its K/V with
append_paged_kv_cache and runs both wrappers. The cache layout [N, 2, B, Hkv, D] is flashinfer's
NHD layout, so the torch and flashinfer backends share KV caches. flashinfer LSEs are base 2,
as are the torch backend's. It cannot run on CPU (kernels need sm75+); tests skip without CUDA.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata

try:
    import flashinfer
except ImportError:  # CPU installs
    flashinfer = None

_WORKSPACE_BYTES = 128 * 1024 * 1024


def flashinfer_available() -> bool:
    return flashinfer is not None and torch.cuda.is_available()


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [T, S, H, D], s [T, S, H] base-2 LSEs -> merged (v [T, H, D], s [T, H])."""
    return flashinfer.merge_states(v, s)


def _csr(kv_lens: list[int], tables: list[list[int]], page_size: int):
    indptr, indices, last = [0], [], []
    for kv, bt in zip(kv_lens, tables):
        nb = -(-kv // page_size)
        indices.extend(bt[:nb])
        indptr.append(indptr[-1] + nb)
        last.append(kv - (nb - 1) * page_size if nb else 0)
    return indptr, indices, last


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda"):
        if flashinfer is None:
            raise ImportError("flashinfer is not installed")
        self.device = torch.device(device)
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode_wrappers: dict[bool, object] = {}

    def _decode_wrapper(self, use_tensor_cores: bool):
        w = self._decode_wrappers.get(use_tensor_cores)
        if w is None:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=use_tensor_cores)
            self._decode_wrappers[use_tensor_cores] = w
        return w

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, layer_kv: torch.Tensor, scale: float):
        """Once per step: page tables for the KV append and plans for both wrappers."""
        st = meta.cache.get("flashinfer")
        if st is not None and st["owner"] is self:
            return st
        dev = layer_kv.device
        ps = meta.block_size
        hq, d = q.shape[1], q.shape[2]
        hkv = layer_kv.shape[3]
        i32 = dict(dtype=torch.int32, device=dev)
        st = {"owner": self}

        # One CSR table over all requests (prefills then decodes) for append_paged_kv_cache.
        kv_lens = list(meta.prefill_kv_lens) + list(meta.decode_kv_lens)
        tables = list(meta.prefill_block_tables) + list(meta.decode_block_tables)
        indptr, indices, last = _csr(kv_lens, tables, ps)
        q_lens = list(meta.prefill_query_lens) + [1] * meta.num_decodes
        batch_idx, positions = [], []
        for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
            batch_idx.extend([b] * n)
            positions.extend(range(kv - n, kv))
        st["append"] = (torch.tensor(batch_idx, **i32), torch.tensor(positions, **i32),
                        torch.tensor(indices, **i32), torch.tensor(indptr, **i32), torch.tensor(last, **i32))

        if meta.prefill_spans and any(meta.prefill_spans):
            raise NotImplementedError("bidirectional prefill spans (Gemma 3's images) run on the torch backend only")
        if meta.num_prefills:
            p_indptr, p_indices, p_last = _csr(meta.prefill_kv_lens, meta.prefill_block_tables, ps)
            qo = [0]
            for n in meta.prefill_query_lens:
                qo.append(qo[-1] + n)
            self._prefill.plan(
                torch.tensor(qo, **i32), torch.tensor(p_indptr, **i32), torch.tensor(p_indices, **i32),
                torch.tensor(p_last, **i32), hq, hkv, d, ps,
                causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=layer_kv.dtype)
        if meta.num_decodes:
            d_indptr, d_indices, d_last = _csr(meta.decode_kv_lens, meta.decode_block_tables, ps)
            # The CUDA-core decode kernels only instantiate a few GQA group sizes.
            wrapper = self._decode_wrapper(use_tensor_cores=(hq // hkv) not in (1, 2, 4, 8))
            wrapper.plan(
                torch.tensor(d_indptr, **i32), torch.tensor(d_indices, **i32), torch.tensor(d_last, **i32),
                hq, hkv, d, ps, pos_encoding_mode="NONE", sm_scale=scale,
                q_data_type=q.dtype, kv_data_type=layer_kv.dtype)
            st["decode"] = wrapper
        meta.cache["flashinfer"] = st
        return st

    def forward(self, layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        if window is not None or chunk is not None:
            raise ValueError(f"window: {window}, chunk: {chunk}: the flashinfer backend takes no sliding window or "
                             "attention chunk; such models run on the torch backend (kernels.get_attention_backend)")
        if softcap is not None:
            raise ValueError(f"softcap: {softcap}: the flashinfer backend caps no scores; soft-capped models run "
                             "on the torch backend (kernels.get_attention_backend)")
        if sinks is not None:
            raise ValueError("sinks: the flashinfer backend takes no attention sinks; models with them (gpt-oss) run "
                             "on the torch backend (kernels.get_attention_backend)")
        st = self._plan(meta, q, layer_kv, scale)
        batch_idx, positions, indices, indptr, last = st["append"]
        flashinfer.append_paged_kv_cache(k.to(layer_kv.dtype), v.to(layer_kv.dtype), batch_idx, positions,
                                         layer_kv, indices, indptr, last, kv_layout="NHD")
        tp, td = meta.num_prefill_tokens, meta.num_decode_tokens
        out = torch.empty_like(q)
        if tp:
            out[:tp] = self._prefill.run(q[:tp], layer_kv)
        if td:
            out[tp:tp + td] = st["decode"].run(q[tp:tp + td], layer_kv)
        return out

    def prefill_with_lse(self, q: torch.Tensor, layer_kv: torch.Tensor, meta: AttentionMetadata, scale: float):
        """Prefill part only (KV already written), returning (out, base-2 lse)."""
        self._plan(meta, q, layer_kv, scale)
        return self._prefill.run(q, layer_kv, return_lse=True)
