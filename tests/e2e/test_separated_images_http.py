"""Mistral 3 and Llama 4 over real HTTP: a chat message with two images of different sizes is
answered with transformers' greedy tokens; /tokenize shows the processor's ids (Mistral 3: each
image's rows of "[IMG]" ended by "[IMG_BREAK]", the last by "[IMG_END]"; Llama 4: "<|image|>"
expanded to its tiles' "<|patch|>" tokens between separators)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from engine_http import all_free, serve_engine, tiny_parts
import llama4_reference
import mistral3_reference
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for
from raycluster.model.tiny_llama4_vl import write_tiny_llama4_vl
from raycluster.model.tiny_mistral3_vl import write_tiny_mistral3_vl
from raycluster.server.images import image_spec_for

pytest.importorskip("transformers")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _mistral3_greedy(path, ids, pixels, sizes, n):
    return mistral3_reference.hf_mistral3_greedy(path, ids, pixels, sizes, n)


def _llama4_greedy(path, ids, pixels, sizes, n):
    return llama4_reference.hf_llama4_greedy(path, ids, pixels, n)


# (checkpoint writer, transformers' processed prompt, its greedy tokens, two images)
MODELS = {"mistral3": (write_tiny_mistral3_vl, mistral3_reference.hf_processed, _mistral3_greedy, ((53, 37), (20, 40))),
          "llama4": (write_tiny_llama4_vl, llama4_reference.hf_processed, _llama4_greedy, ((16, 16), (53, 37)))}


@pytest.mark.parametrize("name", list(MODELS))
def test_chat_with_two_images(tmp_path, name):
    write, hf_processed, hf_greedy, sizes = MODELS[name]
    path = write(tmp_path / name, seed=0)
    model, tok = tiny_parts(path)
    images = [Image.new("RGB", sizes[0], (200, 30, 30)), Image.new("RGB", sizes[1], (30, 30, 200))]
    pngs = [_png(im) for im in images]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, _part(pngs[0]),
                                             {"type": "text", "text": "with"}, _part(pngs[1])]}]
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=8)
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok)) \
            as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
            {"type": "image"}]}])
        hf_ids, pixels, shapes = hf_processed(path, text, [Image.open(io.BytesIO(p)) for p in pngs])
        assert hf_ids == ids
        want = hf_greedy(path, ids, pixels, shapes, 10)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert all_free(aeng)
