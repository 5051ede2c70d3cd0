"""The discrete-event loop: a virtual clock and a heap of timed events.

Events are (time, seq, kind, payload) tuples in a heap. Tie-break: events at the same virtual
time run in the order they were scheduled (`seq` is a global insertion counter), so a run is a
pure function of the spec, the workload and the seed -- no wall-clock time, no hash order, no
randomness inside the simulator. Handlers are plain callables registered per kind.

Events known up front (the workload's arrivals, `preload`) get their sequence numbers at once
and wait in a sorted list beside the heap, merged in (time, seq) order: the same order as if
each had been pushed, but the heap holds only the events made while running (one per busy
instance, transfers), so a push or pop costs O(log #instances) instead of O(log #requests).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from raycluster.clock import VirtualClock


class EventLoop:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.handlers: dict[str, Callable[[Any], None]] = {}
        self.processed = 0
        self._stream: list[tuple[float, int, str, Any]] = []    # preloaded, sorted; consumed from _si
        self._si = 0

    def on(self, kind: str, handler: Callable[[Any], None]) -> None:
        self.handlers[kind] = handler

    def at(self, t: float, kind: str, payload: Any = None) -> None:
        if t < self.clock.now():
            t = self.clock.now()
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def after(self, dt: float, kind: str, payload: Any = None) -> None:
        self.at(self.clock.now() + max(0.0, dt), kind, payload)

    def preload(self, events: list[tuple[float, str, Any]]) -> None:
        """`at(t, kind, payload)` for each event in turn, kept out of the heap (see above).
        Call it between runs, not from a handler."""
        now = self.clock.now()
        seq = self._seq
        rest = self._stream[self._si:]
        rest += [(t if t >= now else now, next(seq), kind, payload) for t, kind, payload in events]
        rest.sort()         # (time, seq) are unique: the payload is never compared
        self._stream, self._si = rest, 0

    def __len__(self) -> int:
        return len(self._heap) + len(self._stream) - self._si

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        heap, handlers, clock, stream = self._heap, self.handlers, self.clock, self._stream
        ns = len(stream)
        heappop = heapq.heappop
        while True:
            i = self._si
            if i < ns and (not heap or stream[i] < heap[0]):
                if until is not None and stream[i][0] > until:
                    break
                t, _, kind, payload = stream[i]
                stream[i] = None            # consumed: drop the reference
                self._si = i + 1
            elif heap:
                if until is not None and heap[0][0] > until:
                    break
                t, _, kind, payload = heappop(heap)
            else:
                break
            clock.advance_to(t)
            handlers[kind](payload)
            self.processed += 1
            if stop is not None and stop():
                break
