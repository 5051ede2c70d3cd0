"""What one rank of a tensor-parallel (TP) group or pipeline stage holds of the model's weights,
and where it gets them: cut from a full model already in memory (`shard_model`), or read from
the checkpoint files (`load_shard`: only the rank's slices are read, so no process of the
group ever holds the full decoder weights).

The slicing rule, in one place (`layer_part`): q/k/v_proj split by heads (rank r takes a
contiguous block of the query heads and of the KV heads they read, so GQA groups stay whole),
o_proj split along its input over the same heads, gate/up_proj split and down_proj split along
its input over the intermediate size. o_proj and down_proj become `RowParallelLinear`: each
rank's partial output is summed over the group by `reduce`, the bias added once (rank 0 holds it).
Norms are replicated (Qwen3's q/k norms too: they are per head_dim, one weight for every head).
A mixture-of-experts layer's experts (and shared expert) split as the MLP does, each expert over
every rank (vLLM's TP for experts); with `expert_parallel` (vLLM's --enable-expert-parallel over
the TP ranks) rank r instead holds experts [r E / tp, (r + 1) E / tp) whole (`expert_range`), the
shared expert still split. Its router is whole on every rank, so each rank routes every token
alike, and the block reduces its weighted partial sum once either way.

KV heads, as vLLM places them (`kv_split`, `kv_heads_of`): when tp divides the KV heads, rank r
holds the contiguous num_kv_heads / tp of them its query heads read. When tp is a multiple of
them (tp > num_kv_heads, e.g. Qwen2-7B's 4 KV heads over tp 8, or an MQA model over any tp), KV
heads are replicated: rank r holds the one head r // (tp / num_kv_heads), so tp / num_kv_heads
consecutive ranks hold (and each computes and caches its own copy of) the same head, and its
num_attention_heads / tp query heads are all in that head's GQA group. `check_tp` refuses any
other tp.

The modules outside the decoder layers, loaded only where they run (`load_shard`'s flags, chosen
by raycluster.parallel.tp, .kvp and .spp). With tp > 1 the embedding and the output head are
vocab-parallel (raycluster.parallel.vocab, vLLM's VocabParallelEmbedding / ParallelLMHead): lane
t holds only its rows [t V' / tp, (t + 1) V' / tp) of each, V' the vocab padded to a multiple of
tp with zero rows (`RowsPart` reads just those rows from the file), a tied model's head the same
tensor as its embedding rows. The embedding is on every rank that embeds the step's tokens
(every TP rank and KVP x TP lane; the first SPP stage's), its lookups summed over the lanes by
the layers' `reduce`; the final norm and the head are on the lanes that compute the logits
(every TP rank; KVP rank 0's lanes; the last SPP stage's KVP rank 0 lanes), whose slices the
leader gathers (its runner's `run_plan` returns the logits). With tp == 1 (plain SPP) the whole
embedding is on the first stage, the final norm on the rank returning the rows, the whole head
(`lm_head`, untied checkpoints) on the leader, which computes the logits from the returned rows
(engine.model_runner.execute_step, through `GroupModel`). A module a rank does not load is None,
so using it by mistake fails at once.

A rank's weights enter as a `Checkpoint` (path + config) or a loaded full model
(`rank_model` takes either); the rank's model leaves, on its device, with the rank's config
(its heads, its layers), so its `kv_cache_shape` is the rank's KV.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.config import ModelConfig
from raycluster.model.llama import DecoderLayer, LlamaForCausalLM
from raycluster.model.loader import load_tensors
from raycluster.model.granite_moe import granite_expert_part
from raycluster.model.stacked_experts import stacked_expert_part
from raycluster.model.tensor_parts import WHOLE, RowsPart, TensorPart
from raycluster.model.lora import TARGETS as LORA_TARGETS, LoRAAdapter
from raycluster.model.quant.config import QuantConfig
from raycluster.parallel.head_norm import HeadShardedRMSNorm
from raycluster.parallel.kv_heads import expert_range, kv_heads_of, kv_holder, kv_split
from raycluster.parallel.tp_check import check_tp
from raycluster.model.quant.formats import tensor_dims
from raycluster.model.quant.linear import Kernels, QuantLinear, RowParallelQuantLinear, finalize_quantized, is_quantized
from raycluster.parallel.vocab import ParallelLMHead, VocabParallelEmbedding, pad_rows, vocab_rows

# Decoder-layer projections split over the ranks, by the projection's name (nn.Linear weights
# are [out, in]): column-parallel ones split their weight's dim 0 and their bias, row-parallel
# ones dim 1 (the bias whole, on rank 0 only). An expert's (and a shared expert's) projections
# split as a dense MLP's; Mixtral's w1 / w3 / w2 are gate / up / down. DeepSeek's latent
# attention splits by heads the projections out of the latents (q_b_proj, kv_b_proj) and into
# o_proj; the projections into the latents (q_a_proj, kv_a_proj_with_mqa) are whole, and so is
# the one latent KV head (replicated, as an MQA model's). Anything else (norms, a router, a
# shared expert's gate) is whole on every rank.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj", "kv_b_proj", "c_fc")
_ROW = ("o_proj", "down_proj", "w2", "c_proj")
_KV = ("k_proj", "v_proj")      # rows by KV head (`kv_heads_of`)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory and its config: what a rank loads its own part from
    (`quant_kernels`: how a quantized checkpoint's layers run, raycluster.model.quant.linear)."""
    path: str
    config: ModelConfig
    quant_kernels: Kernels = "auto"


def shard_config(cfg: ModelConfig, tp: int, rank: int = 0, expert_parallel: bool = False) -> ModelConfig:
    """The config rank `rank`'s layers are built from: its heads (one KV head when replicated),
    its share of the MLP, and of each expert's (tensor parallel) or of the experts (`expert_parallel`)."""
    check_tp(cfg, tp, expert_parallel)
    moe = cfg.moe
    if moe is not None and expert_parallel:
        experts = expert_range(moe.num_experts, tp, rank)
        moe = dataclasses.replace(moe, shared_intermediate_size=moe.shared_intermediate_size // tp,
                                  local_experts=(experts.start, experts.stop))
    elif moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp,
                                  shared_intermediate_size=moe.shared_intermediate_size // tp)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=kv_split(cfg.num_key_value_heads, tp)[0],
                               intermediate_size=cfg.intermediate_size // tp, moe=moe)


def layer_part(name: str, rank: int, tp: int, num_kv_heads: int, experts: range | None = None,
               quant: QuantConfig | None = None, halves: bool = False,
               head_norms: bool = False) -> TensorPart | None:
    """What rank `rank` of `tp` holds of a decoder layer's tensor `name` (relative to the layer):
    its chunk along the split dim, the whole tensor (norms, Qwen3's per-head-dim q/k norms), or
    None (a row-parallel bias off rank 0). k/v_proj rows (and biases) are its KV heads': chunk
    `rank` of `tp`, or when tp > `num_kv_heads` (replicated) the rows of its one head, chunk
    rank // (tp / num_kv_heads) of num_kv_heads. `experts`: under expert parallelism, the
    routed experts the rank holds whole (`expert_range`; the others' tensors: None). `quant`: a
    quantized checkpoint's config, whose tensors are cut along the dims running over the
    layer's output rows (column-split) or input columns (row-split): `formats.tensor_dims`.
    `halves`: stacked experts store gate / up in halves (`MoEConfig.stacked`), not interleaved.
    `head_norms`: the q/k norms' weights run over heads (OLMo 2's over the whole projection,
    Command R+'s a row per head) and split as q_proj's / k_proj's rows do."""
    parts = name.split(".")
    module, param = parts[-2:]
    if module == "experts":             # stacked experts (gpt-oss, Llama 4, Qwen3-VL-MoE)
        return stacked_expert_part(param, rank, tp, experts is not None, halves)
    if module in ("input_linear", "output_linear") and parts[-3] == "block_sparse_moe":     # Granite's
        return granite_expert_part(module, rank, tp, experts is not None)
    if module == "self_attn" and param == "sinks":      # one per query head
        return TensorPart(0, rank, tp)
    if experts is not None and "experts" in parts:
        return WHOLE if int(parts[parts.index("experts") + 1]) in experts else None
    # (dim over output rows, dim over input columns) of this tensor; None: it has no such dim.
    n_dim, k_dim = (0, 1) if param == "weight" else (0, None)
    if quant is not None and module in _COLUMN + _ROW and param != "bias" and quant.quantizes(name.rpartition(".")[0]):
        n_dim, k_dim = tensor_dims(quant, param)
    if head_norms and module in ("q_norm", "k_norm"):
        module = "q_proj" if module == "q_norm" else "k_proj"
    if module in _KV and tp > num_kv_heads:
        first, _ = kv_heads_of(num_kv_heads, tp, rank)
        return WHOLE if n_dim is None else TensorPart(n_dim, first, num_kv_heads)
    if module in _COLUMN:
        return WHOLE if n_dim is None else TensorPart(n_dim, rank, tp)
    if module in _ROW:
        if param == "bias":
            return WHOLE if rank == 0 else None
        return WHOLE if k_dim is None else TensorPart(k_dim, rank, tp)
    return WHOLE


def shard_layer_state(state: dict[str, torch.Tensor], rank: int, tp: int, num_kv_heads: int,
                      experts: range | None = None, halves: bool = False,
                      head_norms: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of one decoder layer's state dict (names relative to the layer):
    split ones are copied out (contiguous, so the full weights may be freed), norms (and an
    expert-parallel rank's whole experts) are shared, row-parallel biases are kept by rank 0
    only. `num_kv_heads`: the model's, which k/v_proj are cut by; `experts`, `halves`,
    `head_norms`: `layer_part`'s."""
    out = {}
    for name, t in state.items():
        part = layer_part(name, rank, tp, num_kv_heads, experts, halves=halves, head_norms=head_norms)
        if part is None:
            continue
        out[name] = part.take(t).clone(memory_format=torch.contiguous_format) if part is not WHOLE else t
    return out


def shard_adapter(adapter: LoRAAdapter, rank: int, tp: int, num_kv_heads: int,
                  layers: range | None = None) -> LoRAAdapter:
    """Rank `rank`'s part of a LoRA adapter, cut by its base weight's rule (`layer_part`): a
    column-parallel projection's B by the rank's output rows (A whole: x is whole on every
    rank), a row-parallel one's A by its input columns (B whole: each rank's x_r A_r^T B^T is a
    partial sum, added to the layer's partial output before its reduce). `layers`: only these
    layers (an SPP stage's), keyed by their index in the full model as before."""
    out = LoRAAdapter(adapter.name, adapter.path, adapter.rank)
    for (layer, module), (a, b) in adapter.weights.items():
        if layers is not None and layer not in layers:
            continue
        part = layer_part(f"{LORA_TARGETS[module]}.{module}.weight", rank, tp, num_kv_heads)
        if part.dim == 0:
            b = part.take(b).contiguous()
        else:
            a = part.take(a).contiguous()
        out.weights[(layer, module)] = (a, b)
    return out


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class RowParallelLinear(nn.Linear):
    """A linear layer over this rank's share of the input features: the partial output is
    summed over the group by `reduce` (the bias, on one rank only, is summed in once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, reduce: Callable) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output, before the reduce (a LoRA update joins it there)."""
        return F.linear(x, self.weight, self.bias)


def _shard_layer(cfg: ModelConfig, full_cfg: ModelConfig, rank: int, reduce: Callable, index: int) -> DecoderLayer:
    """An empty (meta) decoder layer of the shard config with its o_proj / down_proj row-parallel,
    or its experts' sum reduced once (`index`: the layer's place in the full model, which says
    its sliding window and whether it routes to experts)."""
    layer = DecoderLayer(cfg, index)
    attn = layer.self_attn
    attn.o_proj = _row_parallel(attn.o_proj, full_cfg.o_bias and rank == 0, reduce)
    if full_cfg.qk_norm_across_heads:       # OLMo 2: the RMS of the whole projection, over the group
        tp = full_cfg.num_attention_heads // cfg.num_attention_heads
        attn.q_norm, attn.k_norm = (HeadShardedRMSNorm(norm.weight.shape[0], cfg.rms_norm_eps, tp, reduce)
                                    for norm in (attn.q_norm, attn.k_norm))
    if full_cfg.is_moe_layer(index):
        layer.ffn.reduce = reduce
        if full_cfg.moe.gpt_oss and not cfg.moe.local_experts and rank:
            layer.ffn.experts.down_proj_bias = None     # each expert's bias joins the sum once, from rank 0
    else:
        mlp, out = layer.ffn, layer.ffn.output_proj
        setattr(mlp, out, _row_parallel(getattr(mlp, out), full_cfg.mlp_bias and rank == 0, reduce))
    return layer


def _row_parallel(linear: nn.Module, bias: bool, reduce: Callable) -> nn.Module:
    """The row-split form of a shard layer's `linear` (quantized or not), `bias` on this rank."""
    if isinstance(linear, QuantLinear):
        return RowParallelQuantLinear(linear.in_features, linear.out_features, bias, linear.qc, reduce)
    return RowParallelLinear(linear.in_features, linear.out_features, bias, reduce)


def _check_layers(full_cfg: ModelConfig, rank: int, tp: int, layers: range | None) -> range:
    layers = range(full_cfg.num_hidden_layers) if layers is None else layers
    if not (layers and 0 <= layers[0] and layers[-1] < full_cfg.num_hidden_layers and layers.step == 1):
        raise ValueError(f"layers {layers} is not a contiguous range of the model's {full_cfg.num_hidden_layers}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp {tp}")
    return layers


def _assemble(full_cfg: ModelConfig, rank: int, tp: int, reduce: Callable, layers: range,
              layer_state: Callable[[int], dict[str, torch.Tensor]], expert_parallel: bool) -> LlamaForCausalLM:
    """A meta shard model whose decoder layers are filled with `layer_state(i)` (rank's tensors
    of full layer i); the embedding, final norm and head are left for the caller to set."""
    cfg = dataclasses.replace(shard_config(full_cfg, tp, rank, expert_parallel), num_hidden_layers=len(layers))
    with torch.device("meta"):
        sharded = LlamaForCausalLM(cfg)
        shards = [_shard_layer(cfg, full_cfg, rank, reduce, i) for i in layers]
    for i, layer in zip(layers, shards):
        layer.load_state_dict(layer_state(i), strict=True, assign=True)
    sharded.model.layers = nn.ModuleList(shards)
    sharded.score = None        # a classifier's head: the engine applies it (LLMEngine.classifier)
    return sharded


def _finish(model: LlamaForCausalLM, quant_kernels: Kernels = "auto") -> LlamaForCausalLM:
    finalize_quantized(model, quant_kernels)
    model.eval()
    model.requires_grad_(False)
    return model


def _vocab_modules(sharded: LlamaForCausalLM, full_cfg: ModelConfig, rank: int, tp: int, reduce: Callable,
                   embed: torch.Tensor | None, head: torch.Tensor | None) -> None:
    """Set a tp > 1 shard's vocab-parallel embedding and head from lane `rank`'s padded rows
    (None: the module is not held). A tied model's head is the embedding's Parameter itself."""
    lo, hi, _ = vocab_rows(full_cfg.vocab_size, tp, rank)
    top = sharded.model
    top.embed_tokens = None if embed is None else VocabParallelEmbedding(embed, lo, hi, reduce)
    if head is None:
        sharded.lm_head = None
    elif top.embed_tokens is not None and head is embed:
        sharded.lm_head = ParallelLMHead(top.embed_tokens.weight, full_cfg)
    else:
        sharded.lm_head = ParallelLMHead(head, full_cfg)


def _lane_rows(weight: torch.Tensor, lo: int, hi: int, rows: int) -> torch.Tensor:
    """A lane's `rows` rows of a full embedding or head: a view of rows [lo, hi) when no padding
    falls in them (the full model, which its holder keeps anyway, is not copied again), else a
    padded copy."""
    return weight[lo:hi] if hi - lo == rows else pad_rows(weight[lo:hi], rows)


def _head_norms(cfg: ModelConfig) -> bool:
    """Whether the q/k norms' weights run over heads (split with them)."""
    return cfg.qk_norm_across_heads or cfg.qk_norm_per_head_weights


def _halves(cfg: ModelConfig) -> bool:
    """Whether the model's stacked experts hold gate / up in halves."""
    return cfg.moe is not None and cfg.moe.stacked == "halves"


def _rank_experts(cfg: ModelConfig, rank: int, tp: int, expert_parallel: bool) -> range | None:
    """The experts rank `rank` holds whole under expert parallelism (None: each expert split)."""
    return expert_range(cfg.moe.num_experts, tp, rank) if expert_parallel and cfg.moe is not None else None


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, tp: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] = _identity,
                layers: range | None = None, *, embed: bool = True, head: bool = True,
                expert_parallel: bool = False) -> LlamaForCausalLM:
    """Rank `rank`'s model of a `tp`-way group, from a loaded full model: its own sharded
    decoder layers and the full model's final norm (shared, not copied). With tp > 1 the
    embedding and the output head are vocab-parallel (raycluster.parallel.vocab): lane `rank`'s
    rows of them, views of the full model's (copies padded with zero rows where the padding
    falls), where `embed` / `head` ask (a tied model's head the same tensor as its embedding rows), the embedding summed over the lanes by `reduce`; with tp == 1
    the full model's embedding and head, shared. Its config has the rank's head counts, so
    `kv_cache_shape` is the rank's KV. `reduce` sums a row-parallel layer's (and the vocab-
    parallel embedding's) output over the group (identity: one rank's partial sums, for
    tests). `layers`: only these decoder layers of the full model (an SPP stage's range;
    default all); the shard's config then counts just them, as does its KV shape.
    `expert_parallel`: a MoE model's rank holds its share of the experts whole (`expert_range`)
    instead of a slice of each."""
    layers = _check_layers(model.config, rank, tp, layers)
    head = head and model.config.has_lm_head        # a pooling-only model has none to cut
    if is_quantized(model):
        raise ValueError("a quantized model's shards are read from its checkpoint (load_shard / a Checkpoint): "
                         "its loaded layers hold kernel operands, not the checkpoint's tensors")
    state = model.state_dict()
    experts = _rank_experts(model.config, rank, tp, expert_parallel)

    def layer_state(i: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{i}."
        return shard_layer_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, rank, tp,
                                 model.config.num_key_value_heads, experts, _halves(model.config),
                                 _head_norms(model.config))

    sharded = _assemble(model.config, rank, tp, reduce, layers, layer_state, expert_parallel)
    sharded.model.norm = model.model.norm
    if tp == 1:
        sharded.model.embed_tokens = model.model.embed_tokens
        sharded.lm_head = model.lm_head
        return _finish(sharded)
    cfg = model.config
    lo, hi, rows = vocab_rows(cfg.vocab_size, tp, rank)
    tied = cfg.tie_word_embeddings
    emb = _lane_rows(model.model.embed_tokens.weight, lo, hi, rows) if embed or (head and tied) else None
    out = None
    if head:
        out = emb if tied else _lane_rows(model.lm_head.weight, lo, hi, rows)
    _vocab_modules(sharded, cfg, rank, tp, reduce, emb if embed else None, out)
    return _finish(sharded)


@torch.no_grad()
def load_shard(ckpt: Checkpoint, rank: int, tp: int, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity,
               layers: range | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", *, embed: bool = True, norm: bool = True,
               head: bool = True, expert_parallel: bool = False) -> LlamaForCausalLM:
    """What `shard_model(load_model(ckpt.path), rank, tp, reduce, layers)` builds (the same
    modules, the same values), read from the checkpoint: only the rank's slices of its layers,
    plus the embedding / final norm / output head where `embed` / `norm` / `head` ask for them
    (None otherwise). With tp > 1 only lane `rank`'s vocab rows of the embedding and head are
    read (padded with zero rows: raycluster.parallel.vocab); a tied checkpoint's head is the
    embedding: `head` then reads those rows (the head and the embedding, if both are asked
    for, share them)."""
    full_cfg = ckpt.config
    head = head and full_cfg.has_lm_head        # a pooling-only checkpoint has none to read
    layers = _check_layers(full_cfg, rank, tp, layers)
    experts = _rank_experts(full_cfg, rank, tp, expert_parallel)
    wanted: dict[str, TensorPart] = {}
    for i in layers:
        for name in _layer_names(full_cfg, i):
            part = layer_part(f"model.layers.{i}.{name}", rank, tp, full_cfg.num_key_value_heads, experts,
                              full_cfg.quant, _halves(full_cfg), _head_norms(full_cfg))
            if part is not None:
                wanted[f"model.layers.{i}.{name}"] = part
    tied = full_cfg.tie_word_embeddings
    vocab = WHOLE if tp == 1 else RowsPart(*vocab_rows(full_cfg.vocab_size, tp, rank))
    read_embed = embed or (head and tied)
    if read_embed:
        wanted["model.embed_tokens.weight"] = vocab
    # The final norm's parameters: its weight (and a LayerNorm's bias: StarCoder2).
    norm_params = ["weight", "bias"] if full_cfg.layer_norm_bias else ["weight"]
    if norm:
        wanted.update({f"model.norm.{p}": WHOLE for p in norm_params})
    if head and not tied:
        wanted["lm_head.weight"] = vocab
    tensors = load_tensors(ckpt.path, full_cfg, wanted, dtype, device)

    def layer_state(i: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{i}."
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    sharded = _assemble(full_cfg, rank, tp, reduce, layers, layer_state, expert_parallel)
    top = sharded.model
    if norm:
        top.norm.load_state_dict({p: tensors[f"model.norm.{p}"] for p in norm_params}, assign=True)
    else:
        top.norm = None
    if tp > 1:
        emb = tensors.get("model.embed_tokens.weight")
        out = None
        if head:
            out = emb if tied else tensors["lm_head.weight"]
        _vocab_modules(sharded, full_cfg, rank, tp, reduce, emb if embed else None, out)
        return _finish(sharded, ckpt.quant_kernels)
    if read_embed:
        top.embed_tokens.load_state_dict({"weight": tensors["model.embed_tokens.weight"]}, assign=True)
    else:
        top.embed_tokens = None
    if head and not tied:
        sharded.lm_head.load_state_dict({"weight": tensors["lm_head.weight"]}, assign=True)
    else:
        sharded.lm_head = None      # tied: the embedding is the head (compute_logits reads the config)
    return _finish(sharded, ckpt.quant_kernels)


def _layer_names(cfg: ModelConfig, index: int) -> list[str]:
    """Parameter names of full decoder layer `index`, relative to the layer (a dense and a
    sparse layer differ)."""
    with torch.device("meta"):
        layer = DecoderLayer(cfg, index)
    return [n for n, _ in layer.named_parameters()]


def rank_model(source: LlamaForCausalLM | Checkpoint, rank: int, tp: int,
               reduce: Callable[[torch.Tensor], torch.Tensor] = _identity, layers: range | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *, embed: bool = True,
               norm: bool = True, head: bool = True, expert_parallel: bool = False) -> LlamaForCausalLM:
    """A rank's model from either source: read from the checkpoint (`load_shard`, just what the
    flags ask for), or cut from a full model in memory (`shard_model`: with tp > 1 the vocab
    rows of the embedding and head the flags ask for; it shares the norm, and with tp == 1 the
    embedding and head, whatever the flags say). `expert_parallel`: `shard_model`'s."""
    if isinstance(source, Checkpoint):
        return load_shard(source, rank, tp, reduce, layers, dtype, device, embed=embed, norm=norm, head=head,
                          expert_parallel=expert_parallel)
    return shard_model(source, rank, tp, reduce, layers, embed=embed, head=head, expert_parallel=expert_parallel)


@torch.no_grad()
def load_vocab(ckpt: Checkpoint, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """The whole embedding and output head of the checkpoint and nothing else (no decoder
    layers, no final norm): what an EAGLE head on a TP group's leader reads of its target, since
    the leader's own shard holds only its vocab slices. Its `config` is the full model's."""
    cfg = ckpt.config
    wanted = {"model.embed_tokens.weight": WHOLE}
    if not cfg.tie_word_embeddings:
        wanted["lm_head.weight"] = WHOLE
    tensors = load_tensors(ckpt.path, cfg, wanted, dtype, device)
    with torch.device("meta"):
        vocab = LlamaForCausalLM(dataclasses.replace(cfg, num_hidden_layers=0))
    vocab.config = cfg
    vocab.model.norm = None
    vocab.model.embed_tokens.load_state_dict({"weight": tensors["model.embed_tokens.weight"]}, assign=True)
    if vocab.lm_head is not None:
        vocab.lm_head.load_state_dict({"weight": tensors["lm_head.weight"]}, assign=True)
    return _finish(vocab)


class GroupModel:
    """What the engine and the leader's runner read from "the model" when no process holds it
    whole: the full config (vocab, heads, layers, so `kv_cache_shape` is the whole group's KV)
    and, for a group without TP lanes (plain SPP), the logits from the leader's shard, which
    holds the output head. A group with TP lanes (`vocab_parallel`) computes its logits itself:
    its runner's `run_plan` returns them gathered from the lanes' vocab slices."""

    backend = None

    def __init__(self, config: ModelConfig, leader_shard: LlamaForCausalLM, vocab_parallel: bool = False) -> None:
        self.config = config
        self.leader_shard = leader_shard
        self.vocab_parallel = vocab_parallel

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return LlamaForCausalLM.kv_cache_shape(self, num_blocks, block_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel:
            raise RuntimeError("a vocab-parallel group's logits come from its runner's run_plan (its lanes' head "
                               "slices, gathered): the leader holds no whole output head")
        return self.leader_shard.compute_logits(hidden)


__all__ = ["Checkpoint", "GroupModel", "RowParallelLinear", "check_tp", "expert_range", "kv_heads_of", "kv_holder", "kv_split",
           "layer_part", "load_shard", "load_vocab", "rank_model", "shard_config", "shard_layer_state", "shard_model"]
