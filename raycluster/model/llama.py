"""From-scratch Llama-family decoder in a flat, varlen layout over a paged KV cache: Llama,
Qwen2 / Qwen3, Mistral, Phi-3, Granite, OLMo 2 / 3, Cohere, GLM-4, SmolLM3, EXAONE 4, Gemma 1-3, and
with routed experts (raycluster.model.moe) Mixtral, Qwen-MoE, GLM-4.5 and DeepSeek-V2 / V3 (whose
latent attention is raycluster.model.mla), gpt-oss (raycluster.model.gpt_oss) and Llama 4
(raycluster.model.llama4). One layer, parametrised by the config's family fields (norm kind and
placement `BLOCK_NORMS`, q/k norms, biases, RoPE layout and layers without it, multipliers, soft
caps); what the attention backend applies per layer: a sliding window, a soft cap, gpt-oss's sinks,
Llama 4's attention chunk. Parameter names are identical to Hugging Face's so checkpoints load
directly.

forward(input_ids [T], positions [T], kv_cache [L, N, 2, B, Hkv, D], meta) -> hidden [T, H];
compute_logits(hidden [n, H]) -> [n, vocab] for just the rows the engine samples from. A step
whose requests use LoRA adapters passes `lora` (raycluster.model.lora.StepLoRA): each targeted
projection adds its adapters' low-rank update on their tokens' rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.metadata import AttentionMetadata
from raycluster.model.config import ModelConfig
from raycluster.model.gpt_oss import GptOssMoE
from raycluster.model.granite_moe import GraniteMoE
from raycluster.model.llama4 import Llama4MoE
from raycluster.model.query_scale import ministral3_query_scale, query_temperature
from raycluster.model.mla import MLAttention
from raycluster.model.mrope import mrope_cos_sin
from raycluster.model.moe import SparseMoE
from raycluster.model.quant.linear import quantize_linears
from raycluster.model.rope import RotaryEmbedding, apply_rope



def splice_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """`x` [T, H] with each (first row, embeddings [k, H]) piece written over its rows: prompt
    images' features over their placeholders' token embeddings, as HF's LLaVA scatters them.
    A piece wider than H (Qwen3-VL's, [k, (1 + levels) * H]) carries its deepstack levels after
    the features: only its first H columns are written here (`add_deepstack` adds the rest)."""
    h = x.shape[1]
    for row, e in rows:
        x[row:row + e.shape[0]] = e[:, :h].to(device=x.device, dtype=x.dtype)
    return x


def deepstack_levels(rows, hidden: int) -> int:
    """How many deepstack levels the image pieces `rows` carry (0: none, any other model)."""
    return max((e.shape[1] // hidden - 1 for _, e in rows), default=0)


def add_deepstack(x: torch.Tensor, rows, level: int) -> torch.Tensor:
    """Qwen3-VL's deepstack: after decoder layer `level`, each image piece's level-`level`
    features (columns (level + 1) * H onwards) are added to its rows' hidden states, as
    transformers' `_deepstack_process` adds them to the image positions."""
    h = x.shape[1]
    lo = (level + 1) * h
    for row, e in rows:
        if e.shape[1] >= lo + h:
            x[row:row + e.shape[0]] += e[:, lo:lo + h].to(device=x.device, dtype=x.dtype)
    return x

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in fp32 before the cast back (weights start at 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class L2Norm(nn.Module):
    """Llama 4's weightless RMS norm of q / k heads (fp32, cast back)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class BiasFreeLayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, no bias, in fp32 before the cast back. `shape` may be
    (heads, head_dim): one weight row per head, normalising over head_dim."""

    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        x32 = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def _norm(cfg: ModelConfig, dim: int | tuple[int, ...]) -> nn.Module:
    if cfg.layer_norm_bias:
        return nn.LayerNorm(dim, eps=cfg.rms_norm_eps)
    if cfg.layer_norm:
        return BiasFreeLayerNorm(dim, cfg.rms_norm_eps)
    return (GemmaRMSNorm if cfg.gemma is not None else RMSNorm)(dim, cfg.rms_norm_eps)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap: cap * tanh(x / cap) (None: x unchanged)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def finish_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The output head's logits as the model family returns them: divided by Granite's
    logits_scaling, times Cohere's logit_scale, capped by Gemma 2's final soft cap (elementwise:
    a vocab slice alone too)."""
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    if cfg.logit_scale != 1.0:             # Cohere multiplies
        logits = logits * cfg.logit_scale
    return logits if cfg.gemma is None else softcap(logits, cfg.gemma.final_softcap)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None, rope: bool = True):
        super().__init__()
        self.window = window        # sliding window of this layer (None: full causal attention)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.gemma.attention_scale if cfg.gemma is not None else \
            cfg.attention_multiplier if cfg.attention_multiplier is not None else cfg.head_dim ** -0.5
        self.softcap = None if cfg.gemma is None else cfg.gemma.attn_softcap
        # Llama 4's RoPE layers attend within chunks of attention_chunk_size tokens.
        self.chunk = cfg.llama4.attention_chunk_size if cfg.llama4 is not None and rope else None
        # gpt-oss: one learnt logit per head joins its softmax (the backend applies it).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm and cfg.qk_norm_per_head_weights:      # Cohere: a weight row per head
            self.q_norm = _norm(cfg, (self.num_heads, self.head_dim))
            self.k_norm = _norm(cfg, (self.num_kv_heads, self.head_dim))
        elif cfg.qk_norm:     # per head, over head_dim: one weight serves every head (and TP rank)
            self.q_norm = _norm(cfg, self.head_dim)
            self.k_norm = _norm(cfg, self.head_dim)
        elif cfg.qk_norm_across_heads:      # OLMo 2: over the whole projection, before the split into heads
            self.q_norm = _norm(cfg, self.num_heads * self.head_dim)
            self.k_norm = _norm(cfg, self.num_kv_heads * self.head_dim)
        # Llama 4: weightless, on its RoPE layers only (after RoPE there; a rotation keeps the RMS).
        l2 = cfg.llama4 is not None and cfg.llama4.l2_qk_norm and rope
        if l2:
            self.q_norm = self.k_norm = L2Norm(cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm or l2
        self.qk_norm_after_rope = cfg.qk_norm_after_rope
        if cfg.qk_norm_after_rope:      # Hunyuan's, under its names
            self.query_layernorm = _norm(cfg, self.head_dim)
            self.key_layernorm = _norm(cfg, self.head_dim)
        self.qk_norm_across_heads = cfg.qk_norm_across_heads
        self.rope_interleaved = cfg.rope_interleaved

    def forward(self, x, cos, sin, layer_kv, meta, backend, lora=None, index: int = 0, q_scale=None):
        """`q_scale`: [T, 1, 1] factors on the queries after RoPE (`LlamaForCausalLM.layer_ropes`)."""
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:
            q, k, v = (lora.add(index, name, x, y) for name, y in (("q_proj", q), ("k_proj", k), ("v_proj", v)))
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:         # None: a layer without position embedding (Cohere 2's full layers)
            q, k = apply_rope(q, k, cos, sin, self.rope_interleaved)
        if q_scale is not None:
            q = (q * q_scale).to(q.dtype)
        if self.qk_norm_after_rope:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        o = backend.forward(layer_kv, q, k, v, meta, self.scale, window=self.window, softcap=self.softcap,
                            sinks=self.sinks, chunk=self.chunk)
        o = o.reshape(t, self.num_heads * self.head_dim)
        return self.o_proj(o) if lora is None else _project(self.o_proj, o, lora, index, "o_proj")


class MLP(nn.Module):
    output_proj = "down_proj"       # the row-parallel projection on a tp rank (raycluster.parallel.shard)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.act = F.silu if cfg.gemma is None else _gelu_tanh

    def forward(self, x, lora=None, index: int = 0):
        if lora is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        h = self.act(lora.add(index, "gate_proj", x, self.gate_proj(x))) * lora.add(index, "up_proj", x, self.up_proj(x))
        return _project(self.down_proj, h, lora, index, "down_proj")


class PlainMLP(nn.Module):
    """StarCoder2's ungated MLP: c_proj(gelu_tanh(c_fc(x))). No LoRA target names it."""
    output_proj = "c_proj"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, lora=None, index: int = 0):
        return self.c_proj(_gelu_tanh(self.c_fc(x)))


class XIELU(nn.Module):
    """Apertus' xIELU activation, its learnt parameters under transformers' names: for x > 0
    softplus(alpha_p) x^2 + beta x, else (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x."""

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta = nn.Parameter(torch.empty(()))
        self.eps = nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class UngatedMLP(nn.Module):
    """down_proj(act(up_proj(x))): Arcee's with ReLU squared, Apertus' with xIELU (`act_fn`)."""
    output_proj = "down_proj"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # xIELU is a module with parameters (`act_fn.*` in the checkpoint); ReLU squared is a function.
        self.act_fn = XIELU() if cfg.ungated_mlp == "xielu" else _relu2

    def forward(self, x, lora=None, index: int = 0):
        up = self.up_proj(x) if lora is None else lora.add(index, "up_proj", x, self.up_proj(x))
        h = self.act_fn(up)
        return self.down_proj(h) if lora is None else _project(self.down_proj, h, lora, index, "down_proj")


def _project(linear, x, lora, index: int, name: str):
    """linear(x) plus the step's adapters' update. A tensor-parallel rank's row-parallel layer
    (raycluster.parallel.shard.RowParallelLinear) sums partial outputs over the group: its
    update, from the rank's share of x, is a partial sum too and joins before the reduce."""
    partial = getattr(linear, "partial", None)
    if partial is None:
        return lora.add(index, name, x, linear(x))
    return linear.reduce(lora.add(index, name, x, partial(x)))


# Each block layout's norms by checkpoint name: (before attention, after attention, before the
# MLP, after the MLP); None: no norm there.
BLOCK_NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),                 # Llama
    "sandwich": ("input_layernorm", "post_attention_layernorm",                          # Gemma 2 / 3
                 "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "glm4": ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),    # OLMo 2
    "parallel": ("input_layernorm", None, None, None),      # Cohere: one norm feeds attention and the MLP
    "apertus": ("attention_layernorm", None, "feedforward_layernorm", None),     # Llama's, under its names
}


class DecoderLayer(nn.Module):
    """Decoder layer `index` of the full model: its sliding window (if any) and its feed-forward
    block, a dense MLP or routed experts (`SparseMoE`), both from the config; with a quantized
    checkpoint its linear layers are QuantLinears (raycluster.model.quant). The config's
    `block_norms` places the norms (`BLOCK_NORMS`, under the checkpoint's names); in the
    "parallel" layout attention and the MLP read the same normed input and both add to the
    residual. Granite's residual multiplier scales each block's output before its add."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.window_of(index), index not in cfg.nope_layers) if cfg.mla is None else \
            MLAttention(cfg, lambda dim: _norm(cfg, dim), cfg.window_of(index))
        sparse = cfg.is_moe_layer(index)
        # Registered under the checkpoint's name for it: Mixtral's `block_sparse_moe`, Llama 4's
        # `feed_forward`, else `mlp`.
        self._ffn_name = "block_sparse_moe" if sparse and cfg.moe.mixtral_names else \
            "feed_forward" if cfg.llama4 is not None else "mlp"
        ffn = (GptOssMoE if cfg.moe.gpt_oss else Llama4MoE if cfg.moe.llama4 else GraniteMoE if cfg.moe.granite
               else SparseMoE)(cfg) if sparse else \
            PlainMLP(cfg) if cfg.plain_mlp else UngatedMLP(cfg) if cfg.ungated_mlp else MLP(cfg)
        self.add_module(self._ffn_name, ffn)
        self.parallel = cfg.block_norms == "parallel"
        self.norm_names = BLOCK_NORMS[cfg.block_norms]
        for name in self.norm_names:
            if name is not None:
                self.add_module(name, _norm(cfg, cfg.hidden_size))
        self.residual_multiplier = cfg.residual_multiplier
        if cfg.quant is not None:     # a quantized checkpoint's projections (and experts), under its names
            quantize_linears(self, cfg.quant, f"model.layers.{index}")

    @property
    def ffn(self) -> nn.Module:
        return self._modules[self._ffn_name]

    @property
    def activation_dtype(self) -> torch.dtype:
        """The hidden states' dtype (its norms keep it)."""
        return self._modules[next(n for n in self.norm_names if n is not None)].weight.dtype

    def _normed(self, at: int, x: torch.Tensor) -> torch.Tensor:
        """x through the layout's norm at position `at` of BLOCK_NORMS' tuple, if it has one."""
        name = self.norm_names[at]
        return x if name is None else self._modules[name](x)

    def forward(self, x, cos, sin, layer_kv, meta, backend, lora=None, index: int = 0, q_scale=None):
        h = self._normed(0, x)
        a = self.self_attn(h, cos, sin, layer_kv, meta, backend, lora, index, q_scale)
        if self.parallel:
            return x + a + self.ffn(h, lora, index)
        a = self._normed(1, a)
        x = x + (a if self.residual_multiplier == 1.0 else a * self.residual_multiplier)
        m = self._normed(3, self.ffn(self._normed(2, x), lora, index))
        return x + (m if self.residual_multiplier == 1.0 else m * self.residual_multiplier)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg, cfg.hidden_size)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend=None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied: no lm_head parameter at all, logits use the embedding matrix. A checkpoint
        # without a head (config.has_lm_head False) serves pooling only: no logits at all.
        self.lm_head = None if config.tie_word_embeddings or not config.has_lm_head else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        # A sequence classifier's head: the pooled last hidden state -> one logit per label.
        self.score = nn.Linear(config.hidden_size, len(config.labels), bias=False) if config.labels else None
        # An embedding checkpoint's sentence-transformers Dense modules (raycluster.model.projector),
        # set by the loader: not parameters of the decoder's checkpoint.
        self.projector = None
        self.rotary = RotaryEmbedding.from_config(config)
        # Gemma 3's and OLMo 3's sliding layers turn at their own RoPE base, unscaled.
        local = config.sliding_rope_theta
        self.local_rotary = None if local is None else RotaryEmbedding(
            config.rotary_dim, local, None, config.max_position_embeddings, config.rope_interleaved)
        # Gemma multiplies its embeddings by sqrt(hidden_size), rounded to their dtype as HF does.
        self.embed_scale = None if config.gemma is None else config.hidden_size ** 0.5
        self.backend = backend          # explicit; None: a default per device, made on first use
        self._default_backend = None

    def _backend(self, device):
        if self.backend is not None:
            return self.backend
        if self._default_backend is None:
            from kernels import get_attention_backend
            self._default_backend = get_attention_backend(device, torch_only=self.config.torch_attention_only)
        return self._default_backend

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_hidden_layers, num_blocks, 2, block_size, c.num_key_value_heads, c.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend=None, lora=None, aux_layers: tuple[int, ...] = (),
                image_rows=()):
        """`backend`: an attention backend for this call only (a KVP rank's, with its own shard
        and collective); default the model's. `lora`: the step's adapters (StepLoRA), if any.
        `aux_layers` (an EAGLE-3 head's): also return the residual stream entering those
        layers, concatenated [T, len * H], as (hidden, aux). `image_rows`: (first row,
        embeddings) pieces of prompt images written over those rows' token embeddings."""
        backend = backend or self._backend(input_ids.device)
        meta.prepare(kv_cache.device)
        x = self.embed(input_ids)
        levels = 0
        if image_rows:
            x = splice_rows(x, image_rows)
            levels = deepstack_levels(image_rows, x.shape[1])
        ropes = self.layer_ropes(positions, x.dtype, range(len(self.model.layers)))
        aux = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                aux[i] = x
            cos, sin, q_scale = ropes[i]
            layer_kv, layer_meta = meta.layer(i, kv_cache)
            x = layer(x, cos, sin, layer_kv, layer_meta, backend, lora, i, q_scale)
            if i < levels:
                x = add_deepstack(x, image_rows, i)
        if aux_layers:
            return self.model.norm(x), torch.cat([aux[i] for i in aux_layers], dim=-1)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            return x * torch.tensor(self.embed_scale, dtype=x.dtype)
        # Granite's multiplier, a Python float as transformers applies it (not rounded first).
        return x * self.config.embedding_multiplier if self.config.embedding_multiplier != 1.0 else x

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype, layers) -> list[tuple]:
        """(cos, sin, query factors) for each of `layers` (indices into the full model), in order:
        one table for all, Gemma 3's / OLMo 3's local table for their sliding layers, no table for a
        layer without position embedding (Cohere 2's full-attention layers, Llama 4's NoPE layers).
        Query factors ([T, 1, 1], or None) scale the queries after RoPE: Llama 4's temperature on its
        NoPE layers (fp32, as transformers multiplies), Ministral 3's long-context factor on every
        layer (in `dtype`, as transformers casts it). `positions` [T], or [3, T] for a step with
        Qwen-VL image prompts (raycluster.model.mrope: each stream turns its own frequencies)."""
        if positions.dim() == 2:
            cos, sin = mrope_cos_sin(*self.rotary.cos_sin(positions, dtype), self.config.mrope)
            return [(cos, sin, None)] * len(layers)
        full = self.rotary.cos_sin(positions, dtype)
        nope = self.config.nope_layers
        scaling = self.config.query_scaling
        if scaling is not None:
            full = (*full, ministral3_query_scale(positions, *scaling).to(dtype))
        else:
            full = (*full, None)
        if self.local_rotary is None and not nope:
            return [full] * len(layers)
        local = (*self.local_rotary.cos_sin(positions, dtype), None) if self.local_rotary is not None else full
        l4 = self.config.llama4
        unroped = (None, None, None if l4 is None or l4.temperature is None else
                   query_temperature(positions, *l4.temperature))
        return [unroped if i in nope else local if self.config.window_of(i) is not None else full for i in layers]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # By the config, not by lm_head being None: a pipeline/TP rank without the head has None too.
        if not self.config.has_lm_head:
            raise RuntimeError("this checkpoint has no output head (lm_head.weight): it serves pooling requests only")
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(hidden, w)
        return finish_logits(logits, self.config)
