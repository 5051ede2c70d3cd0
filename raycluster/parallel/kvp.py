"""KV-cache parallelism (Medha KVP): one request's KV spread over the ranks of a group.

Every rank holds the full weights and a KV pool of `blocks_per_rank` blocks. Global block id
g lives on rank g // blocks_per_rank at local block g % blocks_per_rank. Where a request's
blocks go is the layout's (raycluster.parallel.kvp_layout, `EngineConfig.kvp_layout`):
striped (the default: logical block i on rank i % world, so each rank holds about 1/world of
every request's KV and reads only that share in a step), or Medha's progressive scaling
(contiguous ranges of `kvp_tokens_per_rank` tokens per rank, from the least loaded rank on: a
short request lives on one rank, a long one onboards the next rank as its context grows past
each range). Nothing below the allocator depends on the layout: each rank finds its share of a
request in the block table (`local_share`). With prefix caching the per-rank pools are LRUs
that keep freed blocks findable; a prompt that starts with a cached prefix prefills the rest
exactly as a later chunk of it (the ranks attend the cached blocks they hold).

A step (`KVPRank.run(plan)`): every rank runs the linear layers on all of the step's tokens
(same inputs, same weights: same results). Per layer, each rank writes the new K/V it owns and
computes a partial attention state (output, base-2 LSE) of every query over its own tokens --
for a prefill chunk, over the earlier tokens it holds, plus, on one rank chosen per request, the
chunk itself under the causal mask; for a decode token, over its tokens up to and including the
new one (a rank holding none of a request's tokens, as with a short progressive one, gives an
empty state, which the merge weighs zero). One `all_gather` per layer brings every rank all states, and each merges them by
online softmax in rank order, so all ranks continue with the same attention output.

A step runs only on the ranks it needs (`step_ranks`): rank 0, which samples, and the ranks
holding a block the step reads or writes. Every rank derives that list from the plan; the others
relay the plan and sit the step out, the gather runs over the list, and a prefill chunk attends
itself on one of them. Under the progressive layout a batch of short requests on rank 0 thus
runs on the leader alone, with nothing posted to the group (the cost of one process's step); a
striped request of more than one block still spans every rank.

KVP x TP (`tp` > 1; Medha's KVP with TP): each KVP rank is a TP group of `tp` lanes, world rank
= k * tp + t (k the KVP rank, t the lane), as SPP x TP numbers stage lanes. Lane t of KVP rank k
holds rank k's blocks (the same layout) but only lane t's KV heads (with tp > Hkv the one
head t // (tp / Hkv), replicated over the lanes sharing it: raycluster.parallel.shard.kv_split), and runs
raycluster.parallel.tp's shard of the layers, whose row-parallel all-reduces run over the lanes
of rank k (a `Collective.subgroup`). The per-layer all_gather of attention states runs over the
KVP peers of its lane (ranks k' * tp + t: the same heads), merged in KVP rank order as above.
The embedding is vocab-parallel (raycluster.parallel.vocab: lane t's vocab rows, the lookups
summed over rank k's lanes), and so is the output head, held by KVP rank 0's lanes only: they
compute the logits of their vocab slices of the sampled rows, which the leader gathers (one
gather per step; `KVPRunner.run_plan` returns the logits). `kvp_rank` builds either kind of
rank; the leader's block bookkeeping is plain KVP's.

Data enters as a `StepPlan` (global block tables) posted by the leader (world rank 0, the
engine's `KVPRunner`); what leaves is the leader's final hidden rows of `plan.sample_rows`
(with TP lanes, their logits). KV
for P/D handoffs enters and leaves as whole blocks (all layers, all heads) through the leader's
`StagedPort`: `load_blocks` sends each block's heads to the lanes of the KVP rank holding it
(every replica of a replicated head its copy), `save_blocks` gathers each head back once, from
the first lane holding it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kernels.rowcopy import index_copy
from kernels.metadata import AttentionMetadata
from kernels.torch_backend import (LOG2E, Workspace, _attend, _gather_rows, merge_states, paged_decode_attention,
                                   with_sinks, write_kv)
from raycluster.engine.model_runner import execute_step, forward_keeping
from raycluster.parallel.group import Collective
from raycluster.parallel.head_kv import HeadKV
from raycluster.parallel.kv_port import KV_TAG, KVLoad, KVSave, StagedPort, rank_handler
from raycluster.parallel.kvp_layout import kvp_kv_manager
from raycluster.parallel.lora_ranks import LoRAChange, RankAdapters
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.parallel.shard import Checkpoint, GroupModel, kv_heads_of, kv_holder, rank_model
from raycluster.parallel.vocab import gather_logits


def local_share(table: list[int], length: int, rank: int, block_size: int,
                blocks_per_rank: int) -> tuple[list[int], int]:
    """The local block ids and token count of the first `length` tokens of a request that
    `rank` holds: the blocks of its table that live on `rank` (only the request's last block
    may be partial). Order does not matter: these tokens are attended without a mask."""
    nb = -(-length // block_size)
    lo = rank * blocks_per_rank
    hi = lo + blocks_per_rank
    mine = [b - lo for b in table[:nb] if lo <= b < hi]
    n = len(mine) * block_size
    if mine and lo <= table[nb - 1] < hi:
        n -= nb * block_size - length
    return mine, n


@dataclass
class _PrefillPart:
    q0: int                         # first row of the chunk in the step
    n: int
    prefix_rows: torch.Tensor       # K block rows then V block rows of kv_layer.view(N * 2, -1)
    prefix_blocks: int
    prefix_len: int                 # earlier tokens this rank holds
    causal_here: bool               # this rank attends the chunk to itself


@dataclass
class KVPMeta:
    """One rank's view of a step, built once and read by every layer."""
    write_idx: torch.Tensor         # step rows whose new K/V this rank stores
    write_rows: torch.Tensor        # their rows in kv_layer viewed as [N * 2 * B, Hkv * D]
    prefills: list[_PrefillPart]
    num_prefill_tokens: int
    decode_idx: torch.Tensor | None  # decode rows (within the decodes) with tokens on this rank
    decode_meta: AttentionMetadata | None
    ranks: list[int] | None = None  # the KVP ranks in this step (None: all), whose states are merged
    cache: dict = field(default_factory=dict)

    def prepare(self, device=None) -> dict:   # the model calls this on any metadata
        return self.cache

    def layer(self, index: int, kv_cache: torch.Tensor) -> tuple[torch.Tensor, "KVPMeta"]:
        return kv_cache[index], self


def step_ranks(plan: StepPlan, block_size: int, blocks_per_rank: int, world: int) -> list[int]:
    """The KVP ranks a step needs, ascending: rank 0 (which samples) and every rank holding a
    block the step reads or writes (each request's table up to the last token it computes).
    Every rank derives the same list from the plan, so none has to be told."""
    if world == 1:
        return [0]
    need = {0}
    for start, n, table in zip(plan.prefill_starts, plan.prefill_lens, plan.prefill_tables):
        need.update(b // blocks_per_rank for b in table[:-(-(start + n) // block_size)])
    for pos, table in zip(plan.decode_positions, plan.decode_tables):
        if len(need) == world:
            break
        need.update(b // blocks_per_rank for b in table[:pos // block_size + 1])
    return sorted(need)


def kvp_meta(plan: StepPlan, slot_mapping: torch.Tensor, rank: int, world: int, block_size: int,
             blocks_per_rank: int, device, causal_offset: int = 0, ranks: list[int] | None = None) -> KVPMeta:
    """Rank `rank`'s view of `plan`, run by the KVP ranks `ranks` (default all; `step_ranks`).
    Prefill j's chunk attends itself on ranks[(j + causal_offset) % len(ranks)] (any rank can:
    every rank has the chunk's K/V); an SPP stage passes the micro-batch index, as each of its
    micro-batches holds one chunk."""
    turn = list(range(world)) if ranks is None else ranks
    bs, nloc = block_size, blocks_per_rank
    blocks = torch.div(slot_mapping, bs, rounding_mode="floor")
    owned = torch.div(blocks, nloc, rounding_mode="floor") == rank
    write_idx = owned.nonzero().flatten()
    write_rows = (blocks[write_idx] - rank * nloc) * (2 * bs) + slot_mapping[write_idx] % bs
    parts, q0 = [], 0
    for j, (start, n, table) in enumerate(zip(plan.prefill_starts, plan.prefill_lens, plan.prefill_tables)):
        mine, m = local_share(table, start, rank, bs, nloc) if start else ([], 0)
        ids = torch.tensor(mine, dtype=torch.long)
        parts.append(_PrefillPart(q0, n, torch.cat([ids * 2, ids * 2 + 1]).to(device), len(mine), m,
                                  causal_here=turn[(j + causal_offset) % len(turn)] == rank))
        q0 += n
    sel, lens, tables = [], [], []
    for i, (pos, table) in enumerate(zip(plan.decode_positions, plan.decode_tables)):
        mine, m = local_share(table, pos + 1, rank, bs, nloc)
        if m:
            sel.append(i)
            lens.append(m)
            tables.append(mine)
    dmeta = None
    if sel:
        dmeta = AttentionMetadata(num_prefill_tokens=0, num_decode_tokens=len(sel), prefill_query_lens=[],
                                  prefill_kv_lens=[], prefill_block_tables=[], decode_kv_lens=lens,
                                  decode_block_tables=tables, slot_mapping=torch.zeros(len(sel), dtype=torch.long),
                                  block_size=bs)
        dmeta.prepare(device)
    return KVPMeta(write_idx.to(device), write_rows.to(device), parts, q0,
                   torch.tensor(sel, dtype=torch.long, device=device) if sel else None, dmeta, ranks)


class KVPAttention:
    """The attention backend of one KVP rank: partial states over its shard, merged across ranks."""

    name = "kvp"

    def __init__(self, coll: Collective | None) -> None:
        self.coll = coll
        self.workspace = Workspace()

    def forward(self, layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: KVPMeta, scale: float, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """`sinks` (gpt-oss's per-head sink logits) scale the merged state by its LSE (`with_sinks`)."""
        # The factory refuses kvp > 1 for sliding-window, chunked-attention and soft-capped models.
        if window is not None or chunk is not None:
            raise ValueError(f"window: {window}, chunk: {chunk}: KV-parallel attention takes no sliding window or "
                             "attention chunk")
        if softcap is not None:
            raise ValueError(f"softcap: {softcap}: KV-parallel attention caps no scores")
        if meta.write_idx.numel():
            write_kv(layer_kv, k.index_select(0, meta.write_idx), v.index_select(0, meta.write_idx), None,
                     slot_row=meta.write_rows)
        t, hq, d = q.shape
        bs, hkv = layer_kv.shape[2], layer_kv.shape[3]
        # [T, Hq * D + Hq]: output then base-2 LSE, so one all_gather carries both.
        state = torch.zeros((t, hq * d + hq), dtype=torch.float32, device=q.device)
        out, lse = state[:, :hq * d].view(t, hq, d), state[:, hq * d:]
        lse.fill_(float("-inf"))
        for p in meta.prefills:
            qs = q[p.q0:p.q0 + p.n]
            o = l_ = None
            if p.causal_here:
                o, l_ = _attend(qs, k[p.q0:p.q0 + p.n].to(layer_kv.dtype), v[p.q0:p.q0 + p.n].to(layer_kv.dtype),
                                True, scale)
            if p.prefix_len:
                kv = _gather_rows(layer_kv, p.prefix_rows, "prefix", self.workspace)
                nb = p.prefix_blocks
                kp = kv[:nb].view(nb * bs, hkv, d)[:p.prefix_len]
                vp = kv[nb:].view(nb * bs, hkv, d)[:p.prefix_len]
                op, lp = _attend(qs.to(kp.dtype), kp, vp, False, scale)
                o, l_ = (op, lp) if o is None else _merge_natural(o, l_, op, lp)
            if o is not None:
                out[p.q0:p.q0 + p.n] = o.float()
                lse[p.q0:p.q0 + p.n] = l_ * LOG2E
        if meta.decode_meta is not None:
            rows = meta.decode_idx + meta.num_prefill_tokens
            od, ld = paged_decode_attention(q.index_select(0, rows), layer_kv, meta.decode_meta, scale,
                                            return_lse=True, workspace=self.workspace)
            index_copy(out, 0, rows, od.float())
            index_copy(lse, 0, rows, ld)
        if self.coll is None or (meta.ranks is not None and len(meta.ranks) == 1):
            merged, merged_lse = out, lse
        else:
            states = self.coll.all_gather(state, meta.ranks).transpose(0, 1)   # [T, ranks, Hq * D + Hq]
            merged, merged_lse = merge_states(states[..., :hq * d].reshape(t, -1, hq, d), states[..., hq * d:])
        return (merged if sinks is None else with_sinks(merged, merged_lse, sinks)).to(q.dtype)


def _merge_natural(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    s = w1 + w2
    return (o1.float() * (w1 / s)[..., None] + o2.float() * (w2 / s)[..., None]), torch.log(s) + m


class KVPRank:
    """One rank: its KV shard [L, blocks_per_rank, 2, B, Hkv', D] and the step loop. `rank` / `world`
    are its KVP rank and the KVP width; `coll` the group its attention states are gathered over
    (its KVP peers); `link` the group whose rank 0 is the leader, over which block data of P/D
    handoffs moves (default `coll`); `lane`: which Hkv' of a whole block's KV heads it holds
    (a KVP x TP lane of `tp` holds Hkv / tp of them, or one replicated head when tp > Hkv:
    `shard.kv_heads_of`; plain KVP all, lane 0); `num_kv_heads`: the whole model's Hkv (default
    the model's, which is the whole one for plain KVP)."""

    def __init__(self, model, coll: Collective | None, rank: int, world: int, blocks_per_rank: int,
                 block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 link: Collective | None = None, lane: int = 0, tp: int = 1,
                 num_kv_heads: int | None = None, full_config=None) -> None:
        self.model, self.rank, self.world, self.lane, self.tp = model, rank, world, lane, tp
        self.num_kv_heads = model.config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.blocks_per_rank, self.block_size = blocks_per_rank, block_size
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(model.kv_cache_shape(blocks_per_rank, block_size), dtype=dtype,
                                    device=self.device)
        self.coll = coll
        self.link = coll if link is None else link
        self.backend = KVPAttention(coll if world > 1 else None)
        # KVP x TP: the lanes of KVP rank 0 (world ranks 0..tp-1) hold the vocab-parallel head
        # and compute the logits; the leader gathers them over `link` (`kvp_rank` sets the
        # whole model's vocab size).
        self.vocab: int | None = None
        # Its LoRA shards (`full_config`: the whole model's, when `model` is a lane's shard).
        self.adapters = RankAdapters(full_config or model.config, dtype, self.device, lane=lane, tp=tp)
        self.hidden = self.aux = None       # the last step's (`run`)

    def owned(self, block_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """Positions in `block_ids` of the blocks on this rank, and their local ids."""
        pos = owned_positions(block_ids, self.rank, self.blocks_per_rank)
        lo = self.rank * self.blocks_per_rank
        return pos, torch.tensor([block_ids[j] - lo for j in pos], dtype=torch.long, device=self.device)

    def heads(self, blocks: torch.Tensor, lane: int) -> torch.Tensor:
        """Lane `lane`'s KV heads of whole blocks [L, n, 2, B, Hkv, D] (all of them for plain KVP)."""
        first, n = kv_heads_of(self.num_kv_heads, self.tp, lane)
        return blocks.narrow(4, first, n)

    def _blocks(self, n: int) -> torch.Tensor:
        kv = self.kv_cache
        return torch.empty((kv.shape[0], n) + tuple(kv.shape[2:]), dtype=kv.dtype, device=kv.device)

    def load(self, msg: KVLoad, data: torch.Tensor | None = None) -> None:
        """Write this rank's share of blocks [L, n, ...] (the leader passes whole blocks `data`,
        the others receive their share from it)."""
        pos, local = self.owned(msg.block_ids)
        if not pos:
            return
        if data is not None:
            chunk = self.heads(data.index_select(1, torch.tensor(pos, dtype=torch.long, device=data.device)),
                               self.lane)
        else:
            chunk = self.link.recv(self._blocks(len(pos)), 0, KV_TAG)
        index_copy(self.kv_cache, 1, local, chunk.to(self.kv_cache.device))

    def save(self, msg: KVSave) -> torch.Tensor | None:
        """This rank's share of the blocks; the non-leaders send it to the leader. A lane that
        is not the first holding its (replicated) heads sends nothing and returns None."""
        if not kv_holder(self.num_kv_heads, self.tp, self.lane):
            return None
        pos, local = self.owned(msg.block_ids)
        part = self.kv_cache.index_select(1, local)
        if self.link.rank != 0 and pos:
            self.link.send(part, 0, KV_TAG).wait()
        return part

    def run(self, plan: StepPlan, ranks: list[int] | None = None,
            aux_layers: tuple[int, ...] = ()) -> torch.Tensor | None:
        """The final hidden rows of plan.sample_rows [n, H] (plain KVP); with TP lanes, the
        leader's full logits [n, vocab], gathered from KVP rank 0's lanes (None elsewhere).
        `ranks`: the plan's `step_ranks` if already known. A rank holding none of the step's KV
        sits it out (returns None): its attention state would be empty. Every rank that runs
        computes every row's whole hidden state (the linear layers run on all the step's tokens):
        `hidden` keeps them, and with `aux_layers` (the leader's, for an EAGLE-3 head) `aux` the
        residual streams entering those layers."""
        if ranks is None:
            ranks = step_ranks(plan, self.block_size, self.blocks_per_rank, self.world)
        if self.rank not in ranks:
            return None
        input_ids, positions, gmeta = plan_inputs(plan, self.block_size, self.device)
        meta = kvp_meta(plan, gmeta.slot_mapping, self.rank, self.world, self.block_size,
                        self.blocks_per_rank, self.device, ranks=ranks)
        hidden, self.aux = forward_keeping(self.model, input_ids, positions, self.kv_cache, meta, self.backend,
                                           self.adapters.for_step(plan), aux_layers, plan.image_rows)
        self.hidden = hidden
        rows = hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))
        if self.tp == 1 or not self.model.config.has_lm_head:      # the latter: pooling only, no logits
            return rows
        if self.rank != 0:          # only KVP rank 0's lanes hold the head
            return None
        w = self.model.lm_head.weight
        local = self.model.lm_head(rows) if len(plan.sample_rows) else None
        return gather_logits(self.link, local, list(range(self.tp)), self.vocab, len(plan.sample_rows), w.shape[0],
                             w.dtype, w.device)


def owned_positions(block_ids: list[int], kvp_rank: int, blocks_per_rank: int) -> list[int]:
    """Positions in `block_ids` of the blocks KVP rank `kvp_rank` holds."""
    lo = kvp_rank * blocks_per_rank
    return [j for j, g in enumerate(block_ids) if lo <= g < lo + blocks_per_rank]


def kvp_rank(model, coll: Collective | None, world_rank: int, kvp: int, tp: int, blocks_per_rank: int, block_size: int,
             dtype: torch.dtype, device: str | torch.device = "cpu", expert_parallel: bool = False) -> KVPRank:
    """World rank `world_rank` of a KVP group of `kvp` ranks, each a TP group of `tp` lanes
    (world rank k * tp + t). With tp == 1 a plain KVP rank over `coll`. Otherwise it builds its
    two subgroups -- its KVP rank's lanes (row-parallel all-reduces of `shard.rank_model`'s shard
    of `model`), then its lane's KVP peers (the attention all_gather) -- every rank in that
    order, so each subgroup's members build it at about the same time (`expert_parallel`: shard's)."""
    if tp == 1:
        return KVPRank(model, coll, world_rank, kvp, blocks_per_rank, block_size, dtype, device)
    if coll is None or coll.world != kvp * tp or coll.rank != world_rank:
        raise ValueError(f"kvp={kvp} x tp={tp} rank {world_rank} needs a Collective of world {kvp * tp} at that rank")
    k, t = divmod(world_rank, tp)
    lanes = coll.subgroup(range(k * tp, (k + 1) * tp))
    peers = coll.subgroup(range(t, kvp * tp, tp))
    # Cut from a full model, or read from the checkpoint: every lane its vocab rows of the
    # embedding (summed over `lanes`), KVP rank 0's lanes their rows of the output head.
    shard = rank_model(model, t, tp, lanes.all_reduce, None, dtype, device, head=k == 0, expert_parallel=expert_parallel)
    rank = KVPRank(shard, peers, k, kvp, blocks_per_rank, block_size, dtype, device, link=coll, lane=t, tp=tp,
                   num_kv_heads=model.config.num_key_value_heads, full_config=model.config)
    rank.vocab = model.config.vocab_size
    return rank


def kvp_worker(model, coll: Collective, blocks_per_rank: int, block_size: int, dtype: torch.dtype,
               device: str = "cpu", tp: int = 1, expert_parallel: bool = False) -> Callable:
    """What a non-leader rank runs per message the leader posts (for `serve_rank`); `tp` > 1: a
    lane of a KVP x TP group (it shards the full `model` it is given)."""
    if coll.rank == 0:
        raise ValueError("rank 0 is the leader: use KVPRunner")
    return rank_handler(kvp_rank(model, coll, coll.rank, coll.world // tp, tp, blocks_per_rank, block_size, dtype,
                                 device, expert_parallel))


class KVPRunner:
    """The leader (world rank 0): the engine's runner over a KVP group of `world` ranks, each a
    TP group of `tp` lanes when tp > 1 (`kvp_rank`). `kv` spans every KVP rank's blocks (striped,
    or progressive with `tokens_per_rank` tokens of a request per rank: `kvp_layout`, with
    prefix caching their caching allocators; `start`: where a progressive request starts,
    `kvp_layout`); `run_plan` posts the plan and runs rank 0's share.

    With an EAGLE head (`extra_kv_layers`, the head's layers) the head runs on the leader, as on a
    TP leader: over the whole hidden states it keeps (`keep_hidden`, `aux_layers`), its KV in
    `head_kv_cache`, a tensor of the leader's own under the group's global block ids
    (raycluster.parallel.head_kv), staged after the model's layers in handoffs."""

    runs_bidirectional_spans = False    # each rank attends its own share of the chunk causally
    keep_hidden = False
    last_hidden = None
    aux_layers: tuple[int, ...] = ()
    last_aux = None
    image_encoder = None    # as ModelRunner's: on the leader, its output posted in the plan
    image_cache = None

    def __init__(self, model, coll: Collective | None, world: int, blocks_per_rank: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", ranks=None,
                 prefix_caching: bool = False, tp: int = 1, tokens_per_rank: int | None = None,
                 start: str = "first_fit", extra_kv_layers: int = 0, expert_parallel: bool = False) -> None:
        """`ranks`: the handle of world ranks 1..world*tp-1 (`join(timeout)`), stopped by `close`."""
        self.coll, self.dtype, self.ranks = coll, dtype, ranks
        self.kvp, self.tp = world, tp
        self.kv = kvp_kv_manager(blocks_per_rank, world, block_size, prefix_caching, tokens_per_rank, start)
        # The layout names the profile a group is timed under: a progressive one its range too.
        ep = expert_parallel and tp > 1 and model.config.moe is not None
        self.layout = ((f"kvp{world}" if tp == 1 else f"kvp{world}xtp{tp}") + ("ep" if ep else "")
                       + self.kv.allocator.layout_label(block_size))
        self.rank0 = kvp_rank(model, coll, 0, world, tp, blocks_per_rank, block_size, dtype, device, expert_parallel)
        # The logits: plain KVP's from the full model's head; KVP x TP's from run_plan.
        self.model = (GroupModel(model.config, self.rank0.model, tp > 1) if isinstance(model, Checkpoint)
                      else model)
        self.returns_logits = tp > 1        # run_plan gathers them from KVP rank 0's lanes
        self.device = self.rank0.device
        # Connectors see a staging area of whole blocks (every layer, every head) of the leader's
        # own KV bytes: one KVP rank's blocks, or 1/tp of them with TP lanes (1/Hkv with
        # replicated heads), as a TP leader.
        staged = max(1, blocks_per_rank // min(tp, model.config.num_key_value_heads))
        shape = self.model.kv_cache_shape(self.kv.num_physical_blocks, block_size)
        self.head_kv = HeadKV(extra_kv_layers, shape[0], shape[1:], dtype, self.device) if extra_kv_layers else None
        self.head_kv_cache = self.head_kv.tensor if self.head_kv else None
        self.port = StagedPort(self, (shape[0] + extra_kv_layers, staged, *shape[2:]), dtype, self.device)
        self._closed = False

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of every layer and KV head once (one KVP rank's lanes together hold
        a token), as ModelRunner reports it: what a handoff stages and moves (replicated heads'
        extra copies on the lanes are not counted)."""
        return self.port.tensor[:, 0].numel() * self.port.tensor.element_size() // self.kv.block_size

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Runs the step on the KVP ranks holding its KV (`step_ranks`). When that is the leader
        alone (and it has no TP lanes), nothing is posted: the step costs what one process's does."""
        ranks = step_ranks(plan, self.kv.block_size, self.rank0.blocks_per_rank, self.kvp)
        if self.coll is not None and (self.tp > 1 or len(ranks) > 1):
            self.coll.post_plan(plan)       # ranks left out relay it down the chain and skip it
        out = self.rank0.run(plan, ranks, self.aux_layers)
        if self.keep_hidden:
            self.last_hidden = self.rank0.hidden
            self.last_aux = self.rank0.aux if self.aux_layers else None
        return out

    def change_lora(self, name: str, path: str | None) -> None:
        """Serve (or with path None drop) a LoRA adapter on every rank (raycluster.parallel.lora_ranks)."""
        msg = LoRAChange(name, path)
        if self.coll is not None:
            self.coll.post_plan(msg)
        self.rank0.adapters.apply(msg)

    def _needs_group(self, shares) -> bool:
        """Whether a block move must be posted to the group: some block is on another KVP rank,
        or the leader has TP lanes (they hold the leader's blocks' other heads)."""
        return self.coll is not None and (self.tp > 1 or any(r for r, _, _ in shares))

    def _shares(self, block_ids: list[int]):
        """(world rank, positions in `block_ids` of the blocks it holds, its lane) of every rank
        holding some of them, the leader first."""
        for r in range(self.kvp * self.tp):
            k, lane = divmod(r, self.tp)
            pos = owned_positions(block_ids, k, self.rank0.blocks_per_rank)
            if pos:
                yield r, pos, lane

    def load_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write whole blocks [L, n, 2, B, Hkv, D] to engine block ids: each to the lanes of the
        KVP rank holding it, every lane its heads."""
        msg = KVLoad(list(block_ids))
        if self.head_kv is not None:
            data = self.head_kv.split_load(block_ids, data)
        shares = list(self._shares(msg.block_ids))
        if self._needs_group(shares):
            self.coll.post_plan(msg)
            for r, pos, lane in shares:
                if r:
                    part = self.rank0.heads(data.index_select(1, torch.tensor(pos, dtype=torch.long)), lane)
                    self.coll.send(part, r, KV_TAG).wait()
        self.rank0.load(msg, data)

    def save_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Whole blocks [L, n, 2, B, Hkv, D] of engine block ids, collected from the ranks
        holding them (every lane its heads; a replicated head from the first lane holding it)."""
        msg = KVSave(list(block_ids))
        shares = list(self._shares(msg.block_ids))
        if self._needs_group(shares):
            self.coll.post_plan(msg)
        kv = self.rank0.kv_cache
        extra = self.head_kv.layers if self.head_kv else 0
        out = torch.empty((kv.shape[0] + extra, len(block_ids)) + tuple(kv.shape[2:4]) +
                          (self.rank0.num_kv_heads, kv.shape[5]), dtype=kv.dtype, device=kv.device)
        for r, pos, lane in shares:
            if not kv_holder(self.rank0.num_kv_heads, self.tp, lane):
                continue
            part = self.rank0.save(msg) if r == 0 else self.coll.recv(self.rank0._blocks(len(pos)), r, KV_TAG)
            index_copy(self.rank0.heads(out[:kv.shape[0]], lane), 1, pos, part)
        if self.head_kv is not None:
            self.head_kv.save_into(block_ids, out)
        return out

    def execute(self, out):
        return execute_step(self, out)

    def close(self, timeout: float = 10.0) -> None:
        if self.coll is not None and not self._closed:
            self._closed = True
            self.coll.post_plan(None)
            self.coll.flush()
            if self.ranks is not None:
                self.ranks.join(timeout)
