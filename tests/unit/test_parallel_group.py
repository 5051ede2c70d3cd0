"""The group collective over gloo (ranks as threads): plans of any size reach every rank intact
and in order along the chain, all_gather is in rank order, and the serve loop ends on None."""

from __future__ import annotations

import pytest
import torch

from raycluster.parallel.group import PLAN_BUFFER_BYTES, Collective, GroupAddress, ThreadRanks
from raycluster.ports import free_port


def test_plans_small_and_larger_than_the_buffer_reach_every_rank(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 3, timeout_s=20)
    seen: dict[int, list] = {1: [], 2: []}

    def make_run(coll):
        def run(plan):
            seen[coll.rank].append((plan, coll.all_gather(torch.tensor([coll.rank * 10.0])).flatten().tolist()))
        return run

    ranks = ThreadRanks(addr, make_run)
    lead = Collective(addr, 0)
    big = list(range(PLAN_BUFFER_BYTES))        # pickles to several times the buffer
    plans = ["a", {"x": [1, 2]}, big, 7]
    try:
        assert ranks.alive()
        for p in plans:
            lead.post_plan(p)
            assert lead.all_gather(torch.tensor([0.0])).flatten().tolist() == [0.0, 10.0, 20.0]
    finally:
        lead.post_plan(None)
        ranks.join(10)
    assert ranks.errors == [] and not ranks.alive()
    for r in (1, 2):
        assert [p for p, _ in seen[r]] == plans
        assert all(g == [0.0, 10.0, 20.0] for _, g in seen[r])


def test_all_gather_over_some_ranks_leaves_the_others_out(monkeypatch):
    """Each plan names the ranks that gather (rank 0 always); a rank left out only relays the
    plan, and a later full gather still pairs the right messages."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 4, timeout_s=20)
    seen: dict[int, list] = {1: [], 2: [], 3: []}

    def make_run(coll):
        def run(ranks):
            if coll.rank in ranks:
                seen[coll.rank].append(coll.all_gather(torch.tensor([coll.rank * 10.0]), ranks).flatten().tolist())
        return run

    threads = ThreadRanks(addr, make_run)
    lead = Collective(addr, 0)
    plans = [[0, 2], [0, 1, 3], [0, 3], [0, 1, 2, 3], [0, 2, 3]]
    try:
        for ranks in plans:
            lead.post_plan(ranks)
            assert lead.all_gather(torch.tensor([0.0]), ranks).flatten().tolist() == [r * 10.0 for r in ranks]
        with pytest.raises(ValueError, match="without being among them"):
            lead.all_gather(torch.tensor([0.0]), [1, 2])
    finally:
        lead.post_plan(None)
        threads.join(10)
    assert threads.errors == [] and not threads.alive()
    for r in (1, 2, 3):
        assert seen[r] == [[x * 10.0 for x in ranks] for ranks in plans if r in ranks]


def test_posting_does_not_wait_for_a_busy_rank(monkeypatch):
    """What lets SPP chunks stream across engine steps: the leader posts the next messages while
    rank 1 is still working on an earlier one, and they arrive in order."""
    import time

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    addr = GroupAddress("127.0.0.1", free_port("127.0.0.1"), 2, timeout_s=20)
    seen = []

    def make_run(coll):
        def run(plan):
            time.sleep(0.3)
            seen.append(plan)
        return run

    ranks = ThreadRanks(addr, make_run)
    lead = Collective(addr, 0)
    try:
        t0 = time.monotonic()
        for i in range(4):
            lead.post_plan({"step": i, "table": list(range(100))})
        posting = time.monotonic() - t0
    finally:
        lead.post_plan(None)
        lead.flush()
        ranks.join(10)
    assert posting < 0.25, posting          # rank 1 needs 1.2 s to get through them
    assert [p["step"] for p in seen] == [0, 1, 2, 3] and ranks.errors == []
