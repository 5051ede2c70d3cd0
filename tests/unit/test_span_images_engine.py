"""Prompts with images whose spans hold other tokens too, through the engine: Mistral 3 (rows of
"[IMG]", each ended by "[IMG_BREAK]", the last by "[IMG_END]") and Llama 4 ("<|image|>" expanded
to "<|image_start|>", each tile's "<|patch|>" tokens between tile separators, the global tile,
"<|image_end|>"). The server lays out each image's span (raycluster.server.images with the
facts' span ids) and the encoder's features fill only the image-token runs (Request.image_runs),
so the greedy tokens equal transformers' for a prompt with two images, whole or cut into prefill
chunks anywhere (inside a run and at a separator), from a prefix hit inside an image, and on tp
and spp groups (and kvp for Mistral 3; Llama 4's chunked attention is not served on kvp)."""

from __future__ import annotations

import llama4_reference
import mistral3_reference
import pytest
from image_engine_checks import BASE, check_group, check_prefix_hit, image_sp, run_to_end
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.loader import load_model
from raycluster.model.tiny_llama4_vl import PATCH_TOKEN_ID, write_tiny_llama4_vl
from raycluster.model.tiny_mistral3_vl import IMAGE_BREAK_TOKEN_ID, IMAGE_END_TOKEN_ID, write_tiny_mistral3_vl
from raycluster.model.tokenizer import Tokenizer
from raycluster.server.images import image_spec_for, place_images

pytest.importorskip("transformers")


def _mistral3(path, ids, pixels, shapes):
    assert ids.count(IMAGE_END_TOKEN_ID) == 2 and ids.count(IMAGE_BREAK_TOKEN_ID) > 2
    return mistral3_reference.hf_mistral3_greedy(path, ids, pixels, shapes, 10)


def _llama4(path, ids, pixels, shapes):
    assert [len(px) for px in pixels] == [1, 5]         # one tile; 2 x 2 tiles and the global one
    assert ids.count(PATCH_TOKEN_ID) == sum(len(px) for px in pixels) * 4
    return llama4_reference.hf_llama4_greedy(path, ids, pixels, 10)


# name -> (writer, the template's image text, transformers' processed prompt, checked greedy tokens,
#          the two images' sizes (flat colours: the tiny models' tokens tell them apart), groups)
MODELS = {
    "mistral3": (write_tiny_mistral3_vl, "[IMG]", mistral3_reference.hf_processed, _mistral3, ((53, 37), (20, 40)),
                 [{"tp": 2}, {"kvp": 2}, {"spp": 2, "spp_micro_tokens": 3}]),
    "llama4": (write_tiny_llama4_vl, "<|image|>", llama4_reference.hf_processed, _llama4, ((16, 16), (53, 37)),
               [{"tp": 2}, {"spp": 2, "spp_micro_tokens": 3}]),
}


@pytest.fixture(scope="module", params=list(MODELS))
def spanned(request, tmp_path_factory):
    write, marker, hf_processed, hf_greedy, sizes, groups = MODELS[request.param]
    path = write(tmp_path_factory.mktemp(request.param), seed=0)
    tok = Tokenizer(path)
    spec = image_spec_for(path, tok)
    assert spec.token_text == marker
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]}])
    images = [Image.new("RGB", sizes[0], (200, 30, 30)), Image.new("RGB", sizes[1], (30, 30, 200))]
    loaded = [image_facts(path).prepare(im) for im in images]
    ids, inputs = place_images(tok.encode(text, add_special_tokens=False), loaded, spec)
    hf_ids, pixels, shapes = hf_processed(path, text, images)
    assert hf_ids == ids
    want = hf_greedy(path, ids, pixels, shapes)
    model, _ = load_model(path)
    return model, image_encoder_for(path), ids, inputs, want, groups


@pytest.mark.parametrize("chunk", [3, 6, 64])
def test_greedy_tokens_equal_transformers(spanned, chunk):
    model, enc, ids, images, want, _ = spanned
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=chunk), model, image_encoder=enc)
    req = run_to_end(eng, "s", ids, image_sp(images))
    assert max(len(runs) for runs in req.image_runs) > 1         # runs between the separators
    assert req.output_token_ids == want


def test_a_prefix_hit_inside_an_image(spanned):
    check_prefix_hit(*spanned[:5])


def test_parallel_groups(spanned):
    for group in spanned[5]:
        check_group(*spanned[:5], group)
