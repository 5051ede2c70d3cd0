"""The router's side of pool autoscaling: the load numbers Serve's policy sizes a pool by
(raycluster.cluster.autoscale), read from a `RouterCore`'s state, nothing mutated.

`instance_stats` answers a replica's `record_autoscaling_stats` (its own load plus its pool's
router queue); `pool_stats` answers the policy's probe for a pool with no running replica (the
same numbers summed over the pool's registered instances). Requests are counted in requests and
in prompt tokens still to prefill; a request is counted once, queued for the pool or on one
instance.
"""

from __future__ import annotations

from raycluster.cluster.autoscale import INSTANCE_LOAD, INSTANCE_TOKENS, POOL_QUEUE, POOL_QUEUE_TOKENS
from raycluster.cluster.router_placement import backlog_tokens


def queued_for(core, role: str) -> tuple[int, int]:
    """(requests, prompt tokens) waiting in the router's queues pool `role` serves. A queue no
    live instance serves counts for the pool it is named after (a pool at zero instances, or one
    whose instances are all gone, is sized by its own queue). Tokens: prompt plus delivered
    tokens of each queued prompt (a resumed request recomputes both); handoffs waiting for a
    decode pool count no prefill tokens."""
    n = tokens = 0
    for q in core.policies:                 # one policy per queue
        if role not in (core.pools.serving_roles(q) or (q,)):
            continue
        n += len(core.policies[q]) + len(core.front[q])
        if q != "decode":
            # Only queued states: `front` may hold ids of requests that have moved on since.
            tokens += sum(len(st.meta.prompt_token_ids) + len(st.delivered)
                          for st in core.requests.values() if st.queue == q)
    return n, tokens


def instance_stats(core, instance_id: str, role: str) -> dict[str, float]:
    """An autoscaled pool replica's signal: the requests handed to `instance_id` and not done
    there (queued, prefilling or decoding on it; 0 before it first polls), the prefill tokens it
    still has to compute (its reported backlog plus what it was handed and does not report yet),
    and its pool's router queue in requests and tokens."""
    inst = core.instances.get(instance_id)
    role = inst.role if inst is not None else role
    queued, queued_tokens = queued_for(core, role)
    return {INSTANCE_LOAD: float(len(inst.running)) if inst is not None else 0.0, POOL_QUEUE: float(queued),
            INSTANCE_TOKENS: float(backlog_tokens(inst, core.requests)) if inst is not None else 0.0,
            POOL_QUEUE_TOKENS: float(queued_tokens)}


def pool_stats(core, role: str) -> dict[str, float]:
    """The whole pool `role` as the router sees it: `instance_stats`' instance numbers summed
    over its registered instances (a replica Serve still counts as starting may poll already),
    and its queue."""
    queued, queued_tokens = queued_for(core, role)
    insts = [i for i in core.instances.values() if i.role == role]
    return {INSTANCE_LOAD: float(sum(len(i.running) for i in insts)), POOL_QUEUE: float(queued),
            INSTANCE_TOKENS: float(sum(backlog_tokens(i, core.requests) for i in insts)),
            POOL_QUEUE_TOKENS: float(queued_tokens)}
