"""Every router policy survives what validation lets through: extreme SLOs, priorities and
tenants, random lengths, aborts at any point. Seeded; no Ray, no model.

A P/D router (short and long prefill pools, a decode pool) on a virtual clock gets requests the
gateway would accept, in random order with random instance progress; afterwards nothing is left
in flight and no queue holds anything.
"""

from __future__ import annotations

import random

import pytest

from raycluster.clock import VirtualClock
from raycluster.cluster.messages import InstanceStats, PrefillDone, RequestMeta, StepReport, TokenEvent
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.request import SamplingParams
from raycluster.sched.registry import policy_names

ROLES = {"ps": "prefill-short", "pl": "prefill-long", "d": "decode"}
SLOS = [None, 5e-324, 1e-9, 0.5, 1e300]
PRIORITIES = [0, 1, -1, 2**63, -2**63, 10**30]
TENANTS = ["default", "", "\ud800", "t" * 5000, "a", "b"]


def _stats(iid: str) -> InstanceStats:
    return InstanceStats(instance_id=iid, role=ROLES[iid], kv_free_blocks=4096, kv_total_blocks=4096, block_size=16)


def _meta(rng: random.Random, i: int) -> RequestMeta:
    n = rng.choice([1, 2, 17, 300, 2000, 9000])
    return RequestMeta(request_id=f"r{i}", gateway_id=rng.choice(["g1", "g2"]),
                       prompt_token_ids=[rng.randrange(1000) for _ in range(n)],
                       sampling=SamplingParams(max_tokens=rng.choice([1, 2, 5, 40])),
                       ttft_slo_s=rng.choice(SLOS), tpot_slo_s=rng.choice(SLOS), priority=rng.choice(PRIORITIES),
                       tenant=rng.choice(TENANTS), app_id=rng.choice([None, "", "app", "\ud800"]),
                       arrival_time=rng.choice([0.0, 1e9, -1.0]))


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_drains_whatever_the_gateway_lets_through(policy):
    rng, clock = random.Random(7), VirtualClock(0.0)
    core = RouterCore(RouterConfig(policy=policy, max_queue=64, max_local_waiting=4), clock)
    for iid in ROLES:
        core.on_poll(iid, _stats(iid))
    held: dict[str, list] = {iid: [] for iid in ROLES}       # work each instance has taken
    sent, ends = 0, {}
    for _ in range(3000):
        if sent >= 120 and not core.inflight():
            break
        clock.advance(rng.choice([0.0, 0.001, 0.05, 2.0]))
        roll = rng.random()
        if sent < 120 and roll < 0.35:
            core.submit(_meta(rng, sent))
            sent += 1
        elif roll < 0.4 and core.requests:
            core.abort(rng.choice(sorted(core.requests)))
        else:
            iid = rng.choice(list(ROLES))
            held[iid].extend(core.take_outbox(iid).work)
            held[iid] = [w for w in held[iid] if w.meta.request_id in core.requests]
            if not held[iid]:
                core.on_report(StepReport(_stats(iid)))
                continue
            w = held[iid].pop(rng.randrange(len(held[iid])))
            rid = w.meta.request_id
            if w.mode == "prefill":         # its first token; the decode side recomputes (no KV offered)
                core.on_report(StepReport(_stats(iid), prefilled=[PrefillDone(rid, 3, None)]))
            else:
                rest = w.meta.sampling.max_tokens - len(w.output_token_ids)
                core.on_report(StepReport(_stats(iid), events=[TokenEvent(rid, [3] * rest, True, "length")]))
        for gid in ("g1", "g2"):
            for ev in core.take_events(gid).events:
                if ev.finished:
                    ends[ev.finish_reason] = ends.get(ev.finish_reason, 0) + 1
    else:
        pytest.fail(f"{policy}: did not drain ({core.inflight()} in flight)")
    assert core.inflight() == 0 and core.queue_depth() == 0
    # Most ran to the end (through a handoff when longer than one token), the rest were aborted.
    assert ends.get("length", 0) >= 60, ends
    assert all(len(core.policies[q]) == 0 for q in core.policies)
