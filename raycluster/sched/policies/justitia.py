"""Justitia: applications served in the order they would finish under fair sharing (GPS).

Cost of an inference is its KV token-time c = p*d + d^2/2 (p prompt tokens, d expected output
tokens: `expected_output_tokens`, else `max_tokens`); an application (`app_id`, or the request
id when none) costs the sum over its inferences. GPS shares the server's service rate M equally
among the N_t applications active in GPS, so virtual time runs at dV/dt = M / N_t. An
application arriving at a with cost C gets finish tag F = V(a) + C; a further inference of an
application still active in GPS extends it, F = max(F, V(a)) + c (the application-level total,
as when all of it arrives at once). Pending requests are served by smallest F (ties:
application first seen), FIFO within an application.

M must be in the costs' units per clock second. In the seed M is the server's total KV cache
space and time counts iterations (each iteration serves one KV token-time per cached token),
so M is "KV token-time served per second" at saturation. M set too small (e.g. 1 unit/s while
a large call costs ~1e7) freezes V, and the tags F = V(a) + C order like remaining cost: SRJF,
with its starvation. How M is obtained:

- `rate` given: M = ctx.num_slots * rate, fixed (`rate` is the cost one slot serves per
  second; 1.0 with costs in slot-time, as in the tests).
- `kv_capacity_tokens` given (or `set_kv_capacity`): the seed's M, the whole KV cache served
  once per iteration, converted to seconds with the predictor's step time at a full cache.
- otherwise M is measured: decode progress reported through `on_progress` serves the KV it
  holds (a step of a request with KV length K serves K units, the summand of c), summed over
  saturated time only (clock time while a request waits in this queue, so a work-conserving
  server runs at capacity; idle or half-empty periods would measure demand, not capacity).
  Each window of `window_s` saturated seconds gives a sample and M is their EMA (weight
  `ema_alpha`). Before the first sample M is a prior: from the batch-time predictor when the
  context has one (ctx.num_slots decodes at the KV length L = p + d/2 of the first request:
  num_slots * L / batch_time), else ctx.num_slots units/s. A changed M applies from now on (V
  is integrated piecewise). The measured M is what the server delivers in these units: on a
  slot-bound server (max_num_seqs reached long before the KV cache fills) it is far below the
  seed's "KV capacity per iteration", and a stream of small requests can fill it (in GPS terms
  the server is then saturated and the elephant's fair share is small).

V(t) is tracked exactly by replaying GPS departures: active applications sit in a heap by F;
between events V grows linearly, and an application leaves GPS when V reaches its F, which
changes the slope. Amortised O(log n) per push/pop; tags never change after they are set
(only grow by new arrivals), so the group heap needs no eager re-keying.
"""

from __future__ import annotations

import heapq
import itertools

from raycluster.request import Request
from raycluster.sched.base import Policy, PolicyContext
from raycluster.sched.policies.common import GroupQueue


def expected_output(req: Request) -> int:
    d = req.expected_output_tokens
    return int(d if d is not None else req.sampling.max_tokens)


def kv_token_time(p: int, d: int) -> float:
    """KV token-time of one inference: sum over its d decode iterations of the KV it holds."""
    return p * d + d * d / 2.0


def request_cost(req: Request) -> float:
    return kv_token_time(req.num_prompt_tokens, expected_output(req))


def app_of(req: Request) -> str:
    return req.app_id if req.app_id is not None else req.request_id


class VirtualClockGPS:
    """Virtual time of an M-server fluid GPS over applications; exact, event-driven."""

    def __init__(self, servers: float) -> None:
        self.servers = float(servers)
        self.v = 0.0
        self.t = 0.0
        self.finish: dict[str, float] = {}      # active (in GPS) app -> finish tag
        self._heap: list[tuple[float, str]] = []

    def advance(self, now: float) -> float:
        heap, finish = self._heap, self.finish
        while now > self.t:
            while heap and finish.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)                 # superseded tag
            if not heap:
                self.t = now                        # idle GPS: V stands still
                break
            f, app = heap[0]
            rate = self.servers / len(finish)
            t_dep = self.t + (f - self.v) / rate
            if t_dep > now:
                self.v += (now - self.t) * rate
                self.t = now
                break
            self.v, self.t = f, max(self.t, t_dep)
            heapq.heappop(heap)
            del finish[app]
        # Departures due exactly now (also after an idle period) leave before new arrivals.
        while heap and heap[0][0] <= self.v:
            f, app = heapq.heappop(heap)
            if finish.get(app) == f:
                del finish[app]
        return self.v

    def set_servers(self, servers: float, now: float) -> None:
        """Change the service rate from `now` on (V up to now accrues at the old rate)."""
        self.advance(now)
        self.servers = float(servers)

    def arrive(self, app: str, cost: float, now: float) -> float:
        v = self.advance(now)
        f = max(self.finish.get(app, v), v) + cost
        self.finish[app] = f
        heapq.heappush(self._heap, (f, app))
        return f


def served_kv_token_time(req: Request, num_tokens: int) -> float:
    """KV token-time served by `num_tokens` decode steps of `req` just reported: each step holds
    the KV it reads (K, K-1, ... for the last steps, K the KV length now). Prefill progress (no
    output token yet) serves none, as in c = p*d + d^2/2. K is read robustly: the engine reports
    before appending the sampled token, the simulator's decode runs and the router after."""
    if num_tokens <= 0 or not req.output_token_ids:
        return 0.0
    k = max(req.num_computed_tokens, req.num_prompt_tokens + len(req.output_token_ids) - 1)
    return num_tokens * k - num_tokens * (num_tokens - 1) / 2.0


class JustitiaPolicy(Policy):
    name = "justitia"

    def __init__(self, ctx: PolicyContext, rate: float | None = None, kv_capacity_tokens: int | None = None,
                 window_s: float = 1.0, ema_alpha: float = 0.2) -> None:
        super().__init__(ctx)
        if rate is not None and kv_capacity_tokens is not None:
            raise ValueError("justitia: give rate or kv_capacity_tokens, not both")
        self.slots = max(1, ctx.num_slots)
        self.measured = rate is None and kv_capacity_tokens is None
        self.window_s, self.ema_alpha = float(window_s), float(ema_alpha)
        self.gps = VirtualClockGPS(self.slots * (1.0 if rate is None else rate))
        self._prior_set = not self.measured
        if kv_capacity_tokens is not None:
            self.set_kv_capacity(kv_capacity_tokens)
        self.samples = 0                                 # rate samples taken (measured mode)
        self._served = 0.0                               # KV token-time served, saturated, this window
        self._busy = 0.0                                 # saturated seconds in this window
        self._mark = 0.0                                 # time of the last event seen
        self._saturated = False                          # a request was waiting since _mark
        self._tag: dict[str, tuple[float, int]] = {}     # app -> (F, first-seen order)
        self._members: dict[str, int] = {}               # app -> requests not yet finished
        self._charged: dict[str, str] = {}               # request id -> app (cost charged)
        self._counter = itertools.count()
        self._q = GroupQueue(self._tag.__getitem__)

    @property
    def service_rate(self) -> float:
        """M: cost units served per clock second, shared by the applications active in GPS."""
        return self.gps.servers

    def finish_tag(self, app: str) -> float:
        return self._tag[app][0]

    def set_kv_capacity(self, tokens: int) -> None:
        """The seed's M: the whole KV cache (`tokens`) served once per iteration, an iteration
        being the predictor's decode step with the cache full (ctx.num_slots sequences sharing
        it). Fixes M from now on (no measuring)."""
        pred = self.ctx.predictor
        if pred is None:
            raise ValueError("justitia: kv_capacity_tokens needs the context's batch-time predictor "
                             "(iterations -> seconds)")
        per = max(1, int(tokens) // self.slots)
        t = pred.batch_time([], [per] * self.slots)
        if t <= 0:
            raise ValueError("justitia: predictor gives a non-positive step time")
        self.measured = False
        self._prior_set = True
        self.gps.set_servers(per * self.slots / t, self.ctx.clock.now())

    def _set_prior(self, req: Request) -> None:
        self._prior_set = True
        pred = self.ctx.predictor
        if pred is None:
            return
        kv = max(1, int(req.num_prompt_tokens + expected_output(req) / 2))
        t = pred.batch_time([], [kv] * self.slots)
        if t > 0:
            self.gps.set_servers(self.slots * kv / t, self.ctx.clock.now())

    def _tick(self) -> bool:
        """Account saturated time up to now; True if the server was saturated since the last
        event (a request waited here, so a work-conserving server ran at capacity)."""
        if not self.measured:
            return False
        now = self.ctx.clock.now()
        was = self._saturated
        if was:
            self._busy += max(0.0, now - self._mark)
        self._mark = now
        return was

    def _retick(self) -> None:
        if self.measured:
            self._saturated = len(self._q) > 0

    def push(self, req: Request) -> None:
        self._tick()
        rid = req.request_id
        if rid not in self._charged:                      # arrival: charge its cost once
            if not self._prior_set:
                self._set_prior(req)
            app = app_of(req)
            f = self.gps.arrive(app, request_cost(req), self.ctx.clock.now())
            seq = self._tag[app][1] if app in self._tag else next(self._counter)
            self._tag[app] = (f, seq)
            self._charged[rid] = app
            self._members[app] = self._members.get(app, 0) + 1
        self._q.push(req, self._charged[rid])
        self._retick()

    def pop(self) -> Request | None:
        self._tick()
        req = self._q.pop()
        self._retick()
        return req

    def remove(self, request_id: str) -> None:
        self._tick()
        self._q.remove(request_id)
        self._retick()
        app = self._charged.pop(request_id, None)
        if app is not None:
            self._members[app] -= 1
            if self._members[app] == 0:
                # No request left to order: a later request of the app re-derives its tag from
                # GPS (which still remembers F while the app is active there).
                del self._members[app]
                self._tag.pop(app, None)

    def __len__(self) -> int:
        return len(self._q)

    def on_progress(self, req: Request, num_tokens: int) -> None:
        if not self._tick():
            return
        self._served += served_kv_token_time(req, num_tokens)
        if self._busy >= self.window_s and self._served > 0:
            sample = self._served / self._busy
            m = sample if self.samples == 0 else (1 - self.ema_alpha) * self.gps.servers + self.ema_alpha * sample
            self.samples += 1
            self._served = self._busy = 0.0
            self.gps.set_servers(m, self._mark)

    def on_finish(self, req: Request) -> None:
        self.remove(req.request_id)
