"""Tensor parallelism (Megatron; vLLM's `tensor_parallel_size`) over a group of ranks.

Each rank runs the model's own decoder layers (raycluster.model.llama) on a shard of their
weights (raycluster.parallel.shard: q/k/v_proj, gate/up_proj split by heads / intermediate size,
o_proj and down_proj row-parallel: each rank's partial output is summed over the group by one
all_reduce, the bias added once on rank 0). So there are two all_reduces per layer. The
embedding and the output head are vocab-parallel, as vLLM's (raycluster.parallel.vocab): rank t
holds rows [t V' / tp, (t + 1) V' / tp) of each (V' the vocab padded to a multiple of tp; a tied
model's head is the same tensor), looks up the step's ids in its range and the ranks sum the
rows by one more all_reduce; every rank norms its final hidden states (each holds the final
norm) and computes the logits of its vocab slice for plan.sample_rows, and the leader gathers
the slices (one gather per step) into the full logits, padding columns dropped, which
`run_plan` returns. Given a `Checkpoint`, each rank reads just that from the files
(`load_shard`) and the leader's `model` is a `GroupModel` (the full config): no rank holds the
full decoder weights, embedding or head. Given a full model in memory, each rank cuts its shard
from it (`shard_model`) and the leader keeps it.

A rank's KV tensor [L, N, 2, B, Hkv / tp, D] holds only its KV heads, for the same engine block
ids on every rank, so the leader's block bookkeeping is the plain engine's (`KVCacheManager`, or
`PrefixCachingKVManager`: a cached block is cached on every rank at once). When tp > Hkv (tp a
multiple of Hkv), KV heads are replicated as vLLM does (raycluster.parallel.shard.kv_split): each
rank's KV is [L, N, 2, B, 1, D], the one head rank // (tp / Hkv), and the tp / Hkv ranks sharing
a head each compute and cache their own copy of it. With a hybrid cache (a model mixing sliding
and full layers: raycluster.engine.kv_groups) the tensor's first dimension is the groups' slots
and every rank lays its heads out in the same pool blocks.

Data enters as a `StepPlan` the leader (rank 0, the engine's `TPRunner`) posts down the group's
plan chain; every rank runs the same forward; what leaves is the leader's logits of
`plan.sample_rows` [n, vocab]. KV for P/D handoffs enters and leaves as whole blocks (all heads, each once:
a plain engine's layout and bytes) through the leader's `StagedPort`: `load_blocks` sends each
rank its heads of them (every replica of a replicated head its copy), `save_blocks` gathers each
head back once, from the first rank holding it (`shard.kv_holder`), into whole blocks.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.rowcopy import index_copy
from kernels import get_attention_backend
from raycluster.engine.kv_groups import KVGroups
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import StepLogits, execute_step, forward_keeping
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.llama import LlamaForCausalLM
from raycluster.parallel.group import Collective
from raycluster.parallel.head_kv import HeadKV
from raycluster.parallel.kv_port import KV_TAG, KVLoad, KVSave, StagedPort, rank_handler
from raycluster.parallel.lora_ranks import LoRAChange, RankAdapters
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.parallel.vocab import gather_logits
from raycluster.parallel.shard import (Checkpoint, GroupModel, RowParallelLinear, _identity, check_tp, kv_heads_of,
                                       kv_holder, rank_model, shard_config, shard_layer_state, shard_model)



class TPRank:
    """One rank: its sharded model, its KV heads [L, N, 2, B, Hkv / tp, D] ([.., 1, D] when KV
    heads are replicated) and its attention backend.
    `model`: the full model to cut the shard from, or the `Checkpoint` to read it from. Every
    rank holds its vocab rows of the embedding and the output head (raycluster.parallel.vocab);
    with `expert_parallel` a MoE model's rank holds its share of the experts whole."""

    def __init__(self, model: LlamaForCausalLM | Checkpoint, coll: Collective | None, rank: int, tp: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 expert_parallel: bool = False, groups: KVGroups | None = None) -> None:
        """`groups`: a hybrid cache's KV groups (raycluster.engine.kv_groups): the KV tensor holds
        their slots, and each step's metadata is per group."""
        if tp > 1 and (coll is None or coll.world != tp or coll.rank != rank):
            raise ValueError(f"tp={tp} rank {rank} needs a Collective of world {tp} at that rank")
        self.coll, self.rank, self.tp, self.block_size = coll, rank, tp, block_size
        self.device = torch.device(device)
        self.num_kv_heads = model.config.num_key_value_heads      # the whole model's
        self.vocab = model.config.vocab_size
        self.model = rank_model(model, rank, tp, coll.all_reduce if tp > 1 else _identity, None, dtype, self.device,
                                expert_parallel=expert_parallel)
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        self.groups = groups
        self.kv_cache = torch.zeros((groups.num_slots if groups else shape[0], *shape[1:]), dtype=dtype,
                                    device=self.device)
        # Its own backend: the torch backend's scratch buffers must not be shared by ranks
        # running in threads of one process.
        self.backend = get_attention_backend(self.device, torch_only=model.config.torch_attention_only)
        self.adapters = RankAdapters(model.config, dtype, self.device, lane=rank, tp=tp)     # its LoRA shards
        self.hidden = self.aux = None       # the last step's (`run`)

    def _blocks(self, n: int) -> torch.Tensor:
        kv = self.kv_cache
        return torch.empty((kv.shape[0], n) + tuple(kv.shape[2:]), dtype=kv.dtype, device=kv.device)

    def heads(self, blocks: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s KV heads of whole blocks [L, n, 2, B, Hkv, D] (a view)."""
        first, n = kv_heads_of(self.num_kv_heads, self.tp, rank)
        return blocks.narrow(4, first, n)

    def load(self, msg: KVLoad, data: torch.Tensor | None = None) -> None:
        """Write this rank's heads of blocks (the leader passes whole blocks `data`, the other
        ranks receive their heads from it)."""
        ids = torch.tensor(msg.block_ids, dtype=torch.long, device=self.device)
        if data is not None:
            part = self.heads(data, self.rank)
        else:
            part = self.coll.recv(self._blocks(len(ids)), 0, KV_TAG)
        index_copy(self.kv_cache, 1, ids, part.to(self.device))

    def save(self, msg: KVSave) -> torch.Tensor | None:
        """This rank's heads of the blocks; the non-leaders that are the first holders of their
        heads send them to the leader (a replica sends nothing and returns None)."""
        if not kv_holder(self.num_kv_heads, self.tp, self.rank):
            return None
        part = self.kv_cache.index_select(1, torch.tensor(msg.block_ids, dtype=torch.long, device=self.device))
        if self.rank != 0:
            self.coll.send(part, 0, KV_TAG).wait()
        return part

    def run(self, plan: StepPlan, aux_layers: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Every rank runs the whole step (its heads) and computes its vocab slice of the logits
        of plan.sample_rows; the leader returns the full logits [n, vocab] gathered from the
        ranks (one gather per step), the other ranks None. The final hidden states are whole on
        every rank (each layer ends in an all_reduce): `hidden` keeps them, and with
        `aux_layers` (the leader's, for an EAGLE-3 head) `aux` the residual streams entering
        those layers."""
        input_ids, positions, meta = plan_inputs(plan, self.block_size, self.device, self.groups)
        hidden, self.aux = forward_keeping(self.model, input_ids, positions, self.kv_cache, meta, self.backend,
                                           self.adapters.for_step(plan), aux_layers, plan.image_rows)
        self.hidden = hidden
        n = len(plan.sample_rows)
        if not self.model.config.has_lm_head:       # pooling only: no logits (every rank agrees)
            return None
        if self.tp == 1:
            rows = hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))
            return self.model.compute_logits(rows)
        local = None
        if n:
            rows = hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))
            local = self.model.lm_head(rows)
        w = self.model.lm_head.weight
        return gather_logits(self.coll, local, list(range(self.tp)), self.vocab, n, w.shape[0], w.dtype, w.device)


def tp_worker(model: LlamaForCausalLM | Checkpoint, coll: Collective, num_blocks: int, block_size: int,
              dtype: torch.dtype, device: str | torch.device = "cpu", expert_parallel: bool = False,
              groups: KVGroups | None = None) -> Callable:
    """What a non-leader rank runs per message the leader posts (for `serve_rank`); reads its
    shard from the `Checkpoint`, or cuts it from the full model it is given (the leader's).
    `num_blocks`: the engine's blocks of every layer; with hybrid KV `groups` the rank holds
    the leader's pool (HybridKVManager's, its null block included)."""
    if coll.rank == 0:
        raise ValueError("rank 0 is the leader: use TPRunner")
    if groups is not None:
        num_blocks = groups.pool_blocks(num_blocks) + 1
    return rank_handler(TPRank(model, coll, coll.rank, coll.world, num_blocks, block_size, dtype, device,
                               expert_parallel, groups))


class TPRunner:
    """The leader (rank 0): ModelRunner's interface over a TP group. `kv` is the engine's
    bookkeeping of block ids every rank shares; `model` is the full model, or the `Checkpoint`
    each rank reads its shard from (`self.model` is then a `GroupModel` over the leader's
    shard). `run_plan` returns the step's logits, gathered from the ranks' vocab slices
    (`returns_logits`: execute_step computes none itself).

    With an EAGLE head (`extra_kv_layers`, the head's layers), the head runs on the leader alone,
    unsharded: it reads the whole hidden states the leader keeps (`keep_hidden`, `aux_layers`,
    as ModelRunner's) and keeps its KV in `head_kv_cache`, the leader's own tensor of whole
    heads under the engine's block ids, which handoffs stage after the model's layers
    (raycluster.parallel.head_kv)."""

    runs_bidirectional_spans = True      # every lane attends the whole chunk
    returns_logits = True
    keep_hidden = False
    image_encoder = None    # as ModelRunner's: on the leader, its output posted in the plan
    image_cache = None
    last_hidden = None
    aux_layers: tuple[int, ...] = ()
    last_aux = None

    def __init__(self, model: LlamaForCausalLM | Checkpoint, kv: KVCacheManager, coll: Collective | None, tp: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ranks=None,
                 extra_kv_layers: int = 0, expert_parallel: bool = False) -> None:
        """`ranks`: the handle of ranks 1..tp-1 (`join(timeout)`), stopped by `close`."""
        self.kv, self.coll, self.tp, self.dtype, self.ranks = kv, coll, tp, dtype, ranks
        self.layout = f"tp{tp}" + ("ep" if expert_parallel and model.config.moe is not None else "")
        self.rank0 = TPRank(model, coll, 0, tp, kv.num_physical_blocks, kv.block_size, dtype, device, expert_parallel,
                            kv.groups)
        self.model = GroupModel(model.config, self.rank0.model, True) if isinstance(model, Checkpoint) else model
        self.device = self.rank0.device
        shape = self.model.kv_cache_shape(kv.num_physical_blocks, kv.block_size)
        shape = (kv.kv_slots(shape[0]), *shape[1:])
        self.head_kv = HeadKV(extra_kv_layers, shape[0], shape[1:], dtype, self.device) if extra_kv_layers else None
        self.head_kv_cache = self.head_kv.tensor if self.head_kv else None
        # Connectors see whole blocks (every head, every layer, the head's too): a staging area
        # of the leader's own KV bytes, i.e. 1/tp of the engine's blocks (1/Hkv with replicated
        # heads: the leader holds one of Hkv heads), as a KVP leader stages one rank's worth.
        staged = max(1, kv.num_physical_blocks // min(tp, model.config.num_key_value_heads))
        self.port = StagedPort(self, (shape[0] + extra_kv_layers, staged, *shape[2:]), dtype, self.device)
        self._closed = False

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of whole blocks (every layer, every KV head once), as ModelRunner
        reports it: what a handoff stages and moves. Replicated heads' extra copies on the ranks
        are not counted."""
        return self.port.tensor[:, 0].numel() * self.port.tensor.element_size() // self.kv.block_size

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Run one step across the group; returns the logits of plan.sample_rows [n, vocab]."""
        if self._closed:
            raise RuntimeError("TPRunner is closed")
        if self.tp > 1:
            self.coll.post_plan(plan)
        logits = self.rank0.run(plan, self.aux_layers)
        if self.keep_hidden:
            self.last_hidden = self.rank0.hidden
            self.last_aux = self.rank0.aux if self.aux_layers else None
        return logits

    def execute(self, out: SchedulerOutput) -> StepLogits:
        return execute_step(self, out)

    def change_lora(self, name: str, path: str | None) -> None:
        """Serve (or with path None drop) a LoRA adapter on every rank (raycluster.parallel.lora_ranks)."""
        msg = LoRAChange(name, path)
        if self.tp > 1:
            self.coll.post_plan(msg)
        self.rank0.adapters.apply(msg)

    def load_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write whole blocks [L (+ the head's layers), n, 2, B, Hkv, D] to engine block ids, each
        rank its heads of the model's layers, the leader the head's."""
        msg = KVLoad(list(block_ids))
        if self.head_kv is not None:
            data = self.head_kv.split_load(block_ids, data)
        if self.tp > 1:
            self.coll.post_plan(msg)
            for r in range(1, self.tp):
                self.coll.send(self.rank0.heads(data, r), r, KV_TAG).wait()
        self.rank0.load(msg, data)

    def save_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks [L (+ the head's layers), n, 2, B, Hkv, D] of engine block ids, each head
        gathered once, from the first rank holding it; the head's layers from the leader."""
        msg = KVSave(list(block_ids))
        if self.tp > 1:
            self.coll.post_plan(msg)
        kv = self.rank0.kv_cache
        extra = self.head_kv.layers if self.head_kv else 0
        out = torch.empty((kv.shape[0] + extra, len(block_ids), 2, kv.shape[3], self.rank0.num_kv_heads, kv.shape[5]),
                          dtype=kv.dtype, device=kv.device)
        for r in range(self.tp):
            if kv_holder(self.rank0.num_kv_heads, self.tp, r):
                part = self.rank0.save(msg) if r == 0 else self.coll.recv(self.rank0._blocks(len(block_ids)), r,
                                                                          KV_TAG)
                self.rank0.heads(out[:kv.shape[0]], r).copy_(part)
        if self.head_kv is not None:
            self.head_kv.save_into(block_ids, out)
        return out

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


# The sharding names raycluster.parallel.shard owns, still importable from here.
__all__ = ["RowParallelLinear", "TPRank", "TPRunner", "check_tp", "shard_config", "shard_layer_state",
           "shard_model", "tp_worker"]
