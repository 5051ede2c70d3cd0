"""Where a request fits: the router's per-instance arithmetic for dispatch (pure functions).

Inputs are the router's own records (`Instance`, `ReqState`, its request table) and two config
values; nothing is mutated. `RouterCore.dispatch` keeps the instances that `has_slot` and that a
request `fits`, fails a request that `never_fits` anywhere, and picks the smallest `load_key`.
"""

from __future__ import annotations

import math

from raycluster.cluster.router_state import Instance, ReqState


def blocks_needed(st: ReqState, inst: Instance) -> int:
    """KV blocks the request takes on that instance: prompt, delivered tokens and the next one."""
    return math.ceil((len(st.meta.prompt_token_ids) + len(st.delivered) + 1) / max(1, inst.stats.block_size))


def has_slot(inst: Instance, max_local_waiting: int) -> bool:
    """Room for one more not-yet-started request (reported waiting + in transit + in its outbox)."""
    return inst.stats.waiting + len(inst.transit) + len(inst.outbox.work) < max_local_waiting


def kv_free(inst: Instance, requests: dict[str, ReqState], reserve_frac: float) -> float:
    """Free blocks after what is in transit and in its outbox, minus the reserve."""
    s = inst.stats
    pending = sum(blocks_needed(requests[w.meta.request_id], inst) for w in inst.outbox.work
                  if w.meta.request_id in requests)
    return s.kv_free_blocks - inst.transit_sum(2) - pending - reserve_frac * s.kv_total_blocks


def fits(st: ReqState, inst: Instance, requests: dict[str, ReqState], reserve_frac: float) -> bool:
    if inst.stats.kv_total_blocks <= 0:
        return True     # instance reported no KV figures yet: trust its own admission
    return kv_free(inst, requests, reserve_frac) >= blocks_needed(st, inst)


def never_fits(st: ReqState, inst: Instance, reserve_frac: float) -> bool:
    total = inst.stats.kv_total_blocks * (1 - reserve_frac)
    return 0 < total < blocks_needed(st, inst)


def load_key(inst: Instance, requests: dict[str, ReqState], reserve_frac: float) -> tuple:
    """Least-loaded first: prefill tokens ahead of a new request (reported backlog + sent, not yet
    seen), then queued requests, running ones, free KV. Tokens lead because a short prompt placed
    behind one 40K-token prompt waits far longer than behind three short ones."""
    s = inst.stats
    pend_tok = sum(len(w.meta.prompt_token_ids) for w in inst.outbox.work)
    return (s.queued_tokens + inst.transit_sum(3) + pend_tok,
            s.waiting + len(inst.transit) + len(inst.outbox.work), s.running,
            -kv_free(inst, requests, reserve_frac), inst.instance_id)
