"""Prompts with images on Mistral 3 through the engine: the server lays out each image's span
(rows of "[IMG]", each ended by "[IMG_BREAK]", the last by "[IMG_END]": raycluster.server.images
with the facts' span ids), the Pixtral encoder's features fill the rows only
(Request.image_runs), so the greedy tokens equal transformers' for a prompt with two images of
different sizes, whole or cut into prefill chunks (inside a row and at a break), from a prefix
hit inside an image, and on TP, KVP and SPP groups."""

from __future__ import annotations

import pytest
from mistral3_reference import hf_mistral3_greedy, hf_processed
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.loader import load_model
from raycluster.model.tiny_mistral3_vl import IMAGE_BREAK_TOKEN_ID, IMAGE_END_TOKEN_ID, write_tiny_mistral3_vl
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams
from raycluster.server.images import image_spec_for, place_images

pytest.importorskip("transformers")
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30)


def _images() -> list[Image.Image]:
    """Flat colours (the tiny model's tokens tell them apart where noise averages out)."""
    return [Image.new("RGB", (53, 37), (200, 30, 30)), Image.new("RGB", (20, 40), (30, 30, 200))]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    path = write_tiny_mistral3_vl(tmp_path_factory.mktemp("mistral3"), seed=0)
    tok = Tokenizer(path)
    spec = image_spec_for(path, tok)
    assert spec.token_text == "[IMG]"
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]}])
    loaded = [image_facts(path).prepare(im) for im in _images()]
    ids, inputs = place_images(tok.encode(text, add_special_tokens=False), loaded, spec)
    hf_ids, pixels, sizes = hf_processed(path, text, _images())
    assert hf_ids == ids
    assert ids.count(IMAGE_END_TOKEN_ID) == 2 and ids.count(IMAGE_BREAK_TOKEN_ID) > 2
    want = hf_mistral3_greedy(path, ids, pixels, sizes, 10)
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
def test_greedy_tokens_equal_transformers(mistral3, chunk):
    model, enc, ids, images, want = mistral3
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    req = _run(eng, "m", ids, _sp(images))
    assert len(req.image_runs[0]) > 1          # one run per row
    assert req.output_token_ids == want


def test_a_prefix_hit_inside_an_image(mistral3):
    model, enc, ids, images, want = mistral3
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


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}, {"spp": 2, "spp_micro_tokens": 3}])
def test_parallel_groups(mistral3, group):
    model, enc, ids, images, want = mistral3
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=8, **group), model, image_encoder=enc)
    try:
        assert eng.generate([ids], [_sp(images)]) == [want]
    finally:
        eng.runner.close()
