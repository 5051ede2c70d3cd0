"""Analytic roofline batch-time model for GPU clusters (a `BatchPredictor` without a GPU).

Owns: hardware figures (A100 / H100 / H200: dense bf16, int8 and fp8 peaks, HBM and NVLink bandwidth
per GPU, inter-node bandwidth per GPU), Llama-3 8B / 70B, Mixtral 8x7B and Qwen3-30B-A3B shapes, the
weight quantization schemes vLLM serves (w4a16, w8a16, w8a8, fp8), and the step-time formulas
below. Data enters as a `RooflinePredictor(gpu, model, tp, spp, kvp, mfu, mbu, ..., quantization)`;
it leaves through `batch_time(prefills, decode_kv_lens)` and `prefill_time(num_tokens, kv_before)` in seconds, so
the simulator and the Medha packer can plan for hardware this project never runs on.

Notation: L layers, h hidden, H_q / H_kv heads, d head dim (h / H_q, or Qwen3's own: H_q d = 2h),
I intermediate, V vocab, b = 2 bytes (bf16). A batch has prefill chunks (q_i tokens after kv_i cached) and decodes
(1 token after kv_j cached); T = sum q_i + n_dec new tokens, S = number of sequences.
  P_layer  = 2 h (H_q d) + 2 h (H_kv d) + 3 h I                matmul params per layer
  F_lin    = 2 L P_layer T + 2 V h S                           GEMM FLOPs (lm_head once per seq)
  pairs    = sum q_i (kv_i + (q_i + 1) / 2) + sum (kv_j + 1)   causal query-key pairs
             (non-causal: q_i (kv_i + q_i), the count behind the seed's "1M tokens, 70B = 2.8 EFLOP")
  F_attn   = 4 L (H_q d) pairs                                 QK^T and AV
  W        = w L P_layer + b V h                               weight bytes read per step
  M        = w L P_layer + 2 b V h                             weight bytes resident (+ embedding;
                                                               the simulator sizes KV beside them)
Quantization (a checkpoint's format, as vLLM serves it) sets w, the bytes per decoder-layer matmul
parameter, and x, the speed-up of the decoder-layer GEMMs over the bf16 peak; the embedding and
lm_head stay bf16 (vLLM leaves lm_head unquantized for these schemes), and so do the KV cache,
activations and attention:
  none    w = b                 x = 1
  w4a16   w = 1/2 + 2/128       x = 1   int4 weights, a bf16 scale per 128 input columns; weight-only
                                        (Marlin-style kernels dequantize in registers, GEMM in bf16)
  w8a16   w = 1                 x = 1   int8 weights, per-channel scales (ignored); weight-only
  w8a8    w = 1                 x = P_int8 / P_peak   int8 weights and activations (2 on A100, H100, H200)
  fp8     w = 1                 x = P_fp8 / P_peak    fp8 weights and activations (2 on H100 / H200);
                                        a GPU without fp8 tensor cores (A100) runs it weight-only, x = 1
Mixture-of-experts (Mixtral 8x7B, Qwen3-30B-A3B: E experts of intermediate I per layer, k per token):
P_layer counts k experts and the router (h E); W counts every expert a step's T tokens touch,
expecting uniform routing: each stays unread with probability (1 - k/E)^T (a decode of one
token reads k of them, a large batch all). Tensor parallelism splits every expert t ways.
  B_kv     = 2 b L (H_kv d) (sum (kv_i + q_i) + sum (kv_j + 1))    KV read + written
Per GPU with tensor parallel t, stream-pipeline stages p, KV-parallel groups k
(t_kv = min(t, H_kv): KV heads stop splitting once every GPU holds one):
  lin   = max((2 L P_layer T / x + 2 V h S) / (p t P_peak MFU),  W / (p t BW_hbm MBU))
  attn  = max(F_attn / (p t k P_peak MFU),  B_kv / (p t_kv k BW_hbm MBU))
  tp    = (L/p) * 2 * [2 (t-1)/t * T h b / BW_nvlink + lat_ar]          two all-reduces per layer
  kvp   = (L/p) * [(k-1) * T (H_q d b + 4 H_q) / (t BW_link) + lat_p2p]  partial outputs + softmax
                                                                       stats merged (online softmax)
  stage = lin + attn + tp + kvp
  send  = T h b / BW_link + lat_p2p                                    activations between stages
  batch_time = p * stage + (p - 1) * send + overhead                   a token's trip through all
                                                                       stages (what TPOT sees)
SPP prefill of one long request in chunks c_1..c_n (stage times s_1 <= ... <= s_n, chunk j+1
enters stage 1 as soon as chunk j leaves it):
  prefill_time = sum_j (s_j + send_j) + (p - 1) (s_n + send_n) + overhead
KVP: the query is replicated to the k groups, each attends over its 1/k of the KV, so attention
FLOPs and KV bytes divide by k; the linear layers do not speed up. BW_link is NVLink while
t * k * p GPUs fit in one node, else the inter-node (InfiniBand) bandwidth per GPU.
Ignored: activation traffic, kernel launch gaps (fold them into `overhead_s`), routing skew
(hot experts) and expert parallelism; quantization's scale bytes other than w4a16's group scales,
its dequantization work, a MoE router's being left unquantized (h E per layer, < 0.1 % of it), and
any change of MFU / MBU with the kernels (one mfu, one mbu for every scheme).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

MEMO_MAX = 1 << 18      # memoised single-chunk / prefill times per predictor (cleared when full)


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's weight format as vLLM serves it (compressed-tensors, GPTQ / AWQ, FP8)."""
    name: str
    weight_bytes: float        # per decoder-layer matmul parameter, scales included (0: the model's dtype)
    compute: str               # tensor cores the decoder-layer GEMMs run on: "bf16" | "int8" | "fp8"


# w4a16: int4 plus one bf16 scale per group of 128 input columns (GPTQ / AWQ / compressed-tensors'
# group size); the 8-bit schemes' per-channel scales (2 bytes per output row) are left out.
QUANTIZATIONS = {q.name: q for q in (
    Quantization("none", 0.0, "bf16"),
    Quantization("w4a16", 0.5 + 2 / 128, "bf16"),
    Quantization("w8a16", 1.0, "bf16"),
    Quantization("w8a8", 1.0, "int8"),
    Quantization("fp8", 1.0, "fp8"),
)}
NO_QUANT = QUANTIZATIONS["none"]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bw: float              # bytes/s
    nvlink_bw: float           # bytes/s per direction per GPU
    internode_bw: float        # bytes/s per GPU (InfiniBand NIC share)
    memory_bytes: float
    gpus_per_node: int = 8
    int8_flops: float = 0.0    # dense int8 OP/s (0: no int8 tensor cores)
    fp8_flops: float = 0.0     # dense fp8 FLOP/s (0: no fp8 tensor cores)

    def gemm_flops(self, quant: Quantization = NO_QUANT) -> float:
        """Peak of a decoder-layer GEMM under `quant`: the int8 / fp8 tensor cores it runs on, else
        bf16 (weight-only kernels; and vLLM's weight-only Marlin fallback for fp8 on a GPU without
        fp8 tensor cores)."""
        fast = {"int8": self.int8_flops, "fp8": self.fp8_flops}.get(quant.compute, 0.0)
        return fast or self.peak_flops


# Vendor datasheet figures (SXM parts; dense, i.e. without 2:4 sparsity). Peaks: A100 bf16 312
# TFLOPS, int8 624 TOPS, no fp8; H100 / H200 bf16 989 TFLOPS, fp8 1979 TFLOPS, int8 1979 TOPS.
# NVLink: A100 600 GB/s, H100/H200 900 GB/s total, halved per direction. Inter-node: one 200 Gb/s
# HDR (A100) or 400 Gb/s NDR (H100/H200) NIC per GPU.
A100 = GPUSpec("A100-SXM4-80GB", 312e12, 2.039e12, 300e9, 25e9, 80e9, int8_flops=624e12)
H100 = GPUSpec("H100-SXM5-80GB", 989e12, 3.35e12, 450e9, 50e9, 80e9, int8_flops=1979e12, fp8_flops=1979e12)
H200 = GPUSpec("H200-SXM-141GB", 989e12, 4.8e12, 450e9, 50e9, 141e9, int8_flops=1979e12, fp8_flops=1979e12)
GPUS = {g.name.split("-")[0]: g for g in (A100, H100, H200)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int           # the MLP's; a mixture-of-experts model's: each expert's
    vocab: int
    dtype_bytes: int = 2
    experts: int = 0            # routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # k of them run per token
    head_size: int = 0          # 0: hidden / heads (Qwen3's heads are wider: H_q d > h)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """H_q d: the query heads' width (the hidden size, unless the config sets head_dim)."""
        return self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Matmul parameters a token runs through per layer (a MoE model's: k experts and the router)."""
        h, kvd = self.hidden, self.kv_heads * self.head_dim
        if not self.experts:
            return 2 * h * self.q_dim + 2 * h * kvd + 3 * h * self.intermediate
        return 2 * h * self.q_dim + 2 * h * kvd + 3 * h * self.intermediate * self.experts_per_token + h * self.experts

    @property
    def _stored_layer_params(self) -> int:
        if not self.experts:
            return self.layer_params
        return self.layer_params + 3 * self.hidden * self.intermediate * (self.experts - self.experts_per_token)

    @property
    def params(self) -> int:
        """Including input embedding and untied lm_head (Llama-3 8B: 8.03e9; Mixtral 8x7B: 4.67e10)."""
        return self.layers * self._stored_layer_params + 2 * self.vocab * self.hidden

    def bytes_per_param(self, quant: Quantization = NO_QUANT) -> float:
        """w: bytes per decoder-layer matmul parameter (the dtype's unless `quant` packs them)."""
        return quant.weight_bytes or self.dtype_bytes

    def read_bytes(self, quant: Quantization = NO_QUANT) -> float:
        """Bytes a step reads at most: layers (every expert) + lm_head (the embedding is only
        gathered; lm_head stays in the dtype under every scheme)."""
        return (self.bytes_per_param(quant) * self.layers * self._stored_layer_params
                + self.dtype_bytes * self.vocab * self.hidden)

    def resident_bytes(self, quant: Quantization = NO_QUANT) -> float:
        """Bytes the weights hold in GPU memory: `read_bytes` plus the input embedding."""
        return self.read_bytes(quant) + self.dtype_bytes * self.vocab * self.hidden

    @property
    def weight_bytes(self) -> float:
        """`read_bytes` of the unquantized model."""
        return self.read_bytes()

    def step_weight_bytes(self, tokens: int, quant: Quantization = NO_QUANT) -> float:
        """Bytes a step of `tokens` tokens reads: a dense model's `read_bytes`; a MoE model's
        less the experts no token of the step routes to, expecting uniform routing (each token
        picks k of E experts: a layer's expert stays unread with probability (1 - k/E)^tokens)."""
        if not self.experts:
            return self.read_bytes(quant)
        idle = (1.0 - self.experts_per_token / self.experts) ** tokens
        experts = self.bytes_per_param(quant) * self.layers * 3 * self.hidden * self.intermediate * self.experts
        return self.read_bytes(quant) - experts * idle

    def kv_bytes_per_token(self) -> float:
        return 2 * self.dtype_bytes * self.layers * self.kv_heads * self.head_dim


LLAMA3_8B = ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256)
MIXTRAL_8X7B = ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, experts_per_token=2)
QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, experts=128, experts_per_token=8,
                           head_size=128)
MODELS = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B, MIXTRAL_8X7B, QWEN3_30B_A3B)}


@dataclass(frozen=True)
class StepCost:
    """One pipeline stage's time, split by term (seconds)."""
    linear: float
    attention: float
    tp_comm: float
    kvp_comm: float
    send: float
    compute_bound: bool

    @property
    def stage(self) -> float:
        return self.linear + self.attention + self.tp_comm + self.kvp_comm


@dataclass
class RooflinePredictor:
    gpu: GPUSpec = A100
    model: ModelShape = LLAMA3_8B
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    mfu: float = 0.5            # Medha reports 50-60 % MFU for prefill
    mbu: float = 0.8            # and up to 92 % MBU for decode
    allreduce_latency_s: float = 10e-6
    p2p_latency_s: float = 10e-6
    overhead_s: float = 0.0
    causal: bool = True
    chunk_size: int | None = None     # prefill_time chunking (SPP streams these chunks)
    quantization: str = "none"        # a QUANTIZATIONS name: the checkpoint's weight format

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError("mfu and mbu must be in (0, 1]")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: unknown {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")

    @property
    def quant(self) -> Quantization:
        return QUANTIZATIONS[self.quantization]

    @property
    def gemm_scale(self) -> float:
        """1 / x: a decoder-layer GEMM FLOP's share of a bf16 one (1.0 exactly when x = 1, so an
        unquantized or weight-only model's times are the plain formula's, bit for bit)."""
        return self.gpu.peak_flops / self.gpu.gemm_flops(self.quant)

    @property
    def link_bw(self) -> float:
        same_node = self.tp * self.kvp * self.spp <= self.gpu.gpus_per_node
        return self.gpu.nvlink_bw if same_node else self.gpu.internode_bw

    # -- work counts ------------------------------------------------------------------------------
    def flops(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> tuple[float, float]:
        """(linear FLOPs, attention FLOPs) of the whole batch on the whole model."""
        m = self.model
        tokens = sum(q for q, _ in prefills) + len(decode_kv_lens)
        seqs = len(prefills) + len(decode_kv_lens)
        if self.causal:
            pairs = sum(q * (kv + (q + 1) / 2.0) for q, kv in prefills) + sum(kv + 1 for kv in decode_kv_lens)
        else:
            pairs = sum(q * (kv + q) for q, kv in prefills) + sum(kv + 1 for kv in decode_kv_lens)
        f_lin = 2.0 * m.layers * m.layer_params * tokens + 2.0 * m.vocab * m.hidden * seqs
        return f_lin, 4.0 * m.layers * m.q_dim * pairs

    def cost(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> StepCost:
        m, g = self.model, self.gpu
        t, p, k = self.tp, self.spp, self.kvp
        tokens = sum(q for q, _ in prefills) + len(decode_kv_lens)
        seqs = len(prefills) + len(decode_kv_lens)
        _, f_attn = self.flops(prefills, decode_kv_lens)
        # F_lin at the bf16 peak: the decoder-layer GEMMs' FLOPs scaled by 1 / x (the quantized
        # scheme's tensor cores), lm_head's as they are.
        f_lin = 2.0 * m.layers * m.layer_params * self.gemm_scale * tokens + 2.0 * m.vocab * m.hidden * seqs
        kv_tokens = sum(kv + q for q, kv in prefills) + sum(kv + 1 for kv in decode_kv_lens)
        lin_c = f_lin / (p * t * g.peak_flops * self.mfu)
        lin_m = m.step_weight_bytes(tokens, self.quant) / (p * t * g.hbm_bw * self.mbu)
        t_kv = min(t, m.kv_heads)
        attn_c = f_attn / (p * t * k * g.peak_flops * self.mfu)
        attn_m = m.kv_bytes_per_token() * kv_tokens / (p * t_kv * k * g.hbm_bw * self.mbu)
        layers = m.layers / p
        act = tokens * m.hidden * m.dtype_bytes
        tp_comm = 0.0
        if t > 1 and tokens:
            tp_comm = layers * 2 * (2 * (t - 1) / t * act / g.nvlink_bw + self.allreduce_latency_s)
        kvp_comm = 0.0
        if k > 1 and tokens:
            merge = tokens * (m.q_dim * m.dtype_bytes + 4 * m.heads) / t
            kvp_comm = layers * ((k - 1) * merge / self.link_bw + self.p2p_latency_s)
        send = (act / self.link_bw + self.p2p_latency_s) if p > 1 and tokens else 0.0
        return StepCost(max(lin_c, lin_m), max(attn_c, attn_m), tp_comm, kvp_comm, send,
                        compute_bound=lin_c + attn_c >= lin_m + attn_m)

    # -- hot path --------------------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name != "_memo":                 # any parameter change invalidates memoised times
            object.__setattr__(self, "_memo", None)

    def _consts(self) -> dict:
        """Per-predictor constants of `cost`, each a left prefix of the expression it stands in
        for (so the float operations, and results, are exactly those of `cost`)."""
        m, g = self.model, self.gpu
        t, p, k = self.tp, self.spp, self.kvp
        q = self.quant
        return {"lin_f": 2.0 * m.layers * m.layer_params * self.gemm_scale, "lin_s": 2.0 * m.vocab * m.hidden,
                "lin_c": p * t * g.peak_flops * self.mfu, "quant": q,
                "lin_m": m.read_bytes(q) / (p * t * g.hbm_bw * self.mbu), "lin_md": p * t * g.hbm_bw * self.mbu,
                "attn_f": 4.0 * m.layers * m.q_dim, "attn_c": p * t * k * g.peak_flops * self.mfu,
                "kvb": m.kv_bytes_per_token(), "attn_m": p * min(t, m.kv_heads) * k * g.hbm_bw * self.mbu,
                "layers": m.layers / p, "hb": m.hidden, "qb": m.q_dim, "db": m.dtype_bytes,
                "singles": {}, "prefill": {}, "last": (None, 0.0)}

    def _time(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> float:
        """`batch_time` without building a StepCost: the same arithmetic as `cost`, decode sums
        taken once (exact: an int sum does not depend on order; floats take the generator)."""
        c = self._memo
        if c is None:
            c = self._consts()
            object.__setattr__(self, "_memo", c)
        nd = len(decode_kv_lens)
        if nd:
            dk = sum(decode_kv_lens)
            dk = dk + nd if type(dk) is int else sum(kv + 1 for kv in decode_kv_lens)
        else:
            dk = 0
        # The time depends on the decodes only through (nd, dk): a batch timed just before (a
        # packer's last plan, timed again by the engine that runs it) is answered from `last`.
        key = (tuple(map(tuple, prefills)), nd, dk) if type(dk) is int else None
        last = c["last"]
        if key is not None and last[0] == key:
            return last[1]
        if len(prefills) == 1:
            q, kv = prefills[0]
            tokens = q + nd
            pairs = ((q * (kv + (q + 1) / 2.0)) if self.causal else (q * (kv + q))) + dk
            kv_tokens = (kv + q) + dk
        elif prefills:
            tokens = sum(q for q, _ in prefills) + nd
            if self.causal:
                pairs = sum(q * (kv + (q + 1) / 2.0) for q, kv in prefills) + dk
            else:
                pairs = sum(q * (kv + q) for q, kv in prefills) + dk
            kv_tokens = sum(kv + q for q, kv in prefills) + dk
        else:
            tokens, pairs, kv_tokens = nd, 0 + dk, 0 + dk
        seqs = len(prefills) + nd
        f_lin = c["lin_f"] * tokens + c["lin_s"] * seqs
        f_attn = c["attn_f"] * pairs
        lin_m = c["lin_m"] if not self.model.experts else self.model.step_weight_bytes(tokens, c["quant"]) / c["lin_md"]
        lin = max(f_lin / c["lin_c"], lin_m)
        attn = max(f_attn / c["attn_c"], c["kvb"] * kv_tokens / c["attn_m"])
        t, k, p = self.tp, self.kvp, self.spp
        tp_comm = kvp_comm = send = 0.0
        if tokens and (t > 1 or k > 1 or p > 1):
            layers, g = c["layers"], self.gpu
            act = tokens * c["hb"] * c["db"]
            if t > 1:
                tp_comm = layers * 2 * (2 * (t - 1) / t * act / g.nvlink_bw + self.allreduce_latency_s)
            if k > 1:
                merge = tokens * (c["qb"] * c["db"] + 4 * self.model.heads) / t
                kvp_comm = layers * ((k - 1) * merge / self.link_bw + self.p2p_latency_s)
            if p > 1:
                send = act / self.link_bw + self.p2p_latency_s
        time = p * (lin + attn + tp_comm + kvp_comm) + (p - 1) * send + self.overhead_s
        if key is not None:
            c["last"] = (key, time)
        return time

    # -- BatchPredictor -----------------------------------------------------------------------
    def batch_time(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> float:
        if not decode_kv_lens:
            if not prefills:
                return 0.0
            if len(prefills) == 1:          # one chunk alone (prefill-time caches, SLO work): memoised
                q, kv = prefills[0]
                key = (q, kv)
                memo = self._memo
                hit = memo["singles"].get(key) if memo is not None else None
                if hit is None:
                    hit = self._time(prefills, decode_kv_lens)
                    singles = self._memo["singles"]
                    if len(singles) >= MEMO_MAX:
                        singles.clear()
                    singles[key] = hit
                return hit
        return self._time(prefills, decode_kv_lens)

    def prefill_time(self, num_tokens: int, kv_before: int = 0) -> float:
        """Isolated prefill, streamed through the SPP stages in `chunk_size` chunks (memoised)."""
        if num_tokens <= 0:
            return 0.0
        memo = self._memo
        if memo is None:
            memo = self._consts()
            object.__setattr__(self, "_memo", memo)
        key = (num_tokens, kv_before)
        hit = memo["prefill"].get(key)
        if hit is None:
            if len(memo["prefill"]) >= MEMO_MAX:
                memo["prefill"].clear()
            hit = memo["prefill"][key] = self._prefill_time(num_tokens, kv_before)
        return hit

    def _prefill_time(self, num_tokens: int, kv_before: int) -> float:
        size = self.chunk_size or num_tokens
        total, done, last = 0.0, 0, 0.0
        for _ in range(math.ceil(num_tokens / size)):
            q = min(size, num_tokens - done)
            c = self.cost([(q, kv_before + done)], [])
            last = c.stage + c.send
            total += last
            done += q
        return total + (self.spp - 1) * last + self.overhead_s
