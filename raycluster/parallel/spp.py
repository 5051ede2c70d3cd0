"""Stream pipeline parallelism (SPP, Medha section 3.3) over a group of ranks.

Each rank is one pipeline stage (`SPPStage`) owning a contiguous range of decoder layers
(`stage_layers`) and the KV tensor of just those layers. A step's `StepPlan` reaches every rank
along the group's plan chain (the leader, rank 0, is `SPPRunner`; the others run
`serve_rank` with `spp_worker`). Every rank splits the plan the same way (`split_plan`) into
micro-batches of at most `micro_tokens` prefill tokens and streams them through the stages: the
hidden states [T_mb, H] of a micro-batch go from rank r to rank r+1 with a non-blocking send, so
stage r starts micro-batch j+1 while stage r+1 works on j. That is legal because sub-chunk j+1
of a prefill needs sub-chunk j's KV in the same stage (written earlier there, stages run
micro-batches in order), not its output. The last stage applies the final norm to the sampled
rows only and sends them [n, H] back to rank 0, which returns them from `run_plan`.

SPP x TP (Medha's TP x SPP, e.g. TP8 x SPP2; `tp` > 1): each stage is a TP group of `tp` ranks,
world rank = stage * tp + lane. A rank runs raycluster.parallel.tp's shard of its stage's layers
(its heads and MLP share), whose row-parallel all-reduces run over its stage's ranks only (a
`Collective.subgroup`); the plan chain still runs over the whole world. A stage's lanes all end
with the same hidden states, so lane t of stage s sends its micro-batch to lane t of stage s+1.
The embedding and output head are vocab-parallel (raycluster.parallel.vocab): the first
stage's lane t holds its vocab rows of the embedding (the lookups summed over the stage's
lanes), the last stage's lane t its rows of the head; every last-stage lane norms the sampled
rows and computes the logits of its vocab slice, which the leader gathers (one gather per step)
and `run_plan` returns. A rank's KV holds its stage's layers and its
lane's KV heads of the same engine block ids (with tp > Hkv, the lane's one replicated head:
raycluster.parallel.shard.kv_split), so the leader's block bookkeeping is the plain engine's;
P/D handoffs move each (layers x heads) slice to its rank (every replica its copy) and back from
it (a replicated head from the first lane holding it).

KVP x SPP (x TP), Medha's 3D parallelism (`kvp` > 1): each stage is a KVP group
(raycluster.parallel.kvp) over its layer range, each KVP rank of it a TP group when tp > 1;
world rank = (stage * kvp + k) * tp + lane. Rank (s, k, t) holds its stage's layers and lane t's
heads of the blocks the KVP layout gives KVP rank k (striped or progressive) -- the same in
every stage, so the leader's bookkeeping is plain KVP's (`kvp_layout.kvp_kv_manager`, prefix
caching too). Its attention backend
is a `KVPAttention` over ranks (s, *, t) (`kvp_group`); each micro-batch's metadata is
`kvp_meta` of it (a prefill sub-chunk attends the earlier sub-chunks as a later chunk would: their
KV was written at this stage, by its owners, in earlier micro-batches; the KVP ranks take turns
attending a sub-chunk to itself, micro-batch by micro-batch; a KVP rank holding none of a
micro-batch's KV sits it out in every stage, as in `kvp.step_ranks`). The merged attention output and the
replicated linear layers leave every (k, t) rank of a stage with the same hidden states, so
(s, k, t) sends to (s+1, k, t); (last stage, 0, 0) returns the rows (tp == 1), or the lanes
(last stage, 0, *) their logit slices (tp > 1). P/D handoffs move each
block's (stage layers x lane heads) slice to or from the ranks of the KVP rank holding it.

Weights: given a `Checkpoint` (raycluster.parallel.shard), each rank reads only its stage's
layers (its lane's heads of them with TP), the embedding if it is in the first stage, the final
norm if it returns the rows, and the output head if it is the leader (which computes the logits;
`SPPRunner.model` is then a `GroupModel`); with TP, its lane's vocab rows of the embedding
(first stage) and of the head and the final norm (last stage's KVP rank 0 lanes): no rank holds
the full decoder weights, nor with TP the full embedding or head. Given a full model in memory,
the stages use its layers (cut per lane with TP, with the lane's vocab rows) and the leader
keeps it.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.rowcopy import index_copy
from kernels import get_attention_backend
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.model_runner import StepLogits, execute_step
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.llama import LlamaForCausalLM, add_deepstack, deepstack_levels, splice_rows
from raycluster.parallel.group import Collective
from raycluster.parallel.kv_port import KV_TAG, KVLoad, KVSave, StagedPort, rank_handler
from raycluster.parallel.kvp import KVPAttention, kvp_meta, owned_positions, step_ranks
from raycluster.parallel.lora_ranks import LoRAChange, RankAdapters
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.parallel.shard import Checkpoint, GroupModel, _identity, kv_heads_of, kv_holder, rank_model
from raycluster.parallel.vocab import gather_logits

HIDDEN_TAG = 1      # stage r -> r+1 hidden states
RESULT_TAG = 2      # last stage -> rank 0 sampled rows


def stage_layers(num_layers: int, spp: int) -> list[tuple[int, int]]:
    """[lo, hi) layer range of each stage; earlier stages take the extra layers."""
    if not 1 <= spp <= num_layers:
        raise ValueError(f"spp must be in 1..{num_layers} (the number of layers), got {spp}")
    base, extra = divmod(num_layers, spp)
    out, lo = [], 0
    for s in range(spp):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def split_plan(plan: StepPlan, micro_tokens: int) -> list[StepPlan]:
    """Micro-batches of `plan`: each prefill chunk cut into sub-chunks of <= micro_tokens tokens
    (one sub-chunk per micro-batch, in token order), then all decodes as one last micro-batch.
    A cut never falls inside a bidirectional span (Gemma 3's images, whose rows attend each other
    both ways): that sub-chunk runs on to the span's end. Concatenating the micro-batches' tokens
    gives plan.input_ids, and their sampled rows (local row numbers) give plan.sample_rows in order."""
    if micro_tokens < 1:
        raise ValueError(f"micro_tokens must be >= 1, got {micro_tokens}")
    if any(b <= a for a, b in zip(plan.sample_rows, plan.sample_rows[1:])):
        # The stages return rows in token order; step_plan always sorts them.
        raise ValueError(f"sample_rows must be strictly increasing, got {plan.sample_rows}")
    ids = plan.input_ids
    out: list[StepPlan] = []
    off = 0         # row of the current prefill chunk's first token in the plan
    for start, n, table in zip(plan.prefill_starts, plan.prefill_lens, plan.prefill_tables):
        spans = [(lo - off, hi - off) for lo, hi in plan.bidirectional_rows if off <= lo < off + n]
        s = 0
        while s < n:
            e = min(s + micro_tokens, n)
            e = next((hi for lo, hi in spans if lo < e < hi), e)
            m, a = e - s, off + s
            # step_plan samples only a chunk's last row; any row is kept (the profiler samples
            # trailing rows) so the group returns exactly len(plan.sample_rows) rows.
            rows = [r - a for r in plan.sample_rows if a <= r < a + m]
            out.append(StepPlan(ids[a:a + m], [start + s], [m], [table], [], [], rows,
                                runs_within(plan.lora_runs, a, a + m),
                                image_rows=rows_within(plan.image_rows, a, a + m),
                                rope_rows=rows_within(plan.rope_rows, a, a + m),
                                bidirectional_rows=[(lo - s, hi - s) for lo, hi in spans if s <= lo < e]))
            s = e
        off += n
    if plan.decode_positions:
        rows = [r - off for r in plan.sample_rows if r >= off]
        out.append(StepPlan(ids[off:], [], [], [], list(plan.decode_positions), list(plan.decode_tables), rows,
                            runs_within(plan.lora_runs, off, len(ids)),
                            rope_rows=rows_within(plan.rope_rows, off, len(ids))))
    return out


def runs_within(runs: list[tuple[str, int, int]], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The LoRA runs of tokens [lo, hi) of a plan, as rows of a micro-batch of those tokens."""
    out = []
    for name, first, count in runs:
        a, b = max(first, lo), min(first + count, hi)
        if a < b:
            out.append((name, a - lo, b - a))
    return out


def rows_within(pieces: list[tuple[int, torch.Tensor]], lo: int, hi: int) -> list[tuple[int, torch.Tensor]]:
    """The (first row, per-row tensor) pieces of tokens [lo, hi) of a plan (image embeddings,
    M-RoPE positions), as rows of a micro-batch of those tokens."""
    out = []
    for row, e in pieces:
        a, b = max(row, lo), min(row + e.shape[0], hi)
        if a < b:
            out.append((a - lo, e[a - row:b - row]))
    return out


class SPPStage:
    """One rank of the pipeline: stage s owns layers [lo, hi) of `model` (a full model or a
    `Checkpoint`) and their KV [hi - lo, N, 2, B, Hkv / tp, D] (Hkv' = 1, a replicated head, when
    tp > Hkv). World rank = (s * kvp + k) * tp
    + t; rank 0 leads. With tp > 1 it is lane t of a TP group, running the lane's shard of those
    layers (raycluster.parallel.shard), which all-reduces over ranks (s, k, *) only
    (`self.tp_group`, a subgroup). With kvp > 1 it is KVP rank k of its stage: its N =
    `num_blocks` blocks are the engine blocks of KVP rank k (raycluster.parallel.kvp), and its
    attention backend is a `KVPAttention` gathering partial states over ranks (s, *, t)
    (`self.kvp_group`, its KVP peers in the stage). `expert_parallel`: a MoE model's lanes each
    hold their share of the experts whole."""

    def __init__(self, model, coll: Collective | None, rank: int, spp: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", micro_tokens: int = 512,
                 tp: int = 1, kvp: int = 1, expert_parallel: bool = False) -> None:
        world = spp * kvp * tp
        if world > 1 and (coll is None or coll.world != world or coll.rank != rank):
            raise ValueError(f"spp={spp} x kvp={kvp} x tp={tp} rank {rank} needs a Collective of world {world} "
                             "at that rank")
        self.coll, self.rank, self.spp, self.tp, self.kvp, self.world = coll, rank, spp, tp, kvp, world
        self.num_kv_heads = model.config.num_key_value_heads      # the whole model's
        per_stage = kvp * tp
        self.stage, within = divmod(rank, per_stage)
        self.kvp_rank, self.lane = divmod(within, tp)
        self.lo, self.hi = stage_layers(model.config.num_hidden_layers, spp)[self.stage]
        # The same (KVP rank, lane) of the neighbouring stages: every rank of a stage ends its
        # layers with the same full hidden states (the all-reduce over lanes, the merge of
        # attention states over KVP ranks), so each rank feeds its own successor.
        self.prev, self.next = rank - per_stage, rank + per_stage
        self.result_rank = (spp - 1) * per_stage   # KVP rank 0, lane 0 of the last stage returns the rows
        self.block_size, self.micro_tokens = block_size, micro_tokens
        self.blocks_per_rank = num_blocks
        self.device = torch.device(device)
        self.tp_group = self.kvp_group = None
        base = self.stage * per_stage
        # Every rank builds its lanes' subgroup, then its KVP peers' (and no other), so each
        # subgroup's members build it at about the same time.
        if tp > 1:
            lanes0 = base + self.kvp_rank * tp
            self.tp_group = coll.subgroup(range(lanes0, lanes0 + tp))
        if kvp > 1:
            self.kvp_group = coll.subgroup(range(base + self.lane, base + per_stage, tp))
        # With TP lanes, the last stage's lanes of KVP rank 0 norm the sampled rows and compute
        # the logits of their vocab slices (world ranks result_rank + t), which the leader gathers.
        self.vocab = model.config.vocab_size
        self.logit_lanes = list(range(self.result_rank, self.result_rank + tp)) if tp > 1 else []
        logits = rank in self.logit_lanes
        if tp > 1 or isinstance(model, Checkpoint):
            reduce = self.tp_group.all_reduce if tp > 1 else _identity
            self.model = rank_model(model, self.lane, tp, reduce, range(self.lo, self.hi), dtype, self.device,
                                    embed=self.first, norm=logits if tp > 1 else rank == self.result_rank,
                                    head=logits if tp > 1 else rank == 0, expert_parallel=expert_parallel)
            self.layers = list(self.model.model.layers)
        else:
            self.model = model
            self.layers = list(model.model.layers[self.lo:self.hi])
        shape = self.model.kv_cache_shape(num_blocks, block_size)
        self.kv = torch.zeros((self.hi - self.lo,) + tuple(shape[1:]), dtype=dtype, device=self.device)
        # A backend per rank: the torch backend's workspace buffers must not be shared by
        # ranks running concurrently in threads of one process (model.backend would be).
        backend = getattr(model, "backend", None)
        if kvp > 1:
            self.backend = KVPAttention(self.kvp_group)
        else:
            self.backend = backend if world == 1 and backend is not None else get_attention_backend(
                self.device, torch_only=model.config.torch_attention_only)
        self.hidden_dtype = self.layers[0].activation_dtype
        self.hidden_size = model.config.hidden_size
        self.adapters = RankAdapters(model.config, dtype, self.device, lane=self.lane, tp=tp,
                                     layers=range(self.lo, self.hi))      # its LoRA shards

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.spp - 1

    def heads(self, blocks: torch.Tensor, lane: int) -> torch.Tensor:
        """Lane `lane`'s KV heads of blocks [.., n, 2, B, Hkv, D] (all of them when tp == 1)."""
        first, n = kv_heads_of(self.num_kv_heads, self.tp, lane)
        return blocks.narrow(4, first, n)

    def owned(self, block_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """Positions in `block_ids` of the engine blocks this rank holds (all of them without
        KVP), and their local ids."""
        pos = owned_positions(block_ids, self.kvp_rank, self.blocks_per_rank)
        lo = self.kvp_rank * self.blocks_per_rank
        return pos, torch.tensor([block_ids[j] - lo for j in pos], dtype=torch.long, device=self.device)

    def load(self, msg: KVLoad, data: torch.Tensor | None = None) -> None:
        """Write this rank's layers and heads of the blocks [L, n, ...] it holds (the leader
        passes all of `data`, the other ranks receive their slice from it)."""
        pos, local = self.owned(msg.block_ids)
        if not pos:
            return
        if data is not None:
            sel = torch.tensor(pos, dtype=torch.long, device=data.device)
            chunk = self.heads(data[self.lo:self.hi].index_select(1, sel), self.lane)
        else:
            chunk = self.coll.recv(torch.empty((self.hi - self.lo, len(pos)) + tuple(self.kv.shape[2:]),
                                               dtype=self.kv.dtype, device=self.device), 0, KV_TAG)
        index_copy(self.kv, 1, local, chunk.to(self.device))

    def save(self, msg: KVSave) -> torch.Tensor | None:
        """This rank's layers and heads of the blocks it holds; the other ranks send them to the
        leader. A lane that is not the first holding its (replicated) heads sends nothing and
        returns None."""
        if not kv_holder(self.num_kv_heads, self.tp, self.lane):
            return None
        pos, local = self.owned(msg.block_ids)
        part = self.kv.index_select(1, local)
        if self.rank != 0 and pos:
            self.coll.send(part, 0, KV_TAG).wait()
        return part

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Run this rank's part of `plan`; rank 0 returns the normed rows of plan.sample_rows
        [n, H] (tp == 1) or their logits [n, vocab] gathered from the last stage's lanes
        (tp > 1), other ranks None."""
        with torch.inference_mode():
            rows = self._stream(plan)
            n = len(plan.sample_rows)
            if self.tp > 1:
                local = self.model.lm_head(rows) if rows is not None and n else None
                per = -(-self.vocab // self.tp)
                return gather_logits(self.coll, local, self.logit_lanes, self.vocab, n, per, self.hidden_dtype,
                                     self.device)
            if self.result_rank != 0 and n:      # every rank knows n from the plan: no size message
                if self.rank == self.result_rank:
                    self.coll.send(rows, 0, RESULT_TAG).wait()
                elif self.rank == 0:
                    rows = self.coll.recv(self._buf(n), self.result_rank, RESULT_TAG)
            if self.rank != 0:
                return None
            return rows if rows is not None else self._buf(0)

    def _buf(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.hidden_size, dtype=self.hidden_dtype, device=self.device)

    def _stream(self, plan: StepPlan) -> torch.Tensor | None:
        m = self.model
        # The rank returning the rows (tp == 1), or every logits lane (tp > 1); the other ranks
        # of the last stage norm nothing.
        returns = self.rank in self.logit_lanes if self.tp > 1 else self.rank == self.result_rank
        works, sent, kept = [], [], []
        for i, mb in enumerate(split_plan(plan, self.micro_tokens)):
            ranks = None
            if self.kvp > 1:
                # A KVP rank holding none of the micro-batch's KV sits it out in every stage
                # (the layout is the same in each), so no stage waits for its hidden rows.
                ranks = step_ranks(mb, self.block_size, self.blocks_per_rank, self.kvp)
                if self.kvp_rank not in ranks:
                    continue
            ids, pos, meta = plan_inputs(mb, self.block_size, self.device)
            if self.kvp > 1:
                # A prefill sub-chunk's prefix includes the earlier sub-chunks, written at this
                # stage by their owners in earlier micro-batches: a later chunk to kvp_meta. The
                # sub-chunks' causal parts take turns over the step's KVP ranks (the offset i).
                meta = kvp_meta(mb, meta.slot_mapping, self.kvp_rank, self.kvp, self.block_size,
                                self.blocks_per_rank, self.device, causal_offset=i, ranks=ranks)
            meta.prepare(self.device)
            if self.first:
                x = splice_rows(m.embed(ids), mb.image_rows)
            else:
                x = self.coll.recv(self._buf(mb.num_tokens), self.prev, HIDDEN_TAG)
            ropes = m.layer_ropes(pos, x.dtype, range(self.lo, self.lo + len(self.layers)))
            lora = self.adapters.for_step(mb)
            levels = deepstack_levels(mb.image_rows, x.shape[1])   # Qwen3-VL's, on the stages holding them
            for j, (layer, layer_kv) in enumerate(zip(self.layers, self.kv)):
                cos, sin, q_scale = ropes[j]
                x = layer(x, cos, sin, layer_kv, meta, self.backend, lora, self.lo + j, q_scale)
                if self.lo + j < levels:
                    x = add_deepstack(x, mb.image_rows, self.lo + j)
            if not self.last:
                # Don't wait: the next stage works on this micro-batch while we go on to the
                # next. Keep `x` alive until its send completes.
                works.append(self.coll.send(x, self.next, HIDDEN_TAG))
                sent.append(x)
            elif returns and mb.sample_rows:
                # RMSNorm is per row: norming only the sampled rows equals norm-then-select.
                sel = torch.tensor(mb.sample_rows, dtype=torch.long, device=x.device)
                kept.append(m.model.norm(x.index_select(0, sel)))
        for w in works:
            w.wait()
        if not returns:
            return None
        return torch.cat(kept) if kept else None


def spp_worker(model: LlamaForCausalLM | Checkpoint, coll: Collective, spp: int, num_blocks: int,
               block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu", micro_tokens: int = 512,
               tp: int = 1, kvp: int = 1, expert_parallel: bool = False) -> Callable:
    """The `run` of a non-leader rank (what `ThreadRanks`/a Ray actor gets from `make_run(coll)`);
    `num_blocks`: the blocks of one KVP rank (all of the engine's without KVP)."""
    if coll.rank == 0:
        raise ValueError("rank 0 is the leader: use SPPRunner")
    return rank_handler(SPPStage(model, coll, coll.rank, spp, num_blocks, block_size, dtype, device, micro_tokens,
                                 tp, kvp, expert_parallel))


class SPPRunner:
    """The leader's runner (rank 0): ModelRunner's interface over an SPP group, whose stages are
    each a KVP group of `kvp` ranks (kvp > 1), each of those (or each stage) a TP group of `tp`
    ranks (tp > 1). `model`: the full model, or the `Checkpoint` each rank reads its part from;
    `self.model` computes the logits with the leader's output head (the full model, or a
    `GroupModel` over the leader's stage). `kv`: the engine's block bookkeeping; with kvp > 1 it
    spans every KVP rank's blocks, in the KVP layout (`kvp_layout.kvp_kv_manager`), the same for
    every stage."""

    image_encoder = None    # as ModelRunner's: on the leader; the plan carries its output to the first stage
    image_cache = None

    def __init__(self, model: LlamaForCausalLM | Checkpoint, kv: KVCacheManager, coll: Collective | None, spp: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 micro_tokens: int = 512, ranks=None, tp: int = 1, kvp: int = 1, expert_parallel: bool = False) -> None:
        """`ranks`: the handle of ranks 1..spp*kvp*tp-1 (`join(timeout)`), stopped by `close`."""
        self.kv, self.coll, self.spp, self.tp, self.kvp, self.ranks = kv, coll, spp, tp, kvp, ranks
        # Micro-batches keep each bidirectional span whole (split_plan); KVP attention does not mask by one.
        self.runs_bidirectional_spans = kvp == 1
        self.world = spp * kvp * tp
        self.dtype = dtype
        self.device = torch.device(device)
        self.layout = (f"kvp{kvp}x" if kvp > 1 else "") + f"spp{spp}" + (f"xtp{tp}" if tp > 1 else "")
        if expert_parallel and tp > 1 and model.config.moe is not None:
            self.layout += "ep"
        if kvp > 1:     # a progressive KVP layout names its range (and so its own profile)
            self.layout += kv.allocator.layout_label(kv.block_size)
        if kv.num_physical_blocks % kvp:
            raise ValueError(f"kvp {kvp}: the engine's {kv.num_physical_blocks} blocks do not stripe evenly")
        self.blocks_per_rank = kv.num_physical_blocks // kvp
        self.stage = SPPStage(model, coll, 0, spp, self.blocks_per_rank, kv.block_size, dtype, device, micro_tokens,
                              tp, kvp, expert_parallel)
        self.model = GroupModel(model.config, self.stage.model, tp > 1) if isinstance(model, Checkpoint) else model
        self.returns_logits = tp > 1        # gathered from the last stage's lanes' vocab slices
        self.layer_ranges = stage_layers(model.config.num_hidden_layers, spp)
        # Connectors see a staging area of whole blocks (every layer, every head) of the leader's
        # own blocks: one KVP rank's (all the engine's without KVP), or 1/tp of them with TP
        # lanes (1/Hkv with replicated heads), as a TP leader stages its own KV bytes' worth.
        staged = max(1, self.blocks_per_rank // min(tp, model.config.num_key_value_heads))
        self.port = StagedPort(self, self.model.kv_cache_shape(staged, kv.block_size), dtype, self.device)
        self._closed = False

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token over all layers and KV heads, each once (the whole group's, as
        ModelRunner reports it: what a handoff stages and moves)."""
        shape = self.model.kv_cache_shape(1, self.kv.block_size)
        numel = 1
        for d in shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size() // self.kv.block_size

    def change_lora(self, name: str, path: str | None) -> None:
        """Serve (or with path None drop) a LoRA adapter on every rank (raycluster.parallel.lora_ranks)."""
        msg = LoRAChange(name, path)
        if self.world > 1:
            self.coll.post_plan(msg)
        self.stage.adapters.apply(msg)

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Run one step across the group; returns the final hidden states of plan.sample_rows
        [n, H], or with TP lanes their logits [n, vocab]."""
        if self._closed:
            raise RuntimeError("SPPRunner is closed")
        if self.world > 1:
            self.coll.post_plan(plan)
        return self.stage.run(plan)

    def execute(self, out: SchedulerOutput) -> StepLogits:
        return execute_step(self, out)

    def _shares(self, block_ids: list[int]):
        """(world rank, its layers [lo, hi), its lane, positions in `block_ids` of the blocks it
        holds) of every rank holding some of them, the leader first."""
        per_stage = self.kvp * self.tp
        for r in range(self.world):
            s, within = divmod(r, per_stage)
            k, lane = divmod(within, self.tp)
            pos = owned_positions(block_ids, k, self.blocks_per_rank)
            if pos:
                yield r, self.layer_ranges[s], lane, pos

    def load_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks [L, n, 2, B, Hkv, D] to engine block ids: each rank its layers and heads
        of the blocks its KVP rank holds."""
        msg = KVLoad(list(block_ids))
        if self.world > 1:
            self.coll.post_plan(msg)
            for r, (lo, hi), lane, pos in self._shares(msg.block_ids):
                if r:
                    sel = torch.tensor(pos, dtype=torch.long, device=data.device)
                    self.coll.send(self.stage.heads(data[lo:hi].index_select(1, sel), lane), r, KV_TAG).wait()
        self.stage.load(msg, data)

    def save_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The data [L, n, 2, B, Hkv, D] of engine block ids, collected from the ranks (each
        head once: a replicated head from the first lane holding it)."""
        msg = KVSave(list(block_ids))
        if self.world > 1:
            self.coll.post_plan(msg)
        kv = self.stage.kv
        out = torch.empty((self.model.config.num_hidden_layers, len(block_ids), 2, kv.shape[3],
                           self.stage.num_kv_heads, kv.shape[5]), dtype=kv.dtype, device=kv.device)
        for r, (lo, hi), lane, pos in self._shares(msg.block_ids):
            if not kv_holder(self.stage.num_kv_heads, self.tp, lane):
                continue
            if r == 0:
                part = self.stage.save(msg)
            else:
                part = self.coll.recv(torch.empty((hi - lo, len(pos)) + tuple(kv.shape[2:]), dtype=kv.dtype,
                                                  device=kv.device), r, KV_TAG)
            # A copy into the (layers x heads) view writes `out` in place.
            index_copy(self.stage.heads(out[lo:hi], lane), 1, pos, part)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers' serve_rank loops (once)."""
        if self._closed:
            return
        self._closed = True
        if self.world > 1:
            self.coll.post_plan(None)
            self.coll.flush()
            if self.ranks is not None:
                self.ranks.join(timeout)


__all__ = ["SPPRunner", "SPPStage", "spp_worker", "split_plan", "stage_layers"]
