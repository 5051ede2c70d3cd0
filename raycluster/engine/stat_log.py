"""Periodic one-line engine statistics for the log, as vLLM's "Avg prompt throughput" line.

`StatLogger` is fed by the thread that steps an engine: `observe(engine, result)` after every
step and `observe(engine, None)` while it idles. Once `interval_s` has passed since the window
began it emits (through the `emit` callable it was given: a logger's `info`, print) one line for
the window: prompt and generation throughput, steps and their mean time, preemptions, requests
running and waiting, KV cache usage and, with prefix caching, the window's prefix hit rate; with
speculative decoding, the window's draft acceptance rate (accepted / drafted tokens). A
window with no tokens and no requests held emits nothing, so an idle instance stays quiet. Reads
the engine's scheduler and KV manager; holds only its window's counters.
"""

from __future__ import annotations

import time
from typing import Callable

from raycluster.engine.engine import LLMEngine, StepResult


class StatLogger:
    def __init__(self, name: str, interval_s: float, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name, self.interval_s, self.emit, self.clock = name, interval_s, emit, clock
        self._start = clock()
        self._prompt = self._generated = self._steps = self._preempted = 0
        self._busy_s = 0.0
        self._drafts = self._accepted = 0
        self._prefix_mark: tuple[int, int] | None = None

    def observe(self, engine: LLMEngine, result: StepResult | None) -> str | None:
        """Count `result` (None: an idle tick) and emit the window's line if it is due; returns it."""
        if result is not None:
            self._prompt += result.num_prefill_tokens
            self._generated += sum(len(o.new_token_ids) for o in result.outputs)
            self._preempted += result.num_preempted
            self._steps += 1
            self._busy_s += result.duration_s
            self._drafts += result.num_draft_tokens
            self._accepted += result.num_accepted_tokens
        now = self.clock()
        span = now - self._start
        if span < self.interval_s:
            return None
        line = self._line(engine, span)
        self._start = now
        self._prompt = self._generated = self._steps = self._preempted = 0
        self._busy_s = 0.0
        self._drafts = self._accepted = 0
        if line is not None:
            self.emit(line)
        return line

    def _line(self, engine: LLMEngine, span: float) -> str | None:
        sched, kv = engine.scheduler, engine.kv
        running, waiting = sched.num_running, sched.num_waiting
        hit = self._prefix_window(kv)
        if not (self._steps or running or waiting):
            return None
        used = 1.0 - kv.num_free_blocks / kv.num_blocks
        mean_ms = 1e3 * self._busy_s / self._steps if self._steps else 0.0
        text = (f"{self.name}: prompt {self._prompt / span:.1f} tok/s, generation {self._generated / span:.1f} tok/s, "
                f"{self._steps} steps (mean {mean_ms:.1f} ms), running {running}, waiting {waiting}, "
                f"preempted {self._preempted}, KV cache {100 * used:.1f}%")
        if hit is not None:
            text += f", prefix cache hit {100 * hit:.1f}%"
        if self._drafts:
            text += f", draft acceptance {100 * self._accepted / self._drafts:.1f}% of {self._drafts}"
        return text

    def _prefix_window(self, kv) -> float | None:
        """Hit rate over the tokens looked up in this window (None without prefix caching or lookups)."""
        if not kv.prefix_caching:
            return None
        mark = (kv.query_tokens, kv.hit_tokens)
        q0, h0 = self._prefix_mark or (0, 0)
        self._prefix_mark = mark
        queried = mark[0] - q0
        return (mark[1] - h0) / queried if queried > 0 else None
