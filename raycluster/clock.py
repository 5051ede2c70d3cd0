"""Clocks: the one source of "now" for schedulers, so the real engine and the simulator share code.

`WallClock` reads time.monotonic(); `VirtualClock` is advanced explicitly by the simulator.
Both return seconds as floats.
"""

from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back: {t} < {self._now}")
        self._now = t

    def advance(self, dt: float) -> None:
        self.advance_to(self._now + dt)
