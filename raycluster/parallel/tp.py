"""Tensor parallelism (Megatron; vLLM's `tensor_parallel_size`) over a group of ranks.

Each rank runs the model's own decoder layers (raycluster.model.llama) on a shard of their
weights (`shard_model`): q/k/v_proj split by heads (rank r takes a contiguous block of the query
heads and of the KV heads they read, so GQA groups stay whole), o_proj split along its input over
the same heads, gate/up_proj split and down_proj split along its input over the intermediate size.
o_proj and down_proj become `RowParallelLinear`: each rank's partial output is summed over the
group by one all_reduce, the bias added once (rank 0 holds it). So there are two all_reduces per
layer. The embedding, the norms, the rotary tables and the output head are replicated -- every
rank embeds the step's tokens itself and only the leader computes logits (no vocab-parallel
embedding or head).

A rank's KV tensor [L, N, 2, B, Hkv / tp, D] holds only its KV heads, for the same engine block
ids on every rank, so the leader's block bookkeeping is the plain engine's (`KVCacheManager`, or
`PrefixCachingKVManager`: a cached block is cached on every rank at once).

Data enters as a `StepPlan` the leader (rank 0, the engine's `TPRunner`) posts down the group's
plan chain; every rank runs the same forward; what leaves is the leader's final hidden rows of
`plan.sample_rows`. KV for P/D handoffs enters and leaves as whole blocks (all heads) through the
leader's `StagedPort`: `load_blocks` sends each rank its heads of them, `save_blocks` gathers
the ranks' heads back into whole blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import get_attention_backend
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import StepLogits, execute_step
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.config import ModelConfig
from raycluster.model.llama import DecoderLayer, LlamaForCausalLM
from raycluster.parallel.group import Collective
from raycluster.parallel.kv_port import KV_TAG, KVLoad, KVSave, StagedPort, rank_handler
from raycluster.parallel.plan import StepPlan, plan_inputs

# Decoder-layer parameters split over the ranks, and along which dim (nn.Linear weights are
# [out, in]: column-parallel layers split dim 0 and their bias, row-parallel ones dim 1).
_SPLIT = {f"self_attn.{p}_proj.{w}": 0 for p in "qkv" for w in ("weight", "bias")}
_SPLIT.update({f"mlp.{p}_proj.{w}": 0 for p in ("gate", "up") for w in ("weight", "bias")})
_SPLIT.update({"self_attn.o_proj.weight": 1, "mlp.down_proj.weight": 1})
_ROW_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")     # whole, on rank 0 only


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a model whose heads or MLP do not split evenly over `tp` ranks (KV heads are not
    replicated to make them fit)."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % tp:
            raise ValueError(f"tp: {tp} ranks do not divide the model's {name} ({n}); choose a tp that "
                             "divides the attention heads, the KV heads and the intermediate size")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's layers are built from: its heads and its share of the MLP."""
    check_tp(cfg, tp)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=cfg.num_key_value_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def shard_layer_state(state: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of one decoder layer's state dict (names relative to the layer):
    split ones are copied out (contiguous, so the full weights may be freed), norms are shared,
    row-parallel biases are kept by rank 0 only."""
    out = {}
    for name, t in state.items():
        if name in _SPLIT:
            out[name] = t.chunk(tp, _SPLIT[name])[rank].clone(memory_format=torch.contiguous_format)
        elif name not in _ROW_BIASES:
            out[name] = t
        elif rank == 0:
            out[name] = t
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
        return self.reduce(F.linear(x, self.weight, self.bias))


def _shard_layer(cfg: ModelConfig, full_cfg: ModelConfig, rank: int, reduce: Callable) -> DecoderLayer:
    """An empty (meta) decoder layer of the shard config with its o_proj / down_proj row-parallel."""
    layer = DecoderLayer(cfg)
    attn, mlp = layer.self_attn, layer.mlp
    attn.o_proj = RowParallelLinear(attn.num_heads * attn.head_dim, cfg.hidden_size,
                                    full_cfg.o_bias and rank == 0, reduce)
    mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, full_cfg.mlp_bias and rank == 0,
                                      reduce)
    return layer


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, tp: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] = _identity,
                layers: range | None = None) -> LlamaForCausalLM:
    """Rank `rank`'s model of a `tp`-way group, from a loaded full model: its own sharded
    decoder layers, and the full model's embedding, final norm and output head (shared modules,
    not copies). Its config has the rank's head counts, so `kv_cache_shape` is the rank's KV.
    `reduce` sums a row-parallel layer's output over the group (identity: one rank's partial
    sums, for tests). `layers`: only these decoder layers of the full model (an SPP stage's
    range; default all); the shard's config then counts just them, as does its KV shape."""
    full_cfg = model.config
    layers = range(full_cfg.num_hidden_layers) if layers is None else layers
    if not (layers and 0 <= layers[0] and layers[-1] < full_cfg.num_hidden_layers and layers.step == 1):
        raise ValueError(f"layers {layers} is not a contiguous range of the model's {full_cfg.num_hidden_layers}")
    cfg = dataclasses.replace(shard_config(full_cfg, tp), num_hidden_layers=len(layers))
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp {tp}")
    with torch.device("meta"):
        sharded = LlamaForCausalLM(cfg)
        shards = [_shard_layer(cfg, full_cfg, rank, reduce) for _ in layers]
    state = model.state_dict()
    for i, layer in zip(layers, shards):
        prefix = f"model.layers.{i}."
        mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        layer.load_state_dict(shard_layer_state(mine, rank, tp), strict=True, assign=True)
    sharded.model.layers = nn.ModuleList(shards)
    sharded.model.embed_tokens = model.model.embed_tokens
    sharded.model.norm = model.model.norm
    sharded.lm_head = model.lm_head
    sharded.eval()
    sharded.requires_grad_(False)
    return sharded


class TPRank:
    """One rank: its sharded model, its KV heads [L, N, 2, B, Hkv / tp, D] and its attention backend."""

    def __init__(self, model: LlamaForCausalLM, coll: Collective | None, rank: int, tp: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        if tp > 1 and (coll is None or coll.world != tp or coll.rank != rank):
            raise ValueError(f"tp={tp} rank {rank} needs a Collective of world {tp} at that rank")
        self.coll, self.rank, self.tp, self.block_size = coll, rank, tp, block_size
        self.device = torch.device(device)
        self.model = shard_model(model, rank, tp, coll.all_reduce if tp > 1 else _identity)
        self.kv_cache = torch.zeros(self.model.kv_cache_shape(num_blocks, block_size), dtype=dtype,
                                    device=self.device)
        # Its own backend: the torch backend's scratch buffers must not be shared by ranks
        # running in threads of one process.
        self.backend = get_attention_backend(self.device)

    def _blocks(self, n: int) -> torch.Tensor:
        kv = self.kv_cache
        return torch.empty((kv.shape[0], n) + tuple(kv.shape[2:]), dtype=kv.dtype, device=kv.device)

    def heads(self, blocks: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s KV heads of whole blocks [L, n, 2, B, Hkv, D]."""
        hk = self.kv_cache.shape[4]
        return blocks.narrow(4, rank * hk, hk)

    def load(self, msg: KVLoad, data: torch.Tensor | None = None) -> None:
        """Write this rank's heads of blocks (the leader passes whole blocks `data`, the other
        ranks receive their heads from it)."""
        ids = torch.tensor(msg.block_ids, dtype=torch.long, device=self.device)
        if data is not None:
            part = self.heads(data, self.rank)
        else:
            part = self.coll.recv(self._blocks(len(ids)), 0, KV_TAG)
        self.kv_cache.index_copy_(1, ids, part.to(self.device))

    def save(self, msg: KVSave) -> torch.Tensor:
        """This rank's heads of the blocks; the non-leaders send them to the leader."""
        part = self.kv_cache.index_select(1, torch.tensor(msg.block_ids, dtype=torch.long, device=self.device))
        if self.rank != 0:
            self.coll.send(part, 0, KV_TAG).wait()
        return part

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Every rank runs the whole step (its heads); returns the final hidden rows of
        plan.sample_rows [n, H] (the same on every rank)."""
        input_ids, positions, meta = plan_inputs(plan, self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, backend=self.backend)
        return hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))


def tp_worker(model: LlamaForCausalLM, coll: Collective, num_blocks: int, block_size: int, dtype: torch.dtype,
              device: str | torch.device = "cpu") -> Callable:
    """What a non-leader rank runs per message the leader posts (for `serve_rank`); shards the
    full `model` it is given (the leader's, for thread ranks; its own load, for Ray actors)."""
    if coll.rank == 0:
        raise ValueError("rank 0 is the leader: use TPRunner")
    return rank_handler(TPRank(model, coll, coll.rank, coll.world, num_blocks, block_size, dtype, device))


class TPRunner:
    """The leader (rank 0): ModelRunner's interface over a TP group. `kv` is the engine's
    bookkeeping of block ids every rank shares; `model` is the full model (the leader's output
    head computes the logits)."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCacheManager, coll: Collective | None, tp: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ranks=None) -> None:
        """`ranks`: the handle of ranks 1..tp-1 (`join(timeout)`), stopped by `close`."""
        self.model, self.kv, self.coll, self.tp, self.dtype, self.ranks = model, kv, coll, tp, dtype, ranks
        self.layout = f"tp{tp}"
        self.rank0 = TPRank(model, coll, 0, tp, kv.num_blocks, kv.block_size, dtype, device)
        self.device = self.rank0.device
        # Connectors see whole blocks (every head, every layer): a staging area of the leader's
        # own KV bytes, i.e. 1/tp of the engine's blocks, as a KVP leader stages one rank's worth.
        staged = max(1, kv.num_blocks // tp)
        self.port = StagedPort(self, model.kv_cache_shape(staged, kv.block_size), dtype, self.device)
        self._closed = False

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token over all ranks (every head), as ModelRunner reports it."""
        return self.rank0.kv_cache[:, 0].numel() * self.rank0.kv_cache.element_size() * self.tp // self.kv.block_size

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Run one step across the group; returns the final hidden states of plan.sample_rows [n, H]."""
        if self._closed:
            raise RuntimeError("TPRunner is closed")
        if self.tp > 1:
            self.coll.post_plan(plan)
        return self.rank0.run(plan)

    def execute(self, out: SchedulerOutput) -> StepLogits:
        return execute_step(self, out)

    def load_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write whole blocks [L, n, 2, B, Hkv, D] to engine block ids, each rank its heads."""
        msg = KVLoad(list(block_ids))
        if self.tp > 1:
            self.coll.post_plan(msg)
            for r in range(1, self.tp):
                self.coll.send(self.rank0.heads(data, r), r, KV_TAG).wait()
        self.rank0.load(msg, data)

    def save_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks [L, n, 2, B, Hkv, D] of engine block ids, their heads gathered from the ranks."""
        msg = KVSave(list(block_ids))
        if self.tp > 1:
            self.coll.post_plan(msg)
        parts = [self.rank0.save(msg)]
        parts += [self.coll.recv(self.rank0._blocks(len(block_ids)), r, KV_TAG) for r in range(1, self.tp)]
        return torch.cat(parts, dim=4)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks' serve_rank loops (once)."""
        if self._closed:
            return
        self._closed = True
        if self.tp > 1:
            self.coll.post_plan(None)
            self.coll.flush()
            if self.ranks is not None:
                self.ranks.join(timeout)


__all__ = ["RowParallelLinear", "TPRank", "TPRunner", "check_tp", "shard_config", "shard_layer_state",
           "shard_model", "tp_worker"]
