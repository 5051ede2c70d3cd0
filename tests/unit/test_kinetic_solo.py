"""KineticLineTree's lone item (`_solo`): an item inserted into an empty tree waits outside the
arrays until another operation needs them. Against a tree that places every item at once (the
behaviour before), every answer is the same and, once the lone item is placed, so is every
live entry of the arrays: slots, free lists, and each non-empty node's winner, claim, slope
minimum and claim time. Operations keep the tree small so that it empties often."""

from __future__ import annotations

import copy
import random

import pytest

from raycluster.sched.policies.kinetic import KineticLineTree


class PlacedAtOnce(KineticLineTree):
    """The tree without the lone-item shortcut: a lone item is placed as it is inserted."""

    def insert(self, item_id, a, b, tie, t) -> None:
        super().insert(item_id, a, b, tie, t)
        if self._solo is not None:
            self._place_solo()


def live_state(tree: KineticLineTree) -> dict:
    tree = copy.deepcopy(tree)
    if tree._solo is not None:
        tree._place_solo()
    nodes = {n: (tree._win[n], tree._melt[n], tree._smin[n], tree._tl[n] if n < tree._cap else None)
             for n in range(1, 2 * tree._cap) if tree._win[n] >= 0}
    empty = [n for n in range(1, 2 * tree._cap) if tree._win[n] < 0
             and (tree._melt[n], tree._smin[n]) != (float("inf"), float("inf"))]
    lines = {i: (tree._a[i], tree._b[i], tree._s[i], tree._tie[i], tree._id[i]) for i in tree._slot.values()}
    return {"slot": tree._slot, "spare": tree._spare, "free": list(tree._free.items()), "cap": tree._cap,
            "nodes": nodes, "empty_not_reset": empty, "lines": lines, "t": tree._t}


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("seed", range(3))
def test_lone_item_changes_no_answer_and_no_live_state(sign, seed):
    rng = random.Random(seed * 31 + sign)
    fast, ref = KineticLineTree(sign), PlacedAtOnce(sign)
    t, lone = 0.0, 0
    for step in range(1500):
        t += rng.choice([0.0, 0.0, 0.001, 0.01, 0.3])
        r, i = rng.random(), rng.randrange(6)
        if r < 0.35 or len(ref) == 0:
            a, b = rng.uniform(-5, 20), rng.choice([0.01, 0.02, 0.5, 3.0, rng.uniform(0.001, 4)])
            tie = (rng.randrange(2), i)
            fast.insert(i, a, b, tie, t)
            ref.insert(i, a, b, tie, t)
            lone += fast._solo is not None
        elif r < 0.55:
            assert fast.delete(i, t) == ref.delete(i, t)
        elif r < 0.9:
            assert fast.pop(t) == ref.pop(t)
        elif r < 0.97:
            items = [(k, rng.uniform(-5, 20)) for k in list(ref._slot)]
            fast.reset_intercepts(items, t)
            ref.reset_intercepts(items, t)
        else:
            items = [(k, rng.uniform(-5, 20), rng.uniform(0.01, 3), (0, k)) for k in range(rng.randrange(4))]
            fast.rebuild(items, t)
            ref.rebuild(items, t)
        assert len(fast) == len(ref) and all((k in fast) == (k in ref) for k in range(6))
        assert fast.top(t) == ref.top(t), step
        assert live_state(fast) == live_state(ref), step
    assert lone > 20       # the shortcut was taken (and then popped, deleted, or placed)
