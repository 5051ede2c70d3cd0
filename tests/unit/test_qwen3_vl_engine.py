"""Prompts with images on Qwen3-VL through the engine: the merger's features spliced over the
"<|image_pad|>" runs, the DeepStack levels added after the first decoder layers at the image's
rows (raycluster.model.llama's `add_deepstack`) and the text model turned by interleaved
multimodal RoPE, so the greedy tokens equal transformers' for a prompt with two images of
different sizes, whole or cut into prefill chunks, from a prefix-cache hit that ends inside an
image, on one process and on TP, KVP and SPP groups (the SPP stages each holding one of the
layers the levels go to), and under an encoder budget of one image per step."""

from __future__ import annotations


import numpy as np
import pytest
from PIL import Image
from qwen3_vl_reference import hf_qwen3_vl_greedy, hf_qwen3_vl_processor
from image_engine_checks import BASE, check_group, check_prefix_hit, image_sp, run_to_end
from qwen_vl_reference import compare_prompt

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_qwen3_vl import write_tiny_qwen3_vl

pytest.importorskip("transformers")


def _picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth picture (a 3 x 3 grid of colours, stretched): the tiny model's tokens tell two apart."""
    grid = np.random.default_rng(seed).integers(0, 256, size=(3, 3, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((w, h), Image.Resampling.BILINEAR)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), seed=5)
    ids, inputs, hf = compare_prompt(path, [_picture(30, 40, 7), _picture(100, 17, 8)], hf_qwen3_vl_processor)
    want = hf_qwen3_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10)
    model, _ = load_model(path)
    return model, image_encoder_for(path), ids, inputs, want


@pytest.mark.parametrize("chunk", [5, 64])
def test_greedy_tokens_equal_transformers(qwen3, chunk):
    model, enc, ids, images, want = qwen3
    assert enc.deepstack_levels == 2
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    assert run_to_end(eng, "q", ids, image_sp(images)).output_token_ids == want


def test_the_deepstack_levels_are_added(qwen3):
    """The same features without their levels (each image's first H columns alone) give other
    tokens: the levels reach the text model."""
    model, enc, ids, images, want = qwen3

    class MergerOnly:
        def __getattr__(self, name):
            return getattr(enc, name)

        def encode_images(self, items):
            return [e[:, :model.config.hidden_size] for e in enc.encode_images(items)]

    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64), model, image_encoder=MergerOnly())
    assert run_to_end(eng, "q", ids, image_sp(images)).output_token_ids != want


def test_a_prefix_hit_inside_an_image_adds_the_rest_of_its_levels(qwen3):
    check_prefix_hit(*qwen3)


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}, {"spp": 2, "spp_micro_tokens": 3}])
def test_parallel_groups(qwen3, group):
    check_group(*qwen3, group)


def test_an_encoder_budget_of_one_image_per_step(qwen3):
    """With room to encode one image per step, the prompt's chunk stops before the second image
    and the tokens are the same; an image past the budget is refused, naming the field."""
    from raycluster.engine.outputs import InvalidRequestError

    model, enc, ids, images, want = qwen3
    budget = max(im.length for im in images)
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64, max_num_encoder_tokens=budget), model,
                    image_encoder=enc)
    req = eng.add_request("q", ids, image_sp(images))
    chunks = []
    for _ in range(500):
        if not eng.has_unfinished():
            break
        before = req.num_computed_tokens
        eng.step()
        if req.num_computed_tokens <= len(ids):
            chunks.append(req.num_computed_tokens - before)
    assert req.output_token_ids == want
    assert chunks[0] == images[1].offset            # the first step stops before the second image
    small = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64, max_num_encoder_tokens=budget - 1),
                      model, image_encoder=enc)
    with pytest.raises(InvalidRequestError, match="max_num_encoder_tokens") as e:
        small.add_request("x", ids, image_sp(images))
    assert e.value.field == "messages"
