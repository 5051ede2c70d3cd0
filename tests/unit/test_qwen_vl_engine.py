"""Prompts with images on Qwen2-VL and Qwen2.5-VL through the engine: the image encoder's
features spliced over the "<|image_pad|>" runs and the text model turned by multimodal RoPE
(raycluster.model.mrope), so the greedy tokens equal transformers' for a prompt with two images of
different sizes, whole or cut into prefill chunks, on one process and on TP and SPP groups, and
across a P/D handoff whose decode side goes on from the shifted positions."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_reference import compare_prompt, hf_qwen_vl_greedy, hf_qwen_vl_processor

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import SamplingParams

pytest.importorskip("transformers")
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30)
ARCHS = {"qwen2_vl": ("Qwen2VLForConditionalGeneration", 5), "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", 3)}


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=list(ARCHS))
def qwen(request, tmp_path_factory):
    arch, seed = ARCHS[request.param]
    path = write_tiny_multimodal(tmp_path_factory.mktemp(request.param), arch, seed=seed, vision_weights=True,
                                 num_hidden_layers=2)
    ids, inputs, hf = compare_prompt(path, [_image(30, 40, 7), _image(100, 17, 8)], hf_qwen_vl_processor)
    want = hf_qwen_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10)
    model, _ = load_model(path)
    return model, image_encoder_for(path), ids, inputs, want


def _sp(images, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, images=images)


@pytest.mark.parametrize("chunk", [5, 64])
def test_greedy_tokens_equal_transformers(qwen, chunk):
    model, enc, ids, images, want = qwen
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    req = eng.add_request("q", ids, _sp(images))
    assert req.mrope is not None and req.mrope.delta < 0
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == want
    # The layout is read: without it (positions as indices) the prompt's log-probabilities after
    # the first image differ.
    lps = []
    for layout in (True, False):
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
        sp = _sp(images, 1)
        sp.prompt_logprobs = 0
        req = eng.add_request("p", ids, sp)
        if not layout:
            req.mrope = None
        while eng.has_unfinished():
            eng.step()
        lps.append([e.logprob for e in req.prompt_logprobs[1:]])
    after = images[0].offset + images[0].length
    assert lps[0][:images[0].offset] == lps[1][:images[0].offset]
    assert max(abs(a - b) for a, b in zip(lps[0][after:], lps[1][after:])) > 1e-3


@pytest.mark.parametrize("group", [{"tp": 2}, {"spp": 2, "spp_micro_tokens": 3}])
def test_parallel_groups(qwen, group):
    model, enc, ids, images, want = qwen
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=8, **group), model, image_encoder=enc)
    try:
        assert eng.generate([ids], [_sp(images)]) == [want]
    finally:
        eng.runner.close()


def test_a_pd_handoff_goes_on_from_the_shifted_positions(qwen):
    """The prefill side parks the KV after the first token; the decode side, given the same
    request (its images included), lays out the same positions and decodes the rest."""
    model, enc, ids, images, want = qwen
    cfg = EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=16)
    prefill = LLMEngine(cfg, model, image_encoder=enc)
    decode = LLMEngine(cfg, model, image_encoder=enc)
    prefill.add_request("h", ids, _sp(images), prefill_only=True)
    for _ in range(100):
        if "h" in prefill.scheduler.parked:
            break
        prefill.step()
    first = list(prefill.scheduler.parked["h"].output_token_ids)
    port = prefill.runner.port
    staged = port.stage("h", prefill.parked_blocks("h"))
    data = port.tensor[:, staged].clone()
    port.unstage("h")
    assert prefill.release("h")

    def fill_kv(block_ids, skip):
        return decode.runner.port.receive(block_ids, lambda dst: decode.runner.port.tensor.index_copy_(
            1, torch.tensor(dst), data[:, skip:]) is not None)
    assert decode.add_prefilled("h", ids, first, _sp(images), fill_kv)
    req = decode.scheduler.requests["h"]
    assert req.mrope is not None and req.num_computed_tokens == len(ids)
    for _ in range(100):
        if not decode.has_unfinished():
            break
        decode.step()
    assert req.output_token_ids == want


def test_preempted_image_requests_recompute_to_the_same_tokens(qwen):
    """A pool too small for every request at once preempts: a recomputed request encodes its
    images again and lays out the same positions (its generated tokens past the shift)."""
    model, enc, ids, images, want = qwen
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=3 * len(ids), chunk_size=16), model, image_encoder=enc)
    reqs = [eng.add_request(f"r{i}", ids, _sp(images, 24)) for i in range(4)]
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert eng.scheduler.preempted_total > 0
    assert all(r.output_token_ids[:10] == want for r in reqs)
    assert len({tuple(r.output_token_ids) for r in reqs}) == 1
