"""KineticLineTree (the structure under lars and kairos) against a brute-force argmin.

Lines v_i(t) = sign * (A_i - t) / B_i with integer A, B and times, so exact rational arithmetic
(Fraction) is the reference; few distinct slopes and intercepts make equal slopes, crossings at
query times and exact ties (broken by the tie key) common. The tree is checked after every
operation at a non-decreasing random time, through growth, deletions of winners and of losers,
pops, rebuilds and intercept resets. The policies are also run against the same policy with a brute-force tree.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from raycluster.clock import VirtualClock
from raycluster.request import SLO, Request
from raycluster.sched.base import PolicyContext
from raycluster.sched.policies import common, kairos, lars
from raycluster.sched.policies.common import KineticLineTree
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy


class BruteLineTree:
    """Same interface; `top` is the exact argmin over everything stored."""

    def __init__(self, sign: int = 1, capacity: int = 64) -> None:
        self.sign = 1 if sign >= 0 else -1
        self._items: dict = {}
        self._t = None

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id) -> bool:
        return item_id in self._items

    def _now(self, t):
        if self._t is not None and t < self._t:
            return self._t
        self._t = t
        return t

    def insert(self, item_id, a, b, tie, t) -> None:
        self._now(t)
        self._items[item_id] = (Fraction(a), Fraction(b), tie)

    def delete(self, item_id, t) -> bool:
        self._now(t)
        return self._items.pop(item_id, None) is not None

    def rebuild(self, items, t) -> None:
        self._t = t
        self._items = {i: (Fraction(a), Fraction(b), tie) for i, a, b, tie in items}

    def reset_intercepts(self, items, t) -> None:
        self._t = t
        for i, a in items:
            self._items[i] = (Fraction(a),) + self._items[i][1:]

    def top(self, t):
        t = Fraction(self._now(t))
        if not self._items:
            return None
        return min(self._items, key=lambda i: (self.sign * (self._items[i][0] - t)
                                               / self._items[i][1], self._items[i][2]))

    def pop(self, t):
        item = self.top(t)
        if item is not None:
            del self._items[item]
        return item


def _script(rng: random.Random, steps: int, slopes: list[int]):
    """(op, id, a, b, dt) tuples; ids reused so re-inserts replace a live line."""
    out = []
    for _ in range(steps):
        r = rng.random()
        op = "insert" if r < 0.5 else "delete" if r < 0.65 else "pop" if r < 0.9 else "top"
        if rng.random() < 0.006:
            op = rng.choice(["rebuild", "reset"])
        out.append((op, rng.randrange(250), rng.randrange(-50, 3000), rng.choice(slopes),
                    rng.choice([0, 0, 1, 2, 5, 17, 60])))
    return out


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("seed", range(6))
def test_top_matches_brute_force_at_random_times(sign, seed):
    rng = random.Random(seed * 7919 + sign)
    # Seeds 0-2: slopes over ten octaves (many buckets); 3-5: three slopes (equal-slope ties).
    slopes = [rng.randrange(1, 2048) for _ in range(40)] if seed < 3 else [3, 4, 12]
    fast, brute = KineticLineTree(sign), BruteLineTree(sign)
    t = 0
    ties = {}
    for op, i, a, b, dt in _script(rng, 1500, slopes):
        t += dt
        if op == "insert":
            tie = ties.setdefault(i, (rng.randrange(5), i))     # shared first parts: deep ties
            fast.insert(i, a, b, tie, t)
            brute.insert(i, a, b, tie, t)
        elif op == "delete":
            assert fast.delete(i, t) == brute.delete(i, t)
        elif op == "pop":
            assert fast.pop(t) == brute.pop(t)
        elif op == "rebuild":
            items = [(k, int(v[0]), int(v[1]), v[2]) for k, v in brute._items.items()]
            fast.rebuild(items, t)
            brute.rebuild(items, t)
        elif op == "reset":
            items = [(k, rng.randrange(-50, 3000)) for k in brute._items]
            fast.reset_intercepts(items, t)
            brute.reset_intercepts(items, t)
        assert len(fast) == len(brute)
        assert fast.top(t) == brute.top(t), (op, t)
        probe = t + rng.choice([0, 1, 3, 40])       # a later look, then time continues from it
        t = probe
        assert fast.top(t) == brute.top(t)
    while len(brute):
        t += rng.choice([0, 1, 9])
        assert fast.pop(t) == brute.pop(t)
    assert len(fast) == 0 and fast.top(t) is None


def test_large_burst_then_steady_pops():
    """A 2000-line burst with distinct slopes, then pops and re-inserts with time moving."""
    rng = random.Random(11)
    fast, brute = KineticLineTree(1), BruteLineTree(1)
    for i in range(2000):
        a, b = rng.randrange(0, 10_000), rng.randrange(1, 5000)
        fast.insert(i, a, b, (0, i), 0)
        brute.insert(i, a, b, (0, i), 0)
    t, nxt = 0, 2000
    for _ in range(150):
        t += rng.randrange(0, 40)
        got = fast.pop(t)
        assert got == brute.pop(t)
        a, b = rng.randrange(t, t + 10_000), rng.randrange(1, 5000)
        for tree in (fast, brute):
            tree.insert(nxt, a, b, (t, nxt), t)
            tree.insert(got, a + 7, b, (0, got), t)     # the popped one comes back later-keyed
        nxt += 1
        assert fast.top(t) == brute.top(t)


def test_stale_time_is_clamped():
    tree = KineticLineTree(1)
    tree.insert("a", 100, 1, 0, 0)      # v = 100 - t: falls faster, below b from t = 50
    tree.insert("b", 150, 2, 1, 0)      # v = (150 - t) / 2
    assert tree.top(40) == "b"
    assert tree.top(60) == "a"
    assert tree.top(10) == "a"          # an older time is read as the latest one


def _policy_run(name: str, tree_cls, seed: int) -> list[str]:
    """Random arrivals, chunked progress, removals; returns the pop order."""
    rng = random.Random(seed)
    clock = VirtualClock()
    mod = {"lars": lars, "kairos": kairos}[name]
    saved = mod.KineticLineTree
    mod.KineticLineTree = tree_cls
    try:
        pol = make_policy(name, PolicyContext(clock, LinearBatchPredictor(per_prefill_token_s=1.0)))
    finally:
        mod.KineticLineTree = saved
    order, queued, k = [], {}, 0
    for step in range(500):
        clock.advance(rng.choice([0, 1, 3, 10, 40]))
        for _ in range(rng.choice([0, 0, 1, 1, 2, 5])):
            prompt = rng.choice([8, 16, 64, 64, 300, 1000, 4000])
            ttft = rng.choice([None, 100.0, 2000.0, 8000.0])
            r = Request(f"r{k}", [1] * prompt, arrival_time=clock.now(), slo=SLO(ttft_s=ttft))
            k += 1
            pol.push(r)
            queued[r.request_id] = r
        if queued and rng.random() < 0.05:
            rid = rng.choice(sorted(queued))
            pol.remove(rid)
            pol.on_finish(queued.pop(rid))
        req = pol.pop()
        if req is None:
            continue
        order.append(req.request_id)
        del queued[req.request_id]
        n = min(rng.choice([16, 64, 256]), req.num_uncomputed_tokens)
        req.num_computed_tokens += n
        pol.on_progress(req, n)
        if req.num_uncomputed_tokens:
            pol.push(req)
            queued[req.request_id] = req
        else:
            pol.on_finish(req)
    return order


@pytest.mark.parametrize("name", ["lars", "kairos"])
@pytest.mark.parametrize("seed", range(3))
def test_policy_pops_equal_brute_force_tree(name, seed):
    """The policy's choices with the fast tree equal those with an exact argmin per decision
    (integer times and works: the arithmetic is exact), kairos's periodic rebuild included."""
    assert common.KineticLineTree is KineticLineTree
    assert _policy_run(name, KineticLineTree, seed) == _policy_run(name, BruteLineTree, seed)
