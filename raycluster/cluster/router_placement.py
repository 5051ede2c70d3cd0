"""Where a request fits: the router's per-instance arithmetic for dispatch (pure functions).

Inputs are the router's own records (`Instance`, `ReqState`, its request table) and two config
values; nothing is mutated but a request's memoised prompt keys and the prefix index on `sent`.
`RouterCore.dispatch` keeps the instances that `has_slot` and that a request `fits`, fails a
request that `never_fits` anywhere, and `pick`s the smallest `load_key`, where a prompt's prefix
that an instance probably has cached (`PrefixIndex`) does not count as work there. A handoff
goes to the decode instance holding most of its prompt (its KV need not move) unless that one
decodes more than `decode_slack` sequences beyond the least loaded (`pick_decode`).
The index learns from `sent` (a prompt computed or received there) and `finished` (the blocks
of prompt + output a request leaves cached where it ran).
"""

from __future__ import annotations

import math

from raycluster.cluster.prefix_index import PrefixIndex, extend_keys, prompt_keys
from raycluster.cluster.router_state import Instance, ReqState


def blocks_needed(st: ReqState, inst: Instance) -> int:
    """KV blocks the request takes on that instance: prompt, delivered tokens and the next one."""
    return math.ceil((len(st.meta.prompt_token_ids) + len(st.delivered) + 1) / max(1, inst.stats.block_size))


def has_slot(inst: Instance, max_local_waiting: int) -> bool:
    """Room for one more not-yet-started request (reported waiting + in transit + in its outbox)."""
    return inst.stats.waiting + len(inst.transit) + len(inst.outbox.work) < max_local_waiting


def with_slot(insts: list[Instance], max_local_waiting: int) -> list[Instance]:
    """The instances that `has_slot` (its test inlined: dispatch asks it of a whole pool per call),
    draining ones excepted."""
    return [i for i in insts if i.stats.waiting + len(i.transit) + len(i.outbox.work) < max_local_waiting
            and not i.draining]


def kv_free(inst: Instance, requests: dict[str, ReqState], reserve_frac: float) -> float:
    """Free blocks after what is in transit and in its outbox, minus the reserve."""
    s, work = inst.stats, inst.outbox.work
    pending = sum(blocks_needed(requests[w.meta.request_id], inst) for w in work
                  if w.meta.request_id in requests) if work else 0     # (usually empty: skip the generator)
    return s.kv_free_blocks - inst.transit_sum(2) - pending - reserve_frac * s.kv_total_blocks


def fits(st: ReqState, inst: Instance, requests: dict[str, ReqState], reserve_frac: float) -> bool:
    if inst.stats.kv_total_blocks <= 0:
        return True     # instance reported no KV figures yet: trust its own admission
    return kv_free(inst, requests, reserve_frac) >= blocks_needed(st, inst)


def never_fits(st: ReqState, inst: Instance, reserve_frac: float) -> bool:
    return tokens_never_fit(len(st.meta.prompt_token_ids) + len(st.delivered), inst, reserve_frac)


def tokens_never_fit(num_tokens: int, inst: Instance, reserve_frac: float) -> bool:
    """A request of `num_tokens` known tokens cannot fit the instance's KV even when it is empty."""
    total = inst.stats.kv_total_blocks * (1 - reserve_frac)
    return 0 < total < math.ceil((num_tokens + 1) / max(1, inst.stats.block_size))


def load_key(inst: Instance, requests: dict[str, ReqState], reserve_frac: float, cached_tokens: int = 0) -> tuple:
    """Least-loaded first: prefill tokens ahead of a new request (reported backlog + sent, not yet
    seen) minus the request's own tokens it would find cached there, then queued requests,
    running ones, free KV. Tokens lead because a short prompt placed behind one 40K-token prompt
    waits far longer than behind three short ones."""
    s = inst.stats
    return (backlog_tokens(inst, requests) - cached_tokens,
            s.waiting + len(inst.transit) + len(inst.outbox.work), s.running,
            -kv_free(inst, requests, reserve_frac), inst.instance_id)


def backlog_tokens(inst: Instance, requests: dict[str, ReqState]) -> int:
    """Prompt tokens the instance has still to prefill: its reported backlog, plus the items it
    was sent that its stats do not show yet (in transit) and those in its outbox."""
    work = inst.outbox.work
    pend_tok = sum(prefill_tokens(w.meta, requests) for w in work) if work else 0
    return inst.stats.queued_tokens + inst.transit_sum(3) + pend_tok


def prefill_tokens(meta, requests: dict[str, ReqState]) -> int:
    """Prompt tokens a handed-out item will compute: its prompt less what it probably finds cached."""
    st = requests.get(meta.request_id)
    return len(meta.prompt_token_ids) - (st.cached_tokens if st is not None else 0)


def _keys(st: ReqState, block_size: int) -> list:
    if st.prefix_keys is None or st.prefix_keys[0] != block_size:
        st.prefix_keys = (block_size, prompt_keys(st.meta.prompt_token_ids, block_size,
                                                  st.meta.sampling.lora_adapter, st.meta.sampling.images))
    return st.prefix_keys[1]


def cached_tokens(st: ReqState, inst: Instance, index: PrefixIndex) -> int:
    """Tokens of `st`'s prompt that `inst` probably has in its prefix cache."""
    if not inst.stats.prefix_caching:
        return 0
    bs = max(1, inst.stats.block_size)
    return index.matched_blocks(inst.instance_id, _keys(st, bs)) * bs


def pick(st: ReqState, fit: list[Instance], requests: dict[str, ReqState], reserve_frac: float,
         index: PrefixIndex | None, decode_slack: int = 0) -> Instance:
    """The instance to run `st`: the smallest `load_key`, with prefix affinity when `index` is
    given (a tie between idle instances goes to the one holding the longest prefix; a busier
    one wins only while its extra backlog is smaller than the prefix it saves). Decode
    instances (a queue's candidates share one role) go by `pick_decode`."""
    if index is None or not any(i.stats.prefix_caching for i in fit):
        return min(fit, key=lambda i: load_key(i, requests, reserve_frac))
    if fit[0].role == "decode":
        return pick_decode(st, fit, min(fit, key=lambda i: load_key(i, requests, reserve_frac)), index, decode_slack)
    return min(fit, key=lambda i: load_key(i, requests, reserve_frac, cached_tokens(st, i, index)))


def decode_load(inst: Instance) -> int:
    """Sequences a decode instance has or will have: running, waiting, handed out, in its outbox."""
    return inst.stats.running + inst.stats.waiting + len(inst.transit) + len(inst.outbox.work)


def pick_decode(st: ReqState, fit: list[Instance], least: Instance, index: PrefixIndex, slack: int) -> Instance:
    """A handoff's decode instance: the one with the longest cached prefix of its prompt (the
    blocks it holds are not pulled again; in multi-turn chat, the previous turn's conversation)
    among those decoding at most `slack` more sequences than `least`; `least` if none holds any.
    Prefill placement weighs a prefix against a token backlog; a decode instance's cost is one
    more sequence per step, so the bound is in sequences (SGLang's router balances the same way)."""
    bound = decode_load(least) + slack
    best, best_tokens = least, cached_tokens(st, least, index)
    for inst in fit:
        if inst is not least and decode_load(inst) <= bound:
            n = cached_tokens(st, inst, index)
            if n > best_tokens:
                best, best_tokens = inst, n
    return best


def sent(index: PrefixIndex, st: ReqState, inst: Instance, mode: str) -> None:
    """Note what `st` probably finds cached on `inst` (prefill work saved; none for a handoff,
    which computes no prompt), then remember that `inst` will cache `st`'s prompt: it computes
    it, or (decode) receives its KV and registers it."""
    st.cached_tokens = 0
    if inst.stats.prefix_caching:
        if mode != "decode":
            st.cached_tokens = cached_tokens(st, inst, index)
        index.record(inst.instance_id, _keys(st, max(1, inst.stats.block_size)), inst.stats.kv_total_blocks)


def finished(index: PrefixIndex, st: ReqState, inst: Instance | None) -> None:
    """`st` ends while running on `inst`: the engine keeps the full blocks of its prompt and
    output it computed (all but the last token's) cached, so the next turn of a conversation,
    which repeats them, can find its reply there too."""
    if inst is None or not inst.stats.prefix_caching or not st.delivered:
        return      # (a handoff still queued for decode: `inst` is its prefill instance, which
        #             computed the prompt, i.e. prompt + first token less the last token)
    bs = max(1, inst.stats.block_size)
    keys = extend_keys(_keys(st, bs), st.meta.prompt_token_ids + st.delivered, bs, st.meta.sampling.lora_adapter,
                       st.meta.sampling.images)
    index.record(inst.instance_id, keys, inst.stats.kv_total_blocks)
