"""Kairos slack-guided decode batching (Alg. 3) and its step-time lookup table.

Owns: which decode-phase requests run this step. Data enters through
`KairosDecodeSelector.select(decodes, now)` (requests with their delivered tokens and first-token
time) and `observe(batch_size, seq_len, seconds)` after every step (the engine reports the measured
step time, which updates the LUT online). It leaves as the chosen subset, in input order.

Slack of request r (seconds it may still wait before its next token is late):
    s_r = tpot * (n_r - n0_r + 1) - (now - t0_r) - LUT[b, seq_len_r]
anchored at (t0_r, n0_r): token n0_r was out at t0_r, so token n_r + 1 is due at
t0_r + (n_r + 1 - n0_r) * tpot, and the step that makes it must fit before that
(n_r = len(output_token_ids); with t0 = the first token and n0 = 1 this is the seed's formula).
The step reserved is the seed's Eq. 2, LUT(seq_len_r, BatchSize) with b = the number of active
decodes (`reserve="batch"`, default); Alg. 3 line 5 writes LUT[1, seq_len_r] (`reserve="single"`).
They differ where it matters: when no subset fits, Alg. 3 decodes everybody, a step of the whole
batch, and a slack that reserved only a one-request step lets that step overrun the deadline of
the request it was delayed for (each delayed request then ends a little above its TPOT).
The anchor is the request's `first_token_time` with n0 = 1 when the first token was made here
(mixed instance) and the request comes to us with it set. A P/D handoff arrives with its first
token made elsewhere and `first_token_time` unset (the WorkItem does not carry when the prefill
instance produced it), and the local scheduler then stamps `first_token_time` with its own
first decode token, the request's *second*: anchoring there with n0 = 1 would grant one whole
extra TPOT (plus the handoff delay) and pace every delayed request past its SLO. So a request
first seen without `first_token_time` is anchored at the time it is first seen here with n0 =
the tokens it already has. The handoff delay before that (KV transfer, decode-side queueing) is
still unknown to the selector (the seed's Eq. 2 uses T_prefill_finish; carrying it needs the
first-token time in WorkItem), so a request paced exactly at its slack ends a little above its
TPOT SLO by (handoff delay) / (tokens - 1). Then, with s_min the smallest slack, requests in ascending seq_len join the batch B
while LUT[|B|+1, seq_len_r] <= s_min (the batch finishes before anybody's deadline is at risk)
and the join raises throughput (|B|+1)/t_step > |B|/t_cur. An empty B means no slack to exploit:
decode everything.

Token order: the selector never reorders a request's own tokens. Each step appends at most one
token per selected request to its `output_token_ids`, in sequence; requests with slack are simply
skipped this step. Tokens a short request produces ahead of its TPOT schedule are streamed (or
buffered by the frontend) in that same per-request order, so "early" tokens are always delivered
in order.

`StepTimeLUT`: grid of batch sizes x sequence lengths; a lookup rounds both up to the next grid
point (conservative). Entries are profiled (from a callable, e.g. a BatchPredictor or a real step
function) and then tracked online by an exponential moving average of observed step times.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Sequence

from raycluster.request import Request
from raycluster.sched.base import BatchPredictor, DecodeSelector, SLOConfig


def _pow2_grid(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return out


@dataclass
class StepTimeLUT:
    batch_sizes: list[int]
    seq_lens: list[int]
    table: list[list[float]]          # table[i][j]: step time of batch_sizes[i] requests at seq_lens[j]
    alpha: float = 0.2                # EMA weight of a new observation
    counts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.seq_lens) != self.seq_lens:
            raise ValueError("StepTimeLUT: grids must be sorted ascending")
        if len(self.table) != len(self.batch_sizes) or any(len(row) != len(self.seq_lens) for row in self.table):
            raise ValueError("StepTimeLUT: table shape must be len(batch_sizes) x len(seq_lens)")
        if not self.counts:
            self.counts = [[0] * len(self.seq_lens) for _ in self.batch_sizes]

    @classmethod
    def profile(cls, step_time: Callable[[int, int], float], batch_sizes: Sequence[int],
                seq_lens: Sequence[int], alpha: float = 0.2) -> "StepTimeLUT":
        """Fill the grid by calling step_time(batch_size, seq_len) once per cell."""
        bs, sl = sorted(batch_sizes), sorted(seq_lens)
        return cls(bs, sl, [[float(step_time(b, s)) for s in sl] for b in bs], alpha)

    @classmethod
    def from_predictor(cls, predictor: BatchPredictor, max_batch: int = 256, max_seq_len: int = 131072,
                       alpha: float = 0.2) -> "StepTimeLUT":
        """Power-of-two grid; every request of a cell is charged the cell's (maximum) length."""
        return cls.profile(lambda b, s: predictor.batch_time([], [s] * b),
                           _pow2_grid(1, max_batch), _pow2_grid(16, max_seq_len), alpha)

    def _cell(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        i = min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)
        j = min(bisect.bisect_left(self.seq_lens, seq_len), len(self.seq_lens) - 1)
        return i, j

    def lookup(self, batch_size: int, seq_len: int) -> float:
        i, j = self._cell(batch_size, seq_len)
        t = self.table[i][j]
        # Beyond the grid, scale linearly rather than under-estimate (decode cost ~ batch x len).
        if batch_size > self.batch_sizes[-1]:
            t *= batch_size / self.batch_sizes[-1]
        if seq_len > self.seq_lens[-1]:
            t *= seq_len / self.seq_lens[-1]
        return t

    def observe(self, batch_size: int, seq_len: int, seconds: float) -> None:
        """Move the cell that `lookup(batch_size, seq_len)` reads toward a measured step time."""
        if batch_size <= 0 or seconds < 0:
            return
        i, j = self._cell(batch_size, seq_len)
        if batch_size > self.batch_sizes[-1]:
            seconds *= self.batch_sizes[-1] / batch_size      # undo the extrapolation of lookup
        if seq_len > self.seq_lens[-1]:
            seconds *= self.seq_lens[-1] / seq_len
        self.table[i][j] += self.alpha * (seconds - self.table[i][j])
        self.counts[i][j] += 1


class KairosDecodeSelector(DecodeSelector):
    def __init__(self, lut: StepTimeLUT, slo: SLOConfig | None = None, reserve: str = "batch") -> None:
        if reserve not in ("batch", "single"):
            raise ValueError(f"reserve: 'batch' (Eq. 2) or 'single' (Alg. 3), got {reserve!r}")
        self.lut = lut
        self.slo = slo or SLOConfig()
        self.reserve = reserve
        self._anchor: dict[str, tuple[float, int]] = {}     # request id -> (t0, n0)

    def tpot_s(self, req: Request) -> float:
        return req.slo.tpot_s if req.slo.tpot_s is not None else self.slo.tpot_ms / 1000.0

    def anchor(self, req: Request, now: float) -> tuple[float, int]:
        a = self._anchor.get(req.request_id)
        if a is None:
            if req.first_token_time is not None:
                a = (req.first_token_time, 1)
            else:                              # handed off: first token made elsewhere
                a = (now, max(1, len(req.output_token_ids)))
            self._anchor[req.request_id] = a
        return a

    def slack(self, req: Request, now: float, batch_size: int = 1) -> float:
        t0, n0 = self.anchor(req, now)
        n = max(1, len(req.output_token_ids))
        b = batch_size if self.reserve == "batch" else 1
        return self.tpot_s(req) * (n - n0 + 1) - (now - t0) - self.lut.lookup(max(1, b), req.num_tokens)

    def _prune(self, decodes: Sequence[Request]) -> None:
        if len(self._anchor) > 2 * len(decodes) + 64:
            live = {r.request_id for r in decodes}
            self._anchor = {k: v for k, v in self._anchor.items() if k in live}

    def select(self, decodes: Sequence[Request], now: float) -> list[Request]:
        self._prune(decodes)
        if len(decodes) <= 1:
            for r in decodes:
                self.anchor(r, now)
            return list(decodes)
        b = len(decodes)
        s_min = min(self.slack(r, now, b) for r in decodes)
        chosen: set[int] = set()
        t_cur = 0.0
        for idx in sorted(range(len(decodes)), key=lambda k: decodes[k].num_tokens):
            size = len(chosen) + 1
            t_step = self.lut.lookup(size, decodes[idx].num_tokens)
            # Throughput test of Alg. 3 line 13, cross-multiplied so zero times cannot divide.
            gains = not chosen or size * t_cur > len(chosen) * t_step
            if t_step <= s_min and gains:
                chosen.add(idx)
                t_cur = t_step
        if not chosen:
            return list(decodes)             # no slack to exploit: decode all
        return [r for k, r in enumerate(decodes) if k in chosen]

    def observe(self, batch_size: int, seq_len: int, seconds: float) -> None:
        """Engine hook after each decode step: batch size, its longest seq_len, measured time."""
        self.lut.observe(batch_size, seq_len, seconds)
