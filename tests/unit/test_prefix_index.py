"""The router's approximate index of instances' cached prefixes."""

from __future__ import annotations

import pytest

from raycluster.cluster.prefix_index import PrefixIndex, prompt_keys
from raycluster.engine.prefix_cache import PrefixCachingKVManager
from raycluster.request import Request


def test_prompt_keys_are_the_engines_block_keys():
    """What the router hashes is exactly what an engine registers for the same tokens."""
    tokens = list(range(100, 141))                      # 41 tokens, block 8: 5 full blocks
    kv = PrefixCachingKVManager(16, 8)
    req = Request("a", tokens)
    assert kv.try_allocate(req, 41)
    kv.cache_full_blocks(req, 41)
    engine_keys = kv._keys["a"]
    assert prompt_keys(tokens, 8) == engine_keys[:5]
    assert len(prompt_keys(tokens[:40], 8)) == 4        # never the block of the last token


def test_matched_blocks_is_the_longest_recorded_prefix():
    idx = PrefixIndex()
    a = prompt_keys(list(range(64)) + [1], 8)           # 8 blocks
    b = prompt_keys(list(range(32)) + [9] * 33, 8)      # shares the first 4
    idx.record("i1", a, capacity_blocks=100)
    assert idx.matched_blocks("i1", a) == 8
    assert idx.matched_blocks("i1", b) == 4
    assert idx.matched_blocks("i2", a) == 0
    idx.forget("i1")
    assert idx.matched_blocks("i1", a) == 0


def test_capacity_drops_the_least_recently_sent_blocks():
    idx = PrefixIndex()
    a = prompt_keys([1] * 33, 8)                        # 4 blocks
    b = prompt_keys([2] * 33, 8)
    idx.record("i", a, capacity_blocks=6)
    idx.record("i", b, capacity_blocks=6)               # a's first two blocks go
    assert idx.size("i") == 6
    assert idx.matched_blocks("i", b) == 4
    assert idx.matched_blocks("i", a) == 0              # its head is gone, so nothing matches
    idx.record("i", a[:2], capacity_blocks=6)           # a's head sent again: a's tail goes now
    assert idx.matched_blocks("i", a) == 2 and idx.matched_blocks("i", b) == 4


# ---- the router's placement by cached prefix ------------------------------------------------------
from raycluster.clock import VirtualClock  # noqa: E402
from raycluster.cluster.messages import InstanceStats, PrefillDone, RequestMeta, StepReport, TokenEvent  # noqa: E402
from raycluster.cluster.router_core import RouterConfig, RouterCore  # noqa: E402
from raycluster.request import SamplingParams  # noqa: E402

SYSTEM = list(range(1000, 1160))          # 160 shared tokens: 10 blocks of 16


def _stats(iid, caching=True, queued_tokens=0):
    return InstanceStats(instance_id=iid, role="mixed", kv_free_blocks=1000, kv_total_blocks=1000, block_size=16,
                         queued_tokens=queued_tokens, prefix_caching=caching)


def _meta(rid, prompt):
    return RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=list(prompt),
                       sampling=SamplingParams(max_tokens=1))


def _place(core, rid, prompt, backlog=None):
    """Both instances report the given prefill backlogs, then `rid` is submitted (dispatched at
    once) and finishes; returns where it went."""
    backlog = backlog or {}
    for iid, inst in core.instances.items():
        core.on_report(StepReport(_stats(iid, inst.stats.prefix_caching, backlog.get(iid, 0))))
    core.submit(_meta(rid, prompt))
    where = None
    for iid, inst in list(core.instances.items()):
        reply = core.take_outbox(iid)
        if reply.work:
            where = iid
            core.on_report(StepReport(_stats(iid, inst.stats.prefix_caching),
                                      events=[TokenEvent(w.meta.request_id, [5], True, "length") for w in reply.work]))
    assert core.inflight() == 0
    return where


def _core(caching=(True, True), **cfg):
    core = RouterCore(RouterConfig(**cfg), VirtualClock(0.0))
    core.on_poll("i1", _stats("i1", caching[0]))
    core.on_poll("i2", _stats("i2", caching[1]))
    return core


def test_prompts_sharing_a_prefix_follow_it():
    core = _core()
    first = _place(core, "a", SYSTEM + [1, 2, 3])
    # Where the prefix went, though that instance is a little busier (by load alone: the other).
    assert [_place(core, f"q{i}", SYSTEM + [7, i], backlog={first: 20}) for i in range(4)] == [first] * 4
    other = "i2" if first == "i1" else "i1"
    # Nothing of it cached anywhere: the least loaded.
    assert _place(core, "b", list(range(5000, 5100)), backlog={first: 50}) == other


def test_a_busier_instance_wins_only_while_its_backlog_is_below_the_saved_prefix():
    core = _core()
    home = _place(core, "a", SYSTEM + [1])
    other = "i2" if home == "i1" else "i1"
    assert _place(core, "b", SYSTEM + [2], backlog={home: 150}) == home      # 150 < 160 cached
    assert _place(core, "c", SYSTEM + [3], backlog={home: 170}) == other     # 170 > 160


def test_affinity_off_or_no_caching_instances_places_by_load_alone():
    for core in (_core(prefix_affinity=False), _core(caching=(False, False))):
        _place(core, "a", SYSTEM + [1])
        # i1 busier by 10 tokens: load alone sends the next one to i2 whatever it shares.
        assert _place(core, "b", SYSTEM + [2], backlog={"i1": 10}) == "i2"
        assert _place(core, "c", SYSTEM + [3], backlog={"i2": 10}) == "i1"
    assert _core(caching=(False, False)).prefix_index.size("i1") == 0


def test_an_instance_that_leaves_or_registers_again_is_forgotten():
    core = _core()
    home = _place(core, "a", SYSTEM + [1])
    assert core.prefix_index.size(home) == 10
    core.remove_instance(home)
    assert core.prefix_index.size(home) == 0


def test_prompts_in_transit_count_only_their_uncached_part():
    """Several prompts sharing the prefix arrive together: each one sent home adds only its
    own few tokens to home's backlog, so the next one still goes home."""
    core = _core(max_local_waiting=8)
    home = _place(core, "a", SYSTEM + [1])
    for rid in ("b", "c", "d"):
        core.submit(_meta(rid, SYSTEM + [2, 3]))
    assert [w.meta.request_id for w in core.take_outbox(home).work] == ["b", "c", "d"]
    assert core.instances[home].transit_sum(3) == 3 * 2
    for rid in ("b", "c", "d"):
        core.abort(rid)
    assert core.inflight() == 0


def test_the_apps_args_reach_the_router_and_the_engines():
    from deployments.app import router_config
    from deployments.launcher import load_app_spec, override_args
    from raycluster.cluster.config import ClusterConfig

    assert router_config(ClusterConfig()).prefix_affinity is True
    assert router_config(ClusterConfig(prefix_affinity=False)).prefix_affinity is False
    assert router_config(ClusterConfig(decode_affinity_slack=9)).decode_affinity_slack == 9
    cfg = ClusterConfig(engine={"enable_prefix_caching": True}, pools=[{"role": "mixed"}])
    assert cfg.engine_config(cfg.pools[0]).enable_prefix_caching
    for flag in (None, True):       # the shipped default app caches prefixes; `up --enable-prefix-caching`
        cfg = ClusterConfig(**override_args(load_app_spec(None)["args"], None, None, prefix_caching=flag))
        assert all(cfg.engine_config(p).enable_prefix_caching for p in cfg.pools)
    cfg = ClusterConfig(**override_args(load_app_spec(None)["args"], None, None, prefix_caching=False))
    assert not any(cfg.engine_config(p).enable_prefix_caching for p in cfg.pools)     # `--no-enable-prefix-caching`
    # `up --tool-call-parser`: the gateway's tool_choice "auto" parser; the app's own otherwise.
    args = load_app_spec(None)["args"]
    assert ClusterConfig(**override_args(args, None, None, None, "hermes")).tool_call_parser == "hermes"
    assert ClusterConfig(**override_args(args, None, None, None)).tool_call_parser is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        ClusterConfig(**override_args(args, None, None, None, "granite"))


# ---- P/D: a handoff goes to the decode instance holding its conversation ---------------------------
def _pd_stats(iid, role, running=0):
    return InstanceStats(instance_id=iid, role=role, kv_free_blocks=1000, kv_total_blocks=1000, block_size=16,
                         running=running, prefix_caching=True)


def _pd_core(**cfg):
    core = RouterCore(RouterConfig(**cfg), VirtualClock(0.0))
    core.on_poll("p", _pd_stats("p", "prefill-short"))
    for d in ("d1", "d2"):
        core.on_poll(d, _pd_stats(d, "decode"))
    return core


def _pd_turn(core, rid, prompt, output, running=None):
    """`rid` is prefilled on p (its first token output[0], no KV offered: the decode side
    recomputes), handed to a decode instance while d1/d2 report `running` sequences, and
    finishes there with `output`; returns that decode instance."""
    core.submit(RequestMeta(request_id=rid, gateway_id="g", prompt_token_ids=list(prompt),
                            sampling=SamplingParams(max_tokens=len(output), ignore_eos=True)))
    assert [w.meta.request_id for w in core.take_outbox("p").work] == [rid]
    for d in ("d1", "d2"):
        core.on_report(StepReport(_pd_stats(d, "decode", (running or {}).get(d, 0))))
    core.on_report(StepReport(_pd_stats("p", "prefill-short"), prefilled=[PrefillDone(rid, output[0], None)]))
    where = [d for d in ("d1", "d2") if core.take_outbox(d).work]
    assert len(where) == 1
    core.on_report(StepReport(_pd_stats(where[0], "decode"), events=[TokenEvent(rid, output[1:], True, "length")]))
    assert core.inflight() == 0
    return where[0]


def test_a_handoff_follows_its_conversation_to_the_decode_instance_that_holds_it():
    core = _pd_core()
    reply = list(range(2000, 2040))                      # 40 tokens: the reply's blocks count too
    home = _pd_turn(core, "t1", SYSTEM + [1], reply)
    assert home == "d1"                                  # both idle: by id
    turn2 = SYSTEM + [1] + reply + [7, 8, 9]             # the conversation so far, then the user's turn
    keys = prompt_keys(turn2, 16)
    assert core.prefix_index.matched_blocks("d1", keys) == (160 + 1 + 39) // 16   # prompt + reply but its last token
    assert core.prefix_index.matched_blocks("p", keys) == 10                       # the prefill side: the prompt only
    # d1 decodes 4 more sequences than d2 (the slack): the conversation still goes home.
    assert _pd_turn(core, "t2", turn2, [5, 6], running={"d1": 4}) == "d1"
    # 5 more: by load.
    assert _pd_turn(core, "t3", turn2 + [5, 10], [5, 6], running={"d1": 5}) == "d2"


def test_decode_placement_by_load_alone_without_affinity_or_a_cached_prefix():
    core = _pd_core(prefix_affinity=False)
    _pd_turn(core, "t1", SYSTEM + [1], [3, 4, 5])
    assert _pd_turn(core, "t2", SYSTEM + [1, 3, 4, 6], [5, 6], running={"d1": 1}) == "d2"
    core = _pd_core(decode_affinity_slack=0)
    _pd_turn(core, "t1", SYSTEM + [1], [3, 4, 5])                          # d1 holds SYSTEM
    longer = SYSTEM + [1, 3, 4] + list(range(4000, 4040))                  # d1 holds 10 of its blocks
    assert _pd_turn(core, "t2", longer, [5, 6], running={"d1": 1}) == "d2"     # 0 slack: by load
    assert _pd_turn(core, "t3", longer + [5, 8], [5, 6]) == "d2"           # a tie of loads: the longer prefix
    assert _pd_turn(core, "t4", list(range(3000, 3100)), [5, 6], running={"d2": 1}) == "d1"  # nothing cached: load
