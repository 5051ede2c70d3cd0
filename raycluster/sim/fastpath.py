"""Decode fast path of the simulator: decoding requests advance as one group (issue 6's speed).

Owns `FastScheduler`, a `Scheduler` whose pure-decode requests are not touched per step. It
keeps, per instance, the group aggregates the step needs -- n (decoding requests) and S (sum of
their KV lengths, which grows by n per step) -- a heap of the step index at which each member
finishes, and per block-residue counts of members that cross a KV block boundary at a given
step. A step then costs O(#prefill chunks + #members finishing + #blocks allocated) instead of
O(batch): the packer and the predictor see the same decode count and KV sum as the exact path
(`GroupView` / `KVSum` below feed `len` and `sum` of the decode KV lengths, the only decode
features both predictors use), blocks are taken from the allocator at the same steps into a
group bag, and a member's counters, output tokens and block table are brought up to date
("materialized") only when it finishes or the group dissolves.

Exact by construction, or not used: the group is active only when every member stops by length
alone (ignore_eos or no EOS ids, the fake token not a stop token), the decode selector is
`AllDecodes`, the packer is Medha's or the token-budget one (not AWD's: an instance whose
packer holds requests steps exactly, woken by sim/instance.py when they fall due), and the
scheduler's policy does nothing on decode progress after prefill (fcfs, edf, srpt, lrs, lars).
The group dissolves (materialize all, this step runs `Scheduler.schedule` as is) when a
step's new blocks do not fit in free KV (preemption possible), when the batch exceeds
max_num_seqs, on abort or cancelled admission. It re-forms at the next step that allows it.

The instance (sim/instance.py) reports no per-token events for group members: a member's tokens
reach the router in its finish event (or, if the group dissolves first, in the next report).
Per-request records (first token, finish, token count) are unchanged; the cluster refuses the
fast path when a router-side policy charges delivered tokens (see `router_ok`).
"""

from __future__ import annotations

import heapq

from raycluster.engine.scheduler import Scheduler, SchedulerOutput, _StepAllocator
from raycluster.request import Request, RequestStatus
from raycluster.sched.base import AllDecodes, PackLimits, Policy
from raycluster.sched.medha_packer import MedhaPacker
from raycluster.sched.policies.common import SLOHeapPolicy
from raycluster.sched.policies.lars import LARSPolicy
from raycluster.sched.token_packer import TokenBudgetPacker

TOKEN = 2           # the simulator's fake sampled token (instance.TOKEN)
_RUNNING = RequestStatus.RUNNING
_SAFE_PROGRESS = (Policy.on_progress, SLOHeapPolicy.on_progress, LARSPolicy.on_progress)


def policy_ok(policy: Policy) -> bool:
    """Does the policy ignore decode progress (on_progress idempotent once prefill is over)?"""
    return type(policy).on_progress in _SAFE_PROGRESS


def router_ok(router) -> bool:
    return all(policy_ok(p) for p in router.policies.values())


class KVSum:
    """Decode KV lengths as the predictors read them: len() = n, sum() = S (exact ints)."""
    __slots__ = ("n", "s")

    def __init__(self, n: int, s: int) -> None:
        self.n, self.s = n, s

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter((self.s,))


class GroupView:
    """`SchedulerOutput.decodes` of a group step: len() = n; `kv_lens` is what a packer hands
    its predictor for the decodes (`sched.base.Packer`: decodes may carry `kv_lens`)."""
    __slots__ = ("kv_lens",)

    def __init__(self, n: int, s: int) -> None:
        self.kv_lens = KVSum(n, s)

    def __len__(self) -> int:
        return self.kv_lens.n


class FastScheduler(Scheduler):
    """`Scheduler` with the decode group (use `make_fast(sched)` on a built scheduler)."""

    def init_fast(self) -> None:
        self._check_fast()
        self.active = False
        self.k = 0                      # group steps run so far
        self.members: dict[str, list] = {}   # rid -> [req, c0, out0, s0, ntab0, jr, fin]
        self.n = 0
        self.S = 0
        self.cnt = [0] * self.kv.block_size
        self.heap: list[tuple[int, int, str]] = []
        self.bag: list[int] = []        # blocks allocated for members, not yet in their tables
        self.seq = 0
        self.unreported: list[tuple[str, int]] = []     # (rid, tokens) made in the group, not reported
        self.group_done: list[tuple[Request, int]] = []  # members finished by the last update
        self.group_steps = 0
        self.dissolved = 0
        self.flight = False             # a group step is running (between schedule and update)
        self.joins: list[Request] = []  # admitted while a group step ran: join after it

    def _check_fast(self) -> None:
        self.limits = PackLimits(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.fast_ok = (type(self.decode_selector) is AllDecodes and policy_ok(self.policy)
                        and type(self.packer) in (MedhaPacker, TokenBudgetPacker))

    def reconfigure(self, config, policy, packer, decode_selector) -> None:
        """`Scheduler.reconfigure` (between steps): the group dissolves first (its members'
        tokens go to `unreported`), and may re-form under the new pieces if they allow it."""
        self._dissolve()
        super().reconfigure(config, policy, packer, decode_selector)
        self._check_fast()

    # ---- membership ------------------------------------------------------------------------
    def _eligible(self, req: Request) -> bool:
        sp = req.sampling
        return ((sp.ignore_eos or TOKEN not in req.eos_token_ids) and TOKEN not in sp.stop_token_ids
                and req.status is _RUNNING)

    def _register(self, req: Request) -> bool:
        if not self._eligible(req):
            return False
        rid, bs, k = req.request_id, self.kv.block_size, self.k
        table = self.kv.block_tables.get(rid)
        c0, out0 = req.num_computed_tokens, len(req.output_token_ids)
        ntab0 = len(table) if table is not None else 0
        slack = ntab0 * bs - c0
        limit = min(req.sampling.max_tokens, self.config.max_model_len - len(req.prompt_token_ids))
        if not 0 <= slack < bs or out0 >= limit or req.num_tokens - c0 != 1:
            return False
        jr = (k + 1 + slack) % bs
        fin = k + limit - out0
        self.seq += 1
        self.members[rid] = [req, c0, out0, k, ntab0, jr, fin, self.seq]
        self.cnt[jr] += 1
        self.n += 1
        self.S += c0
        heapq.heappush(self.heap, (fin, self.seq, rid))
        return True

    def _activate(self) -> bool:
        for req in self.decoding.values():
            if not self._register(req):
                self._dissolve()
                return False
        self.active = True
        return True

    def _materialize(self, m: list, block_steps: int | None = None) -> int:
        """Bring a member's counters and outputs to step k and its table to step `block_steps`
        (default k); returns the tokens it made in the group."""
        req, c0, out0, s0, ntab0 = m[:5]
        k, bs = self.k, self.kv.block_size
        b = k if block_steps is None else block_steps
        made = k - s0
        if made:
            req.num_computed_tokens = c0 + made
            req.output_token_ids.extend([TOKEN] * made)
        if b > s0:
            j1 = s0 + 1 + (ntab0 * bs - c0)
            extra = (b - j1) // bs + 1 if b >= j1 else 0
            if extra:
                table, bag = self.kv.block_tables[req.request_id], self.bag
                table.extend(bag[-extra:])
                del bag[-extra:]
        return made

    def _dissolve(self) -> None:
        """Materialize every member (their tokens go to `unreported`) and leave group mode."""
        if self.active:
            self.dissolved += 1
            for rid, m in self.members.items():
                made = self._materialize(m)
                if made:
                    self.policy.on_progress(m[0], made)
                    self.unreported.append((rid, made))
            assert not self.bag, "decode group: blocks left in the bag"
        self.active = False
        self.flight = False
        self.members.clear()
        self.heap.clear()
        self.cnt = [0] * self.kv.block_size
        self.n = self.S = 0
        self.k = 0

    # ---- Scheduler interface -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if not self.fast_ok or (not self.active and not self._activate()):
            return super().schedule()
        n = self.n
        need = self.cnt[(self.k + 1) % self.kv.block_size] if n else 0
        if n > self.config.max_num_seqs or need > self.kv.num_free_blocks:
            self._dissolve()
            return super().schedule()
        if need:
            self.bag.extend(self.kv.allocator.allocate(need))
        out = SchedulerOutput()
        if n:
            out.decodes = GroupView(n, self.S)
            self.flight = True
        out.prefills = self.packer.plan(out.decodes, self.policy, self.limits, _StepAllocator(self))
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        self.group_done = []
        if not self.active:      # an exact step (schedule dissolved the group, or it never formed)
            return super().update(out, sampled, accepted)
        # Grouped: out.decodes is a GroupView, or [] when the group is empty.
        self.flight = False
        finished = self._advance_prefills(out.prefills, sampled, self.clock.now())
        self.group_steps += 1
        self.k += 1
        k = self.k
        self.S += self.n
        heap, members = self.heap, self.members
        while heap and heap[0][0] <= k:
            _, seq, rid = heapq.heappop(heap)
            m = members.get(rid)
            if m is None or m[7] != seq:
                continue                  # left the group (aborted)
            del members[rid]
            req = m[0]
            made = self._materialize(m)
            self.n -= 1
            self.S -= req.num_computed_tokens
            self.cnt[m[5]] -= 1
            self.policy.on_progress(req, 1)
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            finished.append(req)
            self.group_done.append((req, made))
        joins, self.joins = [r for r, _ in out.prefills] + self.joins, []
        for req in joins:                 # first token just made (or KV landed mid-step): join
            if req.status is _RUNNING and req.request_id in self.decoding and req.request_id not in members:
                if not self._register(req):
                    self._dissolve()
                    break
        return finished

    def admit_prefilled(self, req: Request) -> list[int] | None:
        table = super().admit_prefilled(req)
        if table is not None:
            self._join_running(req)
        return table

    def adopt_parked(self, request_id: str) -> Request | None:
        req = super().adopt_parked(request_id)
        if req is not None:
            self._join_running(req)
        return req

    def _join_running(self, req: Request) -> None:
        """A request entered decoding outside a step: into the decode group, if one runs."""
        if self.active:
            if self.flight:
                self.joins.append(req)    # not in the running step: joins after it
            elif not self._register(req):
                self._dissolve()

    def _leave(self, request_id: str) -> None:
        """A member leaves outside a step's end (abort): its table gets the blocks reserved for
        it up to the running step; its group tokens are reported."""
        m = self.members.pop(request_id, None)
        if m is None:
            return
        made = self._materialize(m, self.k + 1 if self.flight else self.k)
        if made:
            self.unreported.append((request_id, made))
        self.n -= 1
        self.S -= m[0].num_computed_tokens
        self.cnt[m[5]] -= 1

    def cancel_admission(self, req: Request) -> None:
        self._leave(req.request_id)
        super().cancel_admission(req)

    def abort(self, request_id: str) -> Request | None:
        self._leave(request_id)
        return super().abort(request_id)


def make_fast(sched: Scheduler) -> FastScheduler:
    """Turn a scheduler built by `build_scheduler` into a `FastScheduler` in place."""
    sched.__class__ = FastScheduler
    sched.init_fast()
    return sched
