"""Precomputed image embeddings over real HTTP (vLLM's image_embeds parts, --enable-mm-embeds): the
encoder's own output for a picture, given as base64 of torch.save(tensor), gets the reply the
picture itself gets (LLaVA-1.5, LLaVA-NeXT, Gemma 3, whose image attends itself both ways; Qwen2-VL
with its image_grid_thw, which lays out its rotary positions); what a client gets wrong is a 400
naming `messages`; a server without the flag, and Qwen3-VL (DeepStack), refuse them."""

from __future__ import annotations

import base64
import io
import pickle

import httpx
import numpy as np
import pytest
import torch
from engine_http import all_free, serve_engine, tiny_parts
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.tiny_gemma3_vl import write_tiny_gemma3_vl
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen3_vl import write_tiny_qwen3_vl
from raycluster.server.images import image_spec_for

pytest.importorskip("transformers")


def _png(seed: int, size=(37, 29)) -> tuple[bytes, Image.Image]:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue(), Image.open(io.BytesIO(buf.getvalue()))


def _b64_tensor(t) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _ask(url: str, part: dict, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is in it"}]}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})


WRITERS = {"llava": lambda p: write_tiny_multimodal(p, "LlavaForConditionalGeneration", seed=1, vision_weights=True),
           "llava-next": lambda p: write_tiny_multimodal(p, "LlavaNextForConditionalGeneration", seed=3,
                                                         vision_weights=True),
           "gemma3": lambda p: write_tiny_gemma3_vl(p, seed=3),
           "qwen2-vl": lambda p: write_tiny_multimodal(p, "Qwen2VLForConditionalGeneration", seed=5,
                                                       vision_weights=True)}


@pytest.mark.parametrize("name", list(WRITERS))
def test_embeddings_stand_for_their_picture(tmp_path, name):
    path = WRITERS[name](tmp_path / name)
    model, tok = tiny_parts(path)
    enc = image_encoder_for(path)
    png, picture = _png(4, (30, 40))
    px, size, _ = image_facts(path).prepare(picture)
    embeds = enc.encode_images([(px, size)])[0]
    qwen = name == "qwen2-vl"
    grid = _b64_tensor(torch.tensor(enc.grid.grid_thw(size))) if qwen else None

    def payload(e):         # Qwen-VL's mapping form carries the grid
        return {"image_embeds": _b64_tensor(e), "image_grid_thw": grid} if qwen else _b64_tensor(e)

    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=16)
    with serve_engine(cfg, model, tok, image_encoder=enc, images=image_spec_for(path, tok), mm_embeds=True) \
            as (url, aeng):
        by_url = _ask(url, {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                                        base64.b64encode(png).decode()}})
        assert by_url.status_code == 200, by_url.text
        for given in (embeds, embeds[None], embeds.to(torch.bfloat16).float()):
            r = _ask(url, {"type": "image_embeds", "image_embeds": payload(given)})
            assert r.status_code == 200, r.text
            if given.dtype == torch.float32 and given.dim() == 2:
                assert r.json()["choices"][0]["message"]["content"] == \
                    by_url.json()["choices"][0]["message"]["content"]
            assert r.json()["usage"]["prompt_tokens"] == by_url.json()["usage"]["prompt_tokens"]

        def refused(payload, why):
            r = _ask(url, {"type": "image_embeds", "image_embeds": payload})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert why in r.json()["error"]["message"], r.text

        refused(payload(embeds[:, :-1]), "embeddings are")
        refused(payload(embeds.long()), "expected a float tensor")
        refused(payload(torch.full_like(embeds, float("nan"))), "NaN")
        refused("@@", "not base64")
        refused(base64.b64encode(pickle.dumps({"x": print}, protocol=2)).decode(), "not a torch.save'd tensor")
        if name == "llava":         # a fixed count: embeddings of another length do not fit
            refused(_b64_tensor(torch.cat([embeds, embeds])), "embeddings are")
            refused({"image_embeds": _b64_tensor(embeds), "image_grid_thw": _b64_tensor(torch.tensor([1, 2, 2]))},
                    "image_grid_thw is Qwen-VL's")
        if qwen:
            refused(_b64_tensor(embeds), "come with their image_grid_thw")
            t, h, w = enc.grid.grid_thw(size)
            for bad, why in (([2, h, w], "temporal grid is 1"), ([1, h + 1, w], "not a grid this model's"),
                             ([1, h, w, 1], "3 positive ints")):
                refused({"image_embeds": _b64_tensor(embeds), "image_grid_thw": _b64_tensor(torch.tensor(bad))}, why)
        assert all_free(aeng)


def test_a_server_without_the_flag_and_a_model_without_embeddings_refuse_them(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    part = {"type": "image_embeds", "image_embeds": _b64_tensor(torch.zeros(4, 64))}
    cfg = EngineConfig(kv_cache_tokens=1024, policy="fcfs", packer="token")
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok)) \
            as (url, aeng):
        r = _ask(url, part)
        assert r.status_code == 400 and "--enable-mm-embeds" in r.json()["error"]["message"], r.text
    qwen3 = write_tiny_qwen3_vl(tmp_path / "qwen3", seed=5)
    model, tok = tiny_parts(qwen3)
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(qwen3), images=image_spec_for(qwen3, tok),
                      mm_embeds=True) as (url, aeng):
        r = _ask(url, {"type": "image_embeds", "image_embeds": {
            "image_embeds": _b64_tensor(torch.zeros(4, 256)), "image_grid_thw": _b64_tensor(torch.tensor([1, 4, 4]))}})
        assert r.status_code == 400 and "served on LLaVA" in r.json()["error"]["message"], r.text
        assert all_free(aeng)


def test_the_flag_reaches_the_server_from_the_cli_and_the_app_args():
    from raycluster.cli import build_parser, detach_command
    from raycluster.cluster.config import ClusterConfig

    args = build_parser().parse_args(["engine-server", "--enable-mm-embeds"])
    assert args.enable_mm_embeds and "--enable-mm-embeds" in detach_command(args)
    assert not build_parser().parse_args(["engine-server"]).enable_mm_embeds
    assert ClusterConfig(enable_mm_embeds=True).enable_mm_embeds and not ClusterConfig().enable_mm_embeds
