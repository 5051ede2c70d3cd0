"""Qwen2-VL and Qwen3-VL over real HTTP: a chat message with two images of different sizes is
answered with transformers' greedy tokens (the server expands each "<|image_pad|>" by the image's
size, the engine turns the text model by multimodal RoPE and, on Qwen3-VL, adds the DeepStack
levels); a template that does not iterate content parts
gets the vision start / pad / end tokens as text, one line per image."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from engine_http import all_free, serve_engine, tiny_parts
from PIL import Image
from qwen3_vl_reference import hf_qwen3_vl_greedy, hf_qwen3_vl_processor
from qwen_vl_reference import hf_qwen_vl_greedy, hf_qwen_vl_processor

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen3_vl import write_tiny_qwen3_vl
from raycluster.server.images import image_spec_for, template_content

pytest.importorskip("transformers")


def _png(h: int, w: int, seed: int, smooth: bool = False) -> bytes:
    """A picture: noise, or (`smooth`) a 3 x 3 grid of colours stretched, which the tiny Qwen3-VL's
    tokens tell apart where noise blurs into one."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, size=(3, 3, 3) if smooth else (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    (image.resize((w, h), Image.Resampling.BILINEAR) if smooth else image).save(buf, "PNG")
    return buf.getvalue()


def _qwen2_vl(path):
    return write_tiny_multimodal(path, "Qwen2VLForConditionalGeneration", seed=5, vision_weights=True,
                                 num_hidden_layers=2)


# (checkpoint writer, transformers' processor and greedy tokens, smooth pictures)
MODELS = {"qwen2_vl": (_qwen2_vl, hf_qwen_vl_processor, hf_qwen_vl_greedy, False),
          "qwen3_vl": (lambda path: write_tiny_qwen3_vl(path, seed=5), hf_qwen3_vl_processor, hf_qwen3_vl_greedy, True)}


@pytest.mark.parametrize("name", list(MODELS))
def test_chat_with_two_images(tmp_path, name):
    write, hf_processor, hf_greedy, smooth = MODELS[name]
    path = write(tmp_path / name)
    model, tok = tiny_parts(path)
    spec = image_spec_for(path, tok)
    assert spec.token_text == "<|vision_start|><|image_pad|><|vision_end|>"
    pngs = [_png(30, 40, 7, smooth), _png(100, 17, 8, smooth)]
    url_part = lambda png: {"type": "image_url", "image_url": {"url": "data:image/png;base64," +    # noqa: E731
                                                                      base64.b64encode(png).decode()}}
    messages = [{"role": "user", "content": [url_part(pngs[0]), {"type": "text", "text": "Compare"},
                                             url_part(pngs[1]), {"type": "text", "text": "these."}]}]
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=8)
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=spec) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        text = tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
            {"type": "text", "text": "these."}]}])
        hf = hf_processor(path)(images=[Image.open(io.BytesIO(p)) for p in pngs],
                                text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
        assert hf["input_ids"][0].tolist() == ids
        want = hf_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10)
        assert want != hf_greedy(path, ids, None, None, 10)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert all_free(aeng)


def test_a_string_template_gets_the_placeholder_text():
    from raycluster.server.protocol import ChatMessage

    m = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": "what is it"},
        {"type": "image_url", "image_url": {"url": "data:y"}}]})
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert template_content(m, False, placeholder) == f"{placeholder}\n{placeholder}\nwhat is it"
    assert template_content(m, True, placeholder) == [{"type": "image"}, {"type": "text", "text": "what is it"},
                                                       {"type": "image"}]
