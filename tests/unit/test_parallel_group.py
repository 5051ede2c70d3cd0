"""The group collective over gloo (ranks as threads): plans of any size reach every rank intact
and in order, all_gather is in rank order, and the serve loop ends on None."""

from __future__ import annotations

import torch

from raycluster.parallel.group import PLAN_BUFFER_BYTES, Collective, GroupAddress, ThreadRanks, free_port


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
            assert lead.broadcast_plan(p) is p
            assert lead.all_gather(torch.tensor([0.0])).flatten().tolist() == [0.0, 10.0, 20.0]
    finally:
        lead.broadcast_plan(None)
        ranks.join(10)
    assert ranks.errors == [] and not ranks.alive()
    for r in (1, 2):
        assert [p for p, _ in seen[r]] == plans
        assert all(g == [0.0, 10.0, 20.0] for _, g in seen[r])
