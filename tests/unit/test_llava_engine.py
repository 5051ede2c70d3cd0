"""Prompts with images through the engine (raycluster.engine.image_inputs): a tiny
LlavaForConditionalGeneration's greedy tokens equal transformers' for prompts with one or two
images, whole or with the image cut across prefill chunks, batched with other requests, on one
process and on TP, KVP and SPP groups; the prefix cache reuses a prompt's blocks only under the same pixels;
and what the engine cannot serve is refused naming the field."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from llava_reference import hf_llava_greedy
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.outputs import InvalidRequestError
from raycluster.model.image_processor import ImageProcessor
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import ImageInput, SamplingParams

pytest.importorskip("transformers")
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = write_tiny_multimodal(tmp_path_factory.mktemp("llava"), "LlavaForConditionalGeneration", seed=1,
                                 vision_weights=True)
    model, _ = load_model(path)
    return path, model, image_encoder_for(path), ImageProcessor.from_model_dir(path)


def _pixels(processor: ImageProcessor, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return processor(Image.fromarray(rng.integers(0, 256, size=(40 + seed, 33, 3), dtype=np.uint8)))


def _prompt(pieces, per_image: int, pixels: list[torch.Tensor]) -> tuple[list[int], list[ImageInput]]:
    """Token ids with an image's placeholder run wherever `pieces` holds None, and the images on them."""
    ids, images = [], []
    it = iter(pixels)
    for piece in pieces:
        if piece is None:
            px = next(it)
            images.append(ImageInput(len(ids), per_image, px, hashlib.sha256(px.numpy().tobytes()).digest()))
            ids.extend([IMAGE_TOKEN_ID] * per_image)
        else:
            ids.extend(piece)
    return ids, images


def _sp(images, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, images=images)


def _reference(path, ids, images, n: int = 10) -> list[int]:
    return hf_llava_greedy(path, ids, torch.stack([im.pixel_values for im in images]), n)


def test_image_prompts_give_transformers_tokens(llava):
    path, model, enc, proc = llava
    per = enc.tokens_per_image
    one = _prompt([[7, 8, 9, 10, 11, 12], None, [20, 21, 22]], per, [_pixels(proc, 0)])
    two = _prompt([[30, 31], None, [40], None, [50, 51, 52, 53, 54]], per, [_pixels(proc, 1), _pixels(proc, 2)])
    text = ([60 + i for i in range(13)], [])
    # The text-only prompt's reference: the engine without an image encoder (its equality with
    # transformers on text is test_multimodal_text's).
    want = [_reference(path, *one), _reference(path, *two),
            LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512), model).generate([text[0]], _sp([]))[0]]
    for chunk in (8, 64):
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
        pieces, run = [], eng.runner.run_plan
        eng.runner.run_plan = lambda plan: pieces.append([len(e) for _, e in plan.image_rows]) or run(plan)
        got = eng.generate([p[0] for p in (one, two, text)], [_sp(p[1]) for p in (one, two, text)])
        assert got == want, chunk
        # The pieces of image embeddings each step splices, by prefill chunk: with chunks of 8
        # the first prompt's image is cut 2 + 2, the second prompt's second image 1 + 3.
        assert pieces[:2] == ([[2, 4, 1], [2, 3]] if chunk == 8 else [[4, 4, 4], []])
        assert not any(r.image_embeds for r in eng.scheduler.requests.values())


def test_the_pixels_decide_the_tokens(llava):
    """Same ids, other pixels: other tokens (the images are really read)."""
    path, model, enc, proc = llava
    a = _prompt([[7, 8], None, [9]], enc.tokens_per_image, [_pixels(proc, 3)])
    b = _prompt([[7, 8], None, [9]], enc.tokens_per_image, [_pixels(proc, 4)])
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512), model, image_encoder=enc)
    got = eng.generate([a[0], b[0]], [_sp(a[1], 16), _sp(b[1], 16)])
    assert got[0] != got[1]
    assert got == [_reference(path, *a, 16), _reference(path, *b, 16)]


def test_prefix_cache_keys_on_the_pixels(llava):
    """A prompt's blocks from the image's block on are reused under the same pixels only; the
    text before the image is shared either way."""
    path, model, enc, proc = llava
    head = [70 + i for i in range(8)]                     # two whole blocks before the image
    a = _prompt([head, None, [90 + i for i in range(9)]], enc.tokens_per_image, [_pixels(proc, 5)])
    b = _prompt([head, None, [90 + i for i in range(9)]], enc.tokens_per_image, [_pixels(proc, 6)])
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, enable_prefix_caching=True), model,
                    image_encoder=enc)
    first = eng.generate([a[0]], [_sp(a[1])])
    again = eng.add_request("again", a[0], _sp(a[1]))
    other = eng.add_request("other", b[0], _sp(b[1]))
    while eng.has_unfinished():
        eng.step()
    assert again.output_token_ids == first[0] == _reference(path, *a)
    assert other.output_token_ids == _reference(path, *b)
    # 21 tokens: 5 full blocks before the last token; all found again under the same pixels,
    # only the 2 before the image under others.
    assert again.num_cached_tokens == 20 and other.num_cached_tokens == 8


def test_a_prefix_hit_that_ends_inside_an_image(llava):
    """Same text and image, another tail: the hit ends in the middle of the image (block 3 holds
    its last two placeholders and the first tail token), so the prefill resumes there and
    splices the rest of the image's features."""
    path, model, enc, proc = llava
    px = _pixels(proc, 9)
    head = [70 + i for i in range(10)]
    a = _prompt([head, None, [90, 91, 92, 93, 94]], enc.tokens_per_image, [px])
    b = _prompt([head, None, [95, 96, 97, 98, 99]], enc.tokens_per_image, [px])
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, enable_prefix_caching=True), model,
                    image_encoder=enc)
    assert eng.generate([a[0]], [_sp(a[1])]) == [_reference(path, *a)]
    pieces, run = [], eng.runner.run_plan
    eng.runner.run_plan = lambda plan: pieces.append([(r, len(e)) for r, e in plan.image_rows]) or run(plan)
    req = eng.add_request("b", b[0], _sp(b[1]))
    while eng.has_unfinished():
        eng.step()
    assert req.num_cached_tokens == 12 and pieces[0] == [(0, 2)]
    assert req.output_token_ids == _reference(path, *b)


@pytest.mark.parametrize("group", [{"tp": 2}, {"kvp": 2}, {"spp": 2, "spp_micro_tokens": 3}])
def test_parallel_groups_take_images(llava, group):
    """The leader encodes; the plan carries the features to the ranks (an SPP group's first stage
    gets each micro-batch's share: micro-batches of 3 tokens cut the image)."""
    path, model, enc, proc = llava
    p = _prompt([[7, 8, 9], None, [20, 21]], enc.tokens_per_image, [_pixels(proc, 7)])
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=5, **group), model, image_encoder=enc)
    try:
        assert eng.runner.layout == "".join(f"{k}{v}" for k, v in group.items() if k != "spp_micro_tokens")
        assert eng.generate([p[0]], [_sp(p[1])]) == [_reference(path, *p)]
    finally:
        eng.runner.close()


def test_what_the_engine_cannot_serve_is_refused(llava):
    path, model, enc, proc = llava
    per = enc.tokens_per_image
    ids, images = _prompt([[7, 8], None, [9]], per, [_pixels(proc, 8)])
    plain = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512), model)
    with pytest.raises(InvalidRequestError, match="takes no images") as e:
        plain.add_request("r", ids, _sp(images))
    assert e.value.field == "messages"
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512), model, image_encoder=enc)
    px = images[0].pixel_values
    bad = {
        "placeholder tokens": [ImageInput(2, per - 1, px, b"d")],
        "overlaps another or leaves": [ImageInput(len(ids) - 2, per, px, b"d")],
        "do not hold its placeholder tokens": [ImageInput(1, per, px, b"d")],
        "pixels are": [ImageInput(2, per, px[:, :14], b"d")],
        "that no image fills": [],
    }
    for match, imgs in bad.items():
        sp = _sp(imgs) if imgs else _sp([ImageInput(2, per, px, b"d")])
        prompt = ids if imgs else ids + [IMAGE_TOKEN_ID]
        with pytest.raises(InvalidRequestError, match=match):
            eng.add_request(f"bad-{match}", prompt, sp)
    assert not eng.has_unfinished()


def test_an_image_the_encoder_cache_holds_takes_no_encoder_budget(llava):
    """A step's encoder budget of one image: a prompt with a new image and one the cache holds is
    prefilled in one step (vLLM skips cached images too); without the cache it takes two."""
    path, model, enc, processor = llava
    per = enc.tokens_per_image
    px, other = _pixels(processor, 0), _pixels(processor, 1)
    steps = {}
    for tokens in (4096, 0):
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64, encoder_cache_tokens=tokens,
                                     max_num_encoder_tokens=per), model, image_encoder=enc)
        assert eng.scheduler.encoder_cached is (eng.runner.image_cache if tokens else ())
        eng.generate(*_one(_prompt([[5, 6], None, [7]], per, [px])))
        ids, images = _prompt([[9, 10], None, [11], None, [12]], per, [px, other])
        eng.add_request("b", ids, _sp(images, 1))
        prefills = []
        for _ in range(10):
            prefills.append(eng.step().num_prefill_tokens)
            if not eng.has_unfinished():
                break
        steps[tokens] = [n for n in prefills if n]
    assert steps[4096] == [2 + per + 1 + per + 1]
    assert steps[0] == [2 + per + 1, per + 1]


def _one(prompt) -> tuple[list[list[int]], list[SamplingParams]]:
    ids, images = prompt
    return [ids], [_sp(images, 1)]


def test_the_encoder_cache_encodes_an_image_once_across_prompts(llava):
    """The same picture after other text is not encoded again (the encoder cache, by digest), and
    gives the tokens of an engine without the cache; the least recently used image goes first."""
    from raycluster.engine.image_inputs import EncoderCache

    path, model, enc, processor = llava
    per = enc.tokens_per_image
    px, other = _pixels(processor, 0), _pixels(processor, 1)
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(enc, name)

        def encode_images(self, items):
            calls.append(len(items))
            return enc.encode_images(items)

    prompts = [_prompt([[5, 6, 7], None, [8]], per, [px]), _prompt([[9, 10, 11, 12, 13], None, [8]], per, [px]),
               _prompt([[5, 6], None, [9]], per, [other])]
    outs = {}
    for tokens in (4096, 0):
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=64, encoder_cache_tokens=tokens), model,
                        image_encoder=Counting())
        calls.clear()
        outs[tokens] = [eng.generate([ids], [_sp(images)])[0] for ids, images in prompts]
        assert calls == ([1, 1] if tokens else [1, 1, 1])
        assert (eng.runner.image_cache is None) == (tokens == 0)
    assert outs[4096] == outs[0]
    cache = EncoderCache(capacity=2 * per)
    for digest in (b"a", b"b", b"a", b"c"):         # c pushes out b, the least recently used
        if cache.get(digest) is None:
            cache.put(digest, torch.zeros(per, 4))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.tokens == 2 * per
