"""The interfaces every scheduling piece implements, and the context they share.

- `Policy`: orders requests that still need prefill. The engine's scheduler (and the router) pop
  candidates in priority order, let a `Packer` size their chunks, and push back what remains, so
  a decision costs O(k log n) for k popped out of n queued.
- `Packer`: turns (decodes chosen this step, policy order, budgets) into prefill chunks.
- `DecodeSelector`: picks which decode-phase requests run this step (all, or Kairos slack-based).
- `BatchPredictor`: predicted wall time of a batch; drives time budgets, deadlines and the
  simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol, Sequence

from raycluster.request import Request


class Clock(Protocol):
    def now(self) -> float: ...


class BatchPredictor(Protocol):
    def batch_time(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> float:
        """Seconds for one step running prefill chunks given as (chunk_tokens, kv_tokens_before)
        and one decode token per entry of decode_kv_lens (its KV length)."""
        ...


@dataclass
class SLOConfig:
    """Deployment defaults for requests that carry no SLO (Medha: long prompts get deadlines in
    proportion to their isolated prefill time)."""
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    ttft_scale: float = 5.0


@dataclass
class PolicyContext:
    clock: Clock
    predictor: BatchPredictor | None = None
    slo: SLOConfig = field(default_factory=SLOConfig)
    num_slots: int = 1          # M in Justitia's GPS: service units shared by the active apps
    num_servers: int = 1        # instances draining this queue in parallel (Kairos' FCFS backlog)


class Policy(ABC):
    """A priority order over requests that need prefill (new, partially prefilled, or preempted).

    `pop` returns the most urgent request and removes it; the caller either schedules a chunk of
    it and pushes it back after the step (after `on_progress`), or pushes it back untouched. `remove` drops a
    request that finished or was aborted. Implementations break ties fairly (arrival, then a
    sequence number), never by request id string order.
    """

    name: ClassVar[str]

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def push(self, req: Request) -> None: ...

    @abstractmethod
    def pop(self) -> Request | None: ...

    @abstractmethod
    def remove(self, request_id: str) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def on_progress(self, req: Request, num_tokens: int) -> None:
        """`num_tokens` of `req` were computed (prefill chunk or decode token). Called while the
        request is popped or running, before any push."""

    def on_finish(self, req: Request) -> None:
        """`req` left the system (finished or aborted): fair-queuing policies settle accounts."""

    def preemption_victim(self, asking: Request, holders: Sequence[Request]) -> Request | None:
        """The decode `asking` needs a KV block and none is free: which request gives up its KV,
        one of `holders` (the other requests holding blocks, in admission order) or `asking`
        itself (it then waits). None: the scheduler's default, vLLM's for FCFS (the latest
        admitted request still queued for prefill, else the latest admitted decode)."""
        return None


class KVAllocator(Protocol):
    def try_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Reserve KV slots for `num_new_tokens` more tokens of `req`; False (and nothing
        reserved) when they do not fit. Reserving at once keeps several chunks of one plan
        from counting the same free blocks."""
        ...


@dataclass
class PackLimits:
    max_num_batched_tokens: int     # token budget of a step (decodes included)
    max_num_seqs: int               # requests in a step (decodes included)


class Packer(ABC):
    """Chooses prefill chunks for one step after decodes were chosen."""

    @abstractmethod
    def plan(self, decodes: Sequence[Request], policy: Policy, limits: PackLimits,
             kv: KVAllocator) -> list[tuple[Request, int]]:
        """Return [(request, chunk_tokens)] in execution order. Pops candidates from `policy`
        and pushes back every popped request it did not schedule. `decodes` may carry
        `kv_lens`, their KV lengths as the predictor reads them (len and sum; the simulator's
        decode group passes counts instead of requests); else they are requests. Scheduled requests stay out
        of the policy: the caller calls `on_progress` after the step and pushes back those that
        still need prefill (so progress-dependent keys are recomputed)."""

    def num_held(self) -> int:
        """Requests the packer holds itself (outside the policy), e.g. AWD's waiting batch."""
        return 0

    def release_held(self) -> list[Request]:
        """Give up every request the packer holds (in the order it took them), e.g. when the
        engine swaps packers; the caller queues them elsewhere."""
        return []

    def next_release_time(self, now: float) -> float | None:
        """Absolute time at which requests the packer holds may be released without anything
        else happening (an arrival, a finished step), or None when it holds none. A driver
        whose step came back empty sleeps until then: the simulator schedules a wake-up there
        instead of polling."""
        return None

    def observe(self, chunks: Sequence[tuple[Request, int]], seconds: float) -> None:
        """The step that ran `chunks` (plus its decodes) took `seconds`."""


class DecodeSelector(ABC):
    @abstractmethod
    def select(self, decodes: Sequence[Request], now: float) -> list[Request]:
        """Subset (in order) of decode-phase requests that run this step."""

    def observe(self, batch_size: int, seq_len: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests, longest KV `seq_len`, took `seconds`."""


class AllDecodes(DecodeSelector):
    """Continuous batching: every decode-phase request runs every step."""

    def select(self, decodes: Sequence[Request], now: float) -> list[Request]:
        return list(decodes)


PolicyFactory = Callable[[PolicyContext], Policy]
