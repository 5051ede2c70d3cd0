"""Prompts with images on LLaVA-OneVision through the engine (raycluster.model.llava_onevision):
each image tiled by its size, its tiles' features shrunk under "anyres_max" when too many, spliced
over its "<image>" run; the greedy tokens equal transformers' for a prompt with two images of
different sizes (one shrunk), whole or cut into prefill chunks, from a prefix hit inside an image,
and on a tp group."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from image_engine_checks import BASE, check_group, check_prefix_hit, image_sp, laid_out_prompt, run_to_end
from llava_reference import _greedy
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_llava_onevision import IMAGE_TOKEN_ID, write_tiny_llava_onevision

pytest.importorskip("transformers")


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _prompt(path, images):
    """The chat prompt "<image>Compare<image>these." laid out as the server does (image_facts)."""
    ids, inputs, _ = laid_out_prompt(path, [{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
                                            {"type": "text", "text": "these."}], images)
    assert IMAGE_TOKEN_ID in ids
    return ids, inputs


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil

    path = write_tiny_llava_onevision(tmp_path_factory.mktemp("ov"), seed=4)
    pictures = [_image(30, 40, 7), _image(120, 90, 8)]
    ids, inputs = _prompt(path, pictures)
    enc = image_encoder_for(path)
    # The second image's tiles hold more than anyres_max_9's features: they are shrunk.
    rows, cols = (s.stop - s.start for s in enc.grid.kept((120, 90)))
    assert enc.grid.packed_shape((120, 90)) < (rows, cols)
    assert enc.grid.packed_shape((30, 40)) == tuple(s.stop - s.start for s in enc.grid.kept((30, 40)))
    hf = LlavaOnevisionImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")
    ref = LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    want = _greedy(ref, ids, hf["pixel_values"], 10, False, image_sizes=hf["image_sizes"])
    model, _ = load_model(path)
    return model, enc, ids, inputs, want


@pytest.mark.parametrize("chunk", [5, 512])
def test_greedy_tokens_equal_transformers(onevision, chunk):
    model, enc, ids, images, want = onevision
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=2048, chunk_size=chunk), model, image_encoder=enc)
    assert run_to_end(eng, "a", ids, image_sp(images)).output_token_ids == want


def test_a_prefix_hit_inside_an_image_resumes(onevision):
    check_prefix_hit(*onevision)


def test_a_tp_group_gives_the_same_tokens(onevision):
    check_group(*onevision, {"tp": 2})
