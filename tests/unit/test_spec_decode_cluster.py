"""Speculative decoding inside a cluster instance: an instance worker's engine that drafts sends
several tokens per event, equal to plain decoding, and its draft counters reach the instance
stats, the router's status, `raycluster status`'s table and the gateway's /metrics; a single
engine's /metrics text carries them too."""

from __future__ import annotations

import time

from test_spec_decode import OracleProposer

from raycluster.cli_status import format_status
from raycluster.cluster.client import ClusterClient
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.messages import PollReply, RequestMeta, WorkItem
from raycluster.cluster.router_state import Instance, instance_summary
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams
from raycluster.server.async_engine import AsyncEngine

CFG = dict(policy="fcfs", packer="token", predictor="none", kv_cache_tokens=4096)
PROMPT = [11, 305, 2024, 77, 1500, 9, 3000]
SP = SamplingParams(max_tokens=24, ignore_eos=True)


def _plain(loaded) -> list[int]:
    model, tok = loaded
    return LLMEngine(EngineConfig(**CFG), model, tok).generate([PROMPT], SP)[0]


def test_a_drafting_instance_streams_runs_of_tokens_and_reports_its_drafts(loaded):
    model, _ = loaded
    want = _plain(loaded)
    events = []
    eng = LLMEngine(EngineConfig(**CFG, speculative_method="ngram"), model)
    eng.proposer = OracleProposer({tuple(PROMPT): want})
    w = InstanceWorker(eng, "decode", "i0", poll_fn=lambda *a: PollReply(),
                       push_fn=lambda r: events.extend(r.events))
    w._apply(PollReply(work=[WorkItem(RequestMeta("a", "g", PROMPT, SP, arrival_time=time.time()))]))
    for _ in range(100):
        if not eng.has_unfinished():
            break
        w._step()
    events = [e for _ in range(w._reports.qsize()) for e in w._reports.get_nowait().events]
    assert [t for e in events for t in e.token_ids] == want
    assert max(len(e.token_ids) for e in events) > 1
    st = w.stats()
    assert st.spec_draft_tokens == eng.spec.draft_tokens > 0
    assert 0 < st.spec_accepted_tokens == eng.spec.accepted_tokens <= st.spec_draft_tokens
    # vLLM's per-position counts: runs whose draft j + 1 was kept (never more than for draft j).
    per_pos = st.spec_accepted_per_pos
    assert 0 < st.spec_drafts == eng.spec.drafts and sum(per_pos) == st.spec_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= st.spec_drafts
    summary = instance_summary(Instance("i0", "decode", st, time.monotonic()), time.monotonic())
    table = format_status({"instances": [summary]})
    by_pos = " ".join(f"{c / st.spec_drafts:.0%}" for c in per_pos)
    assert f"draft tokens: {st.spec_draft_tokens}, {st.spec_accepted_tokens / st.spec_draft_tokens:.1%} accepted; " \
           f"by position {by_pos}" in table
    client = ClusterClient(submit=None, abort=None, pull=None, status=None, tokenizer=None, max_model_len=64,
                           vocab_size=10, eos_token_ids=(), gateway_id="g")
    client._last_status = {"instances": [summary]}
    assert client.stats()["spec_accepted_per_pos"] == per_pos and client.stats()["spec_runs"] == st.spec_drafts
    text = client.prometheus_text()
    assert f'raycluster_instance_spec_decode_draft_tokens_total{{instance="i0",pool="decode"}} ' \
           f'{st.spec_draft_tokens}' in text
    assert f'raycluster_instance_spec_decode_accepted_tokens_total{{instance="i0",pool="decode"}} ' \
           f'{st.spec_accepted_tokens}' in text


def test_a_single_engines_metrics_count_drafts(loaded):
    model, tok = loaded
    want = _plain(loaded)
    eng = LLMEngine(EngineConfig(**CFG, speculative_method="ngram"), model, tok)
    eng.proposer = OracleProposer({tuple(PROMPT): want})
    assert eng.generate([PROMPT], SP)[0] == want
    server = AsyncEngine(eng)
    try:
        text = server.prometheus_text()
    finally:
        server.shutdown()
    assert f"raycluster_spec_decode_draft_tokens_total {eng.spec.draft_tokens}" in text and eng.spec.draft_tokens
    assert f"raycluster_spec_decode_accepted_tokens_total {eng.spec.accepted_tokens}" in text
    plain = AsyncEngine(LLMEngine(EngineConfig(**CFG), model, tok))
    try:
        assert "spec_decode" not in plain.prometheus_text()
    finally:
        plain.shutdown()
