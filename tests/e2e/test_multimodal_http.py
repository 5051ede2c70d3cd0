"""An image-text checkpoint (a tiny Gemma3ForConditionalGeneration) served over real HTTP on its
text alone: a chat reply equals the engine's greedy tokens for the templated prompt, and a
message with an image part is a 400 naming it. A tiny LLaVA takes images (test_llava_http)."""

from __future__ import annotations

import httpx
from engine_http import all_free, serve_engine, tiny_parts

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import SamplingParams


def test_an_image_text_checkpoint_serves_text_and_refuses_images(tmp_path):
    path = write_tiny_multimodal(tmp_path / "gemma3mm", "Gemma3ForConditionalGeneration", seed=2,
                                 num_hidden_layers=2, tie_word_embeddings=False)
    model, tok = tiny_parts(path)
    assert model.config.multimodal == "Gemma3ForConditionalGeneration"
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token")
    messages = [{"role": "user", "content": "tell me about the sea"}]
    want = LLMEngine(cfg, model, tok).generate([tok.apply_chat_template(messages, tokenize=True)],
                                               SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with serve_engine(cfg, model, tok) as (url, aeng):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == tok.decode(want) and r.json()["usage"]["completion_tokens"] == 8
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                         {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "takes no images" in r.json()["error"]["message"]
        assert all_free(aeng)
