"""An instance the pressure controller moves to another pool schedules as that pool's engines do
(deployments/pd.yaml: prefill-short AWD, prefill-long Medha + LARS, decode FCFS + token packer +
Kairos decode batching), with every request carried over: the engine reconfigured mid-run makes
exactly the tokens of an unmoved one (greedy), nothing is lost or duplicated, the prefill backlog
stays exact, waiting requests keep their order. (The simulator's side: test_sim_move.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from raycluster.clock import VirtualClock
from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.sched_factory import build_scheduler, build_scheduling
from raycluster.model.loader import load_model
from raycluster.request import Request, SamplingParams
from raycluster.sched.awd import AWDConfig
from raycluster.sched.base import AllDecodes
from raycluster.sched.kairos_decode import KairosDecodeSelector
from raycluster.sched.medha_packer import MedhaPacker
from raycluster.sched.policies.fcfs import FCFSPolicy
from raycluster.sched.policies.lars import LARSPolicy
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.token_packer import TokenBudgetPacker

PRED = LinearBatchPredictor(overhead_s=0.001, per_prefill_token_s=1e-4, per_decode_s=1e-4)
COMMON = {"kv_cache_tokens": 4096, "chunk_size": 32, "max_num_batched_tokens": 64, "num_threads": 1}
SHORT = EngineConfig(**COMMON, policy="lars", packer="awd")
LONG = EngineConfig(**COMMON, policy="lars", packer="medha")
DECODE = EngineConfig(**COMMON, policy="fcfs", packer="token", decode_selector="kairos", tpot_ms=20.0)
PROMPTS = [[5 + (i * 7 + j) % 60 for j in range(n)] for i, n in enumerate((3, 40, 150, 9, 90, 17, 64, 120))]
SP = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


def _drive(eng: LLMEngine, outs: dict[str, list[int]], finished: list[str], steps: int) -> None:
    """Up to `steps` steps (bounded in wall time too), collecting tokens and finish events."""
    deadline = time.monotonic() + 120
    for _ in range(steps):
        if not eng.has_unfinished() or time.monotonic() > deadline:
            return
        for o in eng.step().outputs:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished.append(o.request_id)


def _moved_run(model, start: EngineConfig, target: EngineConfig) -> tuple[LLMEngine, dict[str, list[int]], list[str]]:
    """Step until some requests decode while others still wait for prefill, then move."""
    eng = LLMEngine(start, model, predictor=PRED)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SP)
    outs: dict[str, list[int]] = {}
    finished: list[str] = []
    sched = eng.scheduler
    deadline = time.monotonic() + 30
    while not (sched.decoding and sched.num_waiting) and time.monotonic() < deadline:
        _drive(eng, outs, finished, 1)
        time.sleep(0.001)               # AWD holds its batch for a wall-clock window
    assert sched.decoding and sched.num_waiting, "no mid-run state to carry over"
    backlog, waiting, running = sched.prefill_backlog, sched.num_waiting, dict(sched.decoding)
    assert eng.reconfigure_scheduling(target)
    assert sched.prefill_backlog == backlog == sched.prefill_backlog_slow()
    assert sched.num_waiting == waiting and sched.decoding == running
    assert sched.packer.num_held() == 0
    _drive(eng, outs, finished, 5000)
    return eng, outs, finished


def _check_same_as_unmoved(model, start: EngineConfig, eng, outs, finished) -> None:
    want = LLMEngine(start, model, predictor=PRED).generate(PROMPTS, SP)
    assert not eng.has_unfinished()
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(PROMPTS)))     # each exactly once
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == want
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and eng.scheduler.prefill_backlog == 0


def test_prefill_long_moved_to_decode_finishes_every_request_with_the_same_tokens(model):
    eng, outs, finished = _moved_run(model, LONG, DECODE)
    s = eng.scheduler
    assert type(s.policy) is FCFSPolicy and type(s.packer) is TokenBudgetPacker
    assert type(s.decode_selector) is KairosDecodeSelector
    assert s.config.max_num_batched_tokens == DECODE.max_num_batched_tokens
    assert eng.config.scheduling_label() == "fcfs/token/kairos" and eng.config.tpot_ms == 20.0
    assert eng.config.kv_cache_tokens == LONG.kv_cache_tokens        # hardware fields stay its own
    _check_same_as_unmoved(model, LONG, eng, outs, finished)


def test_prefill_short_moved_to_long_gives_back_what_awd_held(model):
    # One step: AWD takes the fresh short prompts and holds them for its waiting window.
    eng = LLMEngine(SHORT, model, predictor=PRED)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SP)
    eng.step()
    held = eng.scheduler.packer.num_held()
    assert held > 0
    waiting = eng.scheduler.num_waiting
    assert eng.reconfigure_scheduling(LONG)
    s = eng.scheduler
    assert type(s.policy) is LARSPolicy and type(s.packer) is MedhaPacker and type(s.decode_selector) is AllDecodes
    assert s.packer.num_held() == 0 and len(s.policy) == waiting
    outs: dict[str, list[int]] = {}
    finished: list[str] = []
    _drive(eng, outs, finished, 5000)
    _check_same_as_unmoved(model, SHORT, eng, outs, finished)


def test_short_to_long_mid_run(model):
    eng, outs, finished = _moved_run(model, SHORT, LONG)
    assert type(eng.scheduler.packer) is MedhaPacker
    _check_same_as_unmoved(model, SHORT, eng, outs, finished)


def test_a_missing_predictor_is_obtained_as_at_start(model, tmp_path):
    path = tmp_path / "pred.json"
    path.write_text(json.dumps({"predictor": vars(PRED)}))
    plain = EngineConfig(**COMMON, policy="fcfs", packer="token", predictor="none")
    eng = LLMEngine(plain, model)
    assert eng.predictor is None
    assert eng.reconfigure_scheduling(DECODE.model_copy(update={"predictor": str(path)}))
    assert eng.predictor == PRED and type(eng.scheduler.decode_selector) is KairosDecodeSelector


def test_same_scheduling_changes_nothing(model):
    eng = LLMEngine(LONG, model, predictor=PRED)
    pieces = (eng.scheduler.policy, eng.scheduler.packer, eng.scheduler.decode_selector)
    assert not eng.reconfigure_scheduling(LONG.model_copy(update={"kv_cache_tokens": 999, "seed": 3}))
    assert (eng.scheduler.policy, eng.scheduler.packer, eng.scheduler.decode_selector) == pieces


def test_waiting_requests_keep_the_old_policys_order():
    clock = VirtualClock()
    old = EngineConfig(policy="srpt", packer="token", predictor="none", chunk_size=8)
    sched = build_scheduler(old, KVCacheManager(64, 16), clock, 4096, PRED)
    # Same arrival time: FCFS ties fall back to push order, so the new order shows the old one.
    for i, n in enumerate((50, 10, 40, 20, 30)):
        sched.add_request(Request(f"r{i}", [1] * n, SamplingParams(max_tokens=2), arrival_time=0.0))
    new = build_scheduling(old.with_scheduling_of(DECODE), clock, 4096, PRED)
    sched.reconfigure(new.config, new.policy, new.packer, new.decode_selector)
    order = [sched.policy.pop().request_id for _ in range(5)]
    assert order == ["r1", "r3", "r4", "r2", "r0"]          # srpt's (shortest first), not arrival's


def test_pd_yaml_gives_each_role_its_pools_scheduling():
    app = yaml.safe_load((Path(__file__).parents[2] / "deployments" / "pd.yaml").read_text())
    cfgs = ClusterConfig(**app["applications"][0]["args"]).role_engine_configs()
    assert {r: c.scheduling_label() for r, c in cfgs.items()} == {
        "prefill-short": "lars/awd/all", "prefill-long": "lars/medha/all", "decode": "fcfs/token/kairos"}


def test_a_pool_left_and_rejoined_takes_back_what_its_pieces_learned(model):
    """short -> long -> short (the pressure controller's moves between the prefill pools): the
    AWD packer and policy the instance had come back, with AWD's service-time estimate as it
    had learned it; a decode selector's step-time LUT likewise. Tokens are unchanged."""
    eng = LLMEngine(SHORT, model, predictor=PRED)
    outs: dict[str, list[int]] = {}
    finished: list[str] = []
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SP)
    deadline = time.monotonic() + 30
    awd = eng.scheduler.packer
    while awd.awd.service == AWDConfig().service_s and eng.has_unfinished() and time.monotonic() < deadline:
        _drive(eng, outs, finished, 1)
        time.sleep(0.001)           # AWD holds its batch for a wall-clock window
    learned = awd.awd.service
    assert learned != AWDConfig().service_s, "AWD observed no batch"
    policy = eng.scheduler.policy
    assert eng.reconfigure_scheduling(LONG) and type(eng.scheduler.packer) is MedhaPacker
    medha = eng.scheduler.packer
    assert eng.reconfigure_scheduling(SHORT)
    assert eng.scheduler.packer is awd and eng.scheduler.policy is policy and awd.awd.service == learned
    assert eng.reconfigure_scheduling(LONG) and eng.scheduler.packer is medha     # each kept once
    assert eng.reconfigure_scheduling(DECODE)
    lut = eng.scheduler.decode_selector.lut
    lut.observe(4, 100, 0.5)
    assert eng.reconfigure_scheduling(SHORT) and eng.reconfigure_scheduling(DECODE)
    assert eng.scheduler.decode_selector.lut is lut
    assert len(eng._retired) == 2                                   # SHORT's and LONG's sets
    _drive(eng, outs, finished, 5000)
    _check_same_as_unmoved(model, SHORT, eng, outs, finished)
