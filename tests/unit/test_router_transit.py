"""`Transit` (router_state.py): the in-transit totals dispatch reads follow every mutation the
router makes, and survive copies."""

import copy
import pickle

import pytest

from raycluster.cluster.router_state import Instance, Transit
from raycluster.cluster.messages import InstanceStats


def totals(t: Transit) -> tuple[int, int]:
    return sum(v[2] for v in t.values()), sum(v[3] for v in t.values())


def test_totals_follow_assignment_del_pop_clear():
    t = Transit()
    t["a"] = (0, 0.0, 3, 40)
    t["b"] = (0, 0.0, 5, 60)
    t["a"] = (1, 0.5, 2, 10)                 # overwrite: the old item's share leaves
    assert (t.blocks, t.tokens) == totals(t) == (7, 70)
    del t["b"]
    assert (t.blocks, t.tokens) == totals(t) == (2, 10)
    assert t.pop("missing", None) is None and t.pop("a") == (1, 0.5, 2, 10)
    assert (t.blocks, t.tokens) == (0, 0)
    with pytest.raises(KeyError):
        t.pop("a")
    with pytest.raises(KeyError):
        del t["a"]
    t["c"] = (0, 0.0, 4, 4)
    t.clear()
    assert (t.blocks, t.tokens, len(t)) == (0, 0, 0)
    with pytest.raises(TypeError):
        t.update({"d": (0, 0.0, 1, 1)})     # would bypass the totals


def test_copies_keep_totals_and_instance_sums():
    inst = Instance("i", "mixed", InstanceStats("i", "mixed"), 0.0)
    inst.transit["a"] = (0, 0.0, 3, 40)
    inst.transit["b"] = (2, 1.0, 5, 60)
    for t in (pickle.loads(pickle.dumps(inst.transit)), copy.deepcopy(inst.transit)):
        assert type(t) is Transit and dict(t) == dict(inst.transit) and (t.blocks, t.tokens) == (8, 100)
    assert [inst.transit_sum(k) for k in range(4)] == [2, 1.0, 8, 100]
