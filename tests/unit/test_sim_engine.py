"""EventLoop: preloaded events run in exactly the order `at` would have given them."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from raycluster.sim.engine import EventLoop

times = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]), min_size=0, max_size=30)


def trace(pre: list[float], preload: bool, stops: list[float]) -> list:
    loop, seen = EventLoop(), []

    def on_a(p):
        seen.append(("a", p, loop.clock.now()))
        if p % 3 == 0:              # handlers schedule more events, some at the same time
            loop.after(0.5 * (p % 2), "b", p)

    loop.on("a", on_a)
    loop.on("b", lambda p: seen.append(("b", p, loop.clock.now())))
    loop.at(1.0, "b", -1)           # scheduled before the preloaded ones: earlier seq
    evs = [(t, "a", i) for i, t in enumerate(pre)]
    if preload:
        loop.preload(evs)
    else:
        for ev in evs:
            loop.at(*ev)
    for u in stops:                 # runs stopped and resumed at `until`
        loop.run(until=u)
        seen.append(("stop", u, len(loop)))
    loop.run()
    return seen


@settings(max_examples=80)
@given(times, st.lists(st.sampled_from([0.5, 1.0, 2.5]), max_size=3))
def test_preload_equals_at(pre, stops):
    assert trace(pre, True, sorted(stops)) == trace(pre, False, sorted(stops))
