"""A sliding-window model's out-of-reach KV blocks given back as requests advance
(raycluster.engine.window_kv): which blocks go when, a null block standing in their table entries,
consistent bookkeeping through forks and frees; on an engine, greedy tokens equal transformers'
while a long request holds about window / block_size blocks, two requests longer than the whole
pool run side by side without preemption, and a tp 2 group does the same."""

from __future__ import annotations

import pytest
import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.window_kv import SlidingWindowKVManager
from raycluster.model import write_tiny_model
from raycluster.model.loader import load_model
from raycluster.parallel.factory import releasable_window
from raycluster.request import Request, RequestStatus, SamplingParams

WINDOW, BS = 24, 4
BASE = dict(policy="fcfs", packer="token", predictor="none", num_threads=1, block_size=BS, chunk_size=16)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("mistral-window"), seed=2, architectures=["MistralForCausalLM"],
                            sliding_window=WINDOW, num_hidden_layers=2)
    return path, load_model(path)[0]


@pytest.fixture(scope="module")
def hf_greedy(mistral):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral[0], dtype=torch.float32,
                                                           attn_implementation="eager").eval()

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return seq[0, len(prompt):].tolist()
    return run


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 4000, (n,), generator=g).tolist()


def test_blocks_before_the_window_go_back_and_the_table_keeps_its_length():
    kv = SlidingWindowKVManager(num_blocks=20, block_size=4, window=6)
    assert (kv.num_blocks, kv.num_free_blocks, kv.capacity_tokens()) == (19, 19, 76)
    req = Request("r", list(range(30)))
    req.status = RequestStatus.RUNNING
    assert kv.try_allocate(req, 30)
    table = list(kv.block_tables["r"])
    # n computed tokens: later queries see positions >= n - 5, so blocks ending before it are dead.
    for n, dead in ((5, 0), (8, 0), (9, 1), (12, 1), (13, 2), (30, 6)):
        req.num_computed_tokens = n
        kv.release_outside_window([req])
        kv.check()
        assert kv.block_tables["r"][:dead] == [kv.null_block] * dead and kv.block_tables["r"][dead:] == table[dead:]
        assert kv.num_free_blocks == 19 - (8 - dead)
    kv.fork("r", "copy")
    kv.check()
    kv.free("r")
    kv.free("copy")
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks and kv.null_block not in kv.allocator.free_blocks()
    parked = Request("p", list(range(30)), prefill_only=True)
    assert kv.try_allocate(parked, 30)
    parked.num_computed_tokens = 30
    kv.release_outside_window([parked])      # its table is a handoff's: kept whole
    assert kv.null_block not in kv.block_tables["p"]


def test_which_engines_release(mistral, tiny_model_dir):
    mcfg = mistral[1].config
    assert releasable_window(EngineConfig(), mcfg) == WINDOW
    assert releasable_window(EngineConfig(enable_prefix_caching=True), mcfg) is None
    assert releasable_window(EngineConfig(), load_model(tiny_model_dir)[1]) is None     # Llama: no window


def test_greedy_tokens_equal_transformers_while_a_long_request_holds_only_its_window(mistral, hf_greedy):
    _, model = mistral
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=4096), model)
    assert isinstance(eng.kv, SlidingWindowKVManager)
    prompts = [_prompt(n, n) for n in (5, 23, 24, 25, 90, 130)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    reqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    most = 0
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
        eng.kv.check()
        held = {rid: sum(b != eng.kv.null_block for b in t) for rid, t in eng.kv.block_tables.items()}
        most = max([most, *held.values()])
    # The window's blocks, the block being written, and one straddling the window's start.
    assert most <= WINDOW // BS + 2 + 16 // BS      # + a 16-token prefill chunk's blocks
    assert eng.kv.released_total > 0 and eng.kv.num_free_blocks == eng.kv.num_blocks
    for r, p in zip(reqs, prompts):
        assert r.output_token_ids == hf_greedy(p, 30), len(p)


def test_requests_longer_than_the_pool_run_side_by_side(mistral, hf_greedy):
    """A 31-block pool; two requests of 100 prompt + 60 generated tokens (40 blocks each) run
    together, never preempted: each holds its window only."""
    _, model = mistral
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=128), model)
    prompts = [_prompt(100, 1), _prompt(100, 2)]
    out = eng.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    assert eng.scheduler.preempted_total == 0
    assert out == [hf_greedy(p, 60) for p in prompts]


def test_a_tp_group_releases_the_same_way(mistral, hf_greedy):
    path, _ = mistral
    eng = LLMEngine.from_config(EngineConfig(**BASE, kv_cache_tokens=4096, tp=2, model=str(path), group_timeout_s=60))
    try:
        prompts = [_prompt(70, 3), _prompt(33, 4)]
        out = eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        assert isinstance(eng.kv, SlidingWindowKVManager) and eng.kv.released_total > 0
        assert out == [hf_greedy(p, 20) for p in prompts]
    finally:
        eng.close()


def test_a_preempted_request_with_released_blocks_recomputes_exactly(mistral, hf_greedy):
    """Preemption (what the scheduler does when KV runs out) of a decoding request whose early
    blocks were given back: its live blocks are freed, it recomputes, its tokens are transformers'."""
    _, model = mistral
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=1024), model)
    prompts = [_prompt(80, 5), _prompt(40, 6)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    reqs = [eng.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    for _ in range(200):
        eng.step()
        if len(reqs[0].output_token_ids) == 10:
            break
    assert eng.kv._released.get("r0", 0) > 0
    eng.scheduler._preempt(reqs[0])
    eng.kv.check()
    assert "r0" not in eng.kv.block_tables and eng.scheduler.preempted_total == 1
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
        eng.kv.check()
    assert [r.output_token_ids for r in reqs] == [hf_greedy(p, 30) for p in prompts]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
