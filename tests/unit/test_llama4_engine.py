"""Prompts with images on Llama 4 through the engine: the server expands each "<|image|>" to the
image's span ("<|image_start|>", each tile's "<|patch|>" tokens between tile separators, the
global tile after "<|image|>", "<|image_end|>": raycluster.server.images with the facts' span
ids), the encoder's features fill the patch tokens only (Request.image_runs), so the greedy tokens
equal transformers' for a prompt with a one-tile and a four-tile image, whole or cut into prefill
chunks anywhere, from a prefix hit inside an image, and on TP and SPP groups."""

from __future__ import annotations

import pytest
from llama4_reference import hf_llama4_greedy, hf_processed
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.loader import load_model
from raycluster.model.tiny_llama4_vl import PATCH_TOKEN_ID, write_tiny_llama4_vl
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.images import image_spec_for, place_images

pytest.importorskip("transformers")
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30)


def _images() -> list[Image.Image]:
    """Flat colours (the tiny model's tokens tell them apart where noise averages out)."""
    return [Image.new("RGB", (16, 16), (200, 30, 30)), Image.new("RGB", (53, 37), (30, 30, 200))]


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    path = write_tiny_llama4_vl(tmp_path_factory.mktemp("llama4"), seed=0)
    tok = Tokenizer(path)
    spec = image_spec_for(path, tok)
    assert spec.token_text == "<|image|>"
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]}])
    loaded = [image_facts(path).prepare(im) for im in _images()]
    ids, inputs = place_images(tok.encode(text, add_special_tokens=False), loaded, spec)
    hf_ids, pixels, sizes = hf_processed(path, text, _images())
    assert hf_ids == ids
    assert [len(px) for px in pixels] == [1, 5]       # one tile; 2 x 2 tiles and the global one
    assert ids.count(PATCH_TOKEN_ID) == sum(len(px) for px in pixels) * 4
    want = hf_llama4_greedy(path, ids, pixels, 10)
    model, _ = load_model(path)
    return model, image_encoder_for(path), ids, inputs, want


def _sp(images, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, images=images)


def _run(eng: LLMEngine, rid: str, ids, sp):
    req = eng.add_request(rid, ids, sp)
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    return req


@pytest.mark.parametrize("chunk", [3, 6, 64])
def test_greedy_tokens_equal_transformers(llama4, chunk):
    model, enc, ids, images, want = llama4
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    req = _run(eng, "l", ids, _sp(images))
    assert len(req.image_runs[1]) == 5          # one run per tile
    assert req.output_token_ids == want


def test_a_prefix_hit_inside_an_image(llama4):
    model, enc, ids, images, want = llama4
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64, enable_prefix_caching=True), model,
                    image_encoder=enc)
    assert _run(eng, "a", ids, _sp(images)).output_token_ids == want
    req = eng.add_request("b", ids, _sp(images))
    assert images[0].offset < req.num_computed_tokens
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    assert req.output_token_ids == want


@pytest.mark.parametrize("group", [{"tp": 2}, {"spp": 2, "spp_micro_tokens": 3}])   # (kvp: no chunked attention)
def test_parallel_groups(llama4, group):
    model, enc, ids, images, want = llama4
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=8, **group), model, image_encoder=enc)
    try:
        assert eng.generate([ids], [_sp(images)]) == [want]
    finally:
        eng.runner.close()
