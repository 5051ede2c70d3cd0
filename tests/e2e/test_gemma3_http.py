"""Gemma 3 over real HTTP: a chat message with two images is answered with transformers' greedy
tokens (the server expands each "<start_of_image>" in the prompt's text as Gemma3Processor does,
the engine computes each image in one step with its tokens attending both ways); /tokenize
shows the processor's ids; a literal "<start_of_image>" in the text is refused naming the field."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from engine_http import all_free, serve_engine, tiny_parts
from gemma3_reference import hf_gemma3_greedy, hf_gemma3_processor
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for
from raycluster.model.tiny_gemma3_vl import write_tiny_gemma3_vl
from raycluster.server.images import image_spec_for

pytest.importorskip("transformers")


def _png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def test_gemma3_chat_with_two_images(tmp_path):
    path = write_tiny_gemma3_vl(tmp_path / "gemma3", seed=3)
    model, tok = tiny_parts(path)
    spec = image_spec_for(path, tok)
    assert spec.token_text == "<start_of_image>" and spec.wrap == ("\n\n<start_of_image>", "<end_of_image>\n\n")
    pngs = [_png(37, 53, 1), _png(20, 64, 2)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, _part(pngs[0]),
                                             {"type": "text", "text": "with"}, _part(pngs[1])]}]
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=8)
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=spec) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
            {"type": "image"}]}])
        hf = hf_gemma3_processor(path)(text=[text], images=[[Image.open(io.BytesIO(p)) for p in pngs]],
                                       return_tensors="pt", add_special_tokens=False)
        assert hf["input_ids"][0].tolist() == ids
        want = hf_gemma3_greedy(path, ids, hf["pixel_values"], 10)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        # A marker typed into the text would take an image's place: refused.
        bad = [{"role": "user", "content": [{"type": "text", "text": "see <start_of_image> here"}, _part(pngs[0])]}]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "2 image markers" in r.json()["error"]["message"]
        assert all_free(aeng)
