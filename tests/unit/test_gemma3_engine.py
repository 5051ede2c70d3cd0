"""Prompts with images on Gemma 3 through the engine: the server's text expansion of each
"<start_of_image>" (raycluster.server.images), the SigLIP encoder's features over the
"<image_soft_token>" runs, and each image's tokens attending each other both ways
(Request.bidirectional_spans: the scheduler never cuts an image, the torch backend masks a chunk
by its spans), so the greedy tokens equal transformers' (given the processor's token types) for a
prompt with two images longer than the sliding window, whatever the chunk size, from a prefix hit
inside an image and on a TP group; an SPP group refuses the images naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from gemma3_reference import hf_gemma3_greedy, hf_gemma3_processor
from image_engine_checks import BASE, check_group, check_prefix_hit, image_sp, run_to_end
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.outputs import InvalidRequestError
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.loader import load_model
from raycluster.model.tiny_gemma3_vl import IMAGE_TOKEN_ID, write_tiny_gemma3_vl
from raycluster.model.tokenizer import Tokenizer
from raycluster.server.images import image_spec_for, place_images

pytest.importorskip("transformers")


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(11)
    return [Image.fromarray(rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, size=(20, 64, 3), dtype=np.uint8))]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = write_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3"), seed=3)
    tok = Tokenizer(path)
    spec = image_spec_for(path, tok)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"},
        {"type": "text", "text": "now."}]}])
    loaded = [image_facts(path).prepare(im) for im in _images()]
    ids, inputs = place_images(tok.encode(spec.expand_text(text, loaded), add_special_tokens=False), loaded, spec)
    hf = hf_gemma3_processor(path)(text=[text], images=[_images()], return_tensors="pt", add_special_tokens=False)
    assert hf["input_ids"][0].tolist() == ids
    assert [(im.offset, im.length) for im in inputs] == [(i, 16) for i, t in enumerate(ids)
                                                        if t == IMAGE_TOKEN_ID and ids[i - 1] != IMAGE_TOKEN_ID]
    want = hf_gemma3_greedy(path, ids, hf["pixel_values"], 10)
    model, _ = load_model(path)
    assert len(ids) > model.config.sliding_window
    return model, image_encoder_for(path), ids, inputs, want


@pytest.mark.parametrize("chunk", [5, 13, 64])
def test_greedy_tokens_equal_transformers(gemma3, chunk):
    model, enc, ids, images, want = gemma3
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    req = run_to_end(eng, "g", ids, image_sp(images))
    assert req.bidirectional_spans == tuple((im.offset, im.offset + im.length) for im in images)
    assert req.output_token_ids == want


def test_the_images_attend_both_ways(gemma3):
    """Read causally (spans dropped), the log-probabilities computed at an image's positions
    differ; before the first image they are the same (prompt_logprobs[j]: computed at position j)."""
    model, enc, ids, images, _ = gemma3
    lps = []
    for both in (True, False):
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64), model, image_encoder=enc)
        sp = image_sp(images, 1)
        sp.prompt_logprobs = 0
        req = eng.add_request("p", ids, sp)
        if not both:
            req.bidirectional_spans = ()
        for _ in range(50):
            if not eng.has_unfinished():
                break
            eng.step()
        lps.append([e.logprob for e in req.prompt_logprobs])
    first = images[0].offset
    assert lps[0][:first] == pytest.approx(lps[1][:first], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(lps[0][first:], lps[1][first:])) > 1e-2


def test_a_prefix_hit_inside_an_image(gemma3):
    """The image's KV was computed whole, both ways: a prefill resuming inside it is the same."""
    check_prefix_hit(*gemma3, whole_images=True, block_size=5)


def test_a_tp_group(gemma3):
    check_group(*gemma3, {"tp": 2})


@pytest.mark.parametrize("group", [{"spp": 2, "spp_micro_tokens": 3}, {"spp": 2, "tp": 2, "spp_micro_tokens": 5}])
def test_an_spp_group_keeps_each_image_in_one_micro_batch(gemma3, group):
    """Micro-batches of 3 / 5 tokens would cut the images: each runs on to its image's end
    instead, so the stages attend every image whole. (A KVP group does not serve Gemma 3 at all:
    it does not mask by a sliding window.)"""
    check_group(*gemma3, group)


def test_an_image_longer_than_a_step_is_refused(gemma3):
    model, enc, ids, images, _ = gemma3
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=8, max_num_batched_tokens=12,
                                 max_num_encoder_tokens=64), model, image_encoder=enc)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        eng.add_request("x", ids, image_sp(images))
