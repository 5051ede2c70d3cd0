"""The discrete-event loop: a virtual clock and a heap of timed events.

Events are (time, seq, kind, payload) tuples in a heap. Tie-break: events at the same virtual
time run in the order they were scheduled (`seq` is a global insertion counter), so a run is a
pure function of the spec, the workload and the seed -- no wall-clock time, no hash order, no
randomness inside the simulator. Handlers are plain callables registered per kind.
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

    def on(self, kind: str, handler: Callable[[Any], None]) -> None:
        self.handlers[kind] = handler

    def at(self, t: float, kind: str, payload: Any = None) -> None:
        if t < self.clock.now():
            t = self.clock.now()
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def after(self, dt: float, kind: str, payload: Any = None) -> None:
        self.at(self.clock.now() + max(0.0, dt), kind, payload)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        heap, handlers, clock = self._heap, self.handlers, self.clock
        while heap:
            if until is not None and heap[0][0] > until:
                break
            t, _, kind, payload = heapq.heappop(heap)
            clock.advance_to(t)
            handlers[kind](payload)
            self.processed += 1
            if stop is not None and stop():
                break
