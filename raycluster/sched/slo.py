"""SLO arithmetic for prefill scheduling: TTFT deadlines, remaining and total prefill work, slack.

Definitions (times in the clock's unit, seconds in production):

- total work W: predicted isolated prefill time of the whole prompt, one chunk, empty cache.
- remaining work R(t): predicted time of the prefill still to do, as one chunk after the
  `num_computed_tokens` already cached (a recompute after preemption counts its output tokens).
- TTFT deadline D = arrival + ttft, where ttft is the request's own `slo.ttft_s`, or, when it
  carries none, max(ttft_ms / 1000, ttft_scale * W) so long prompts get deadlines in proportion
  to their work (Medha).
- slack s(t) = D - t - R(t); relative slack (Medha's LARS) rho(t) = s(t) / W.

Without a predictor (`ctx.predictor is None`) work is a token-count proxy:
tokens * PROXY_SECONDS_PER_TOKEN (10k prefill tokens/s, an order-of-magnitude figure for a 7-8B
model on one GPU); it preserves the order of work between requests, which is all the policies
need, but deadlines derived from it are only as good as that constant.

`SLOTracker` caches what does not change while a request is queued (D and W) per request id;
policies call `forget` when a request leaves so the cache stays O(queued + running).
"""

from __future__ import annotations

from dataclasses import dataclass

from raycluster.request import Request
from raycluster.sched.base import PolicyContext

PROXY_SECONDS_PER_TOKEN = 1e-4
MIN_WORK_S = 1e-9   # W > 0 keeps rho = s / W finite for empty prompts or all-zero predictors


def remaining_prefill_tokens(req: Request) -> int:
    """Tokens that still need prefill: 0 once the request is decoding."""
    return max(0, req.num_uncomputed_tokens) if req.is_prefill else 0


def prefill_over(req: Request) -> bool:
    """`remaining_prefill_tokens(req) == 0`, without the property chain: policies ask on every
    progress event, i.e. per request per step."""
    out = req.output_token_ids
    left = len(req.prompt_token_ids) + len(out) - req.num_computed_tokens
    return left <= 0 or (left == 1 and bool(out))


def prefill_time(ctx: PolicyContext, num_tokens: int, kv_before: int = 0) -> float:
    """Predicted isolated time to prefill `num_tokens` after `kv_before` cached tokens."""
    if num_tokens <= 0:
        return 0.0
    pred = ctx.predictor
    if pred is None:
        return num_tokens * PROXY_SECONDS_PER_TOKEN
    fn = getattr(pred, "prefill_time", None)
    if fn is not None:
        return float(fn(num_tokens, kv_before))
    return float(pred.batch_time([(num_tokens, kv_before)], []))


def ttft_budget(ctx: PolicyContext, req: Request, total_work: float) -> float:
    """The TTFT the request is allowed: its own SLO, else the deployment default scaled by work."""
    if req.slo.ttft_s is not None:
        return float(req.slo.ttft_s)
    return max(ctx.slo.ttft_ms / 1000.0, ctx.slo.ttft_scale * total_work)


@dataclass(slots=True)
class StaticSLO:
    """Per-request values fixed at first sight: they depend only on the prompt and the SLO.
    Treat as read-only (not frozen: a frozen __init__ costs an object.__setattr__ per field, and
    one is built per request per policy queue)."""
    deadline: float
    total_work: float
    ttft: float
    work0: float = 0.0      # remaining work while nothing is computed (total_work before the floor)


class SLOTracker:
    """Deadline/work/slack of requests, with the static part cached by request id."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self._static: dict[str, StaticSLO] = {}

    def static(self, req: Request) -> StaticSLO:
        st = self._static.get(req.request_id)
        if st is None:
            w0 = prefill_time(self.ctx, req.num_prompt_tokens, 0)
            w = max(MIN_WORK_S, w0)
            ttft = ttft_budget(self.ctx, req, w)
            st = StaticSLO(deadline=req.arrival_time + ttft, total_work=w, ttft=ttft, work0=w0)
            self._static[req.request_id] = st
        return st

    def deadline(self, req: Request) -> float:
        return self.static(req).deadline

    def total_work(self, req: Request) -> float:
        return self.static(req).total_work

    def remaining_work(self, req: Request) -> float:
        if req.num_computed_tokens == 0 and not req.output_token_ids:
            return self.static(req).work0       # the whole prompt from an empty cache: cached
        return prefill_time(self.ctx, remaining_prefill_tokens(req), req.num_computed_tokens)

    def static_slack(self, req: Request) -> float:
        """D - R: slack plus now. Orders requests like slack does, and is constant between
        progress events, so heaps can key on it."""
        return self.deadline(req) - self.remaining_work(req)

    def slack_and_work(self, req: Request) -> tuple[float, float]:
        """(`static_slack`, `total_work`) with one cache lookup: what a push needs."""
        st = self.static(req)
        if req.num_computed_tokens == 0 and not req.output_token_ids:
            return st.deadline - st.work0, st.total_work
        return st.deadline - prefill_time(self.ctx, remaining_prefill_tokens(req),
                                          req.num_computed_tokens), st.total_work

    def slack(self, req: Request, now: float) -> float:
        return self.static_slack(req) - now

    def relative_slack(self, req: Request, now: float) -> float:
        return self.slack(req, now) / self.total_work(req)

    def forget(self, request_id: str) -> None:
        self._static.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._static)
