"""Images through the P/D cluster over real HTTP: a tiny LLaVA (and Qwen2-VL, Gemma 3) whose gateway
loads and preprocesses each image and puts its pixels in Ray's object store, whose router carries
the handles to the prefill instance (a tp 2 group of
Ray-actor ranks for short prompts, a single-process instance for long ones), which encodes them and
hands the KV to a decode instance. Each chat reply equals transformers' greedy tokens; afterwards
nothing is in flight and every instance's KV is free."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
from cluster_http import drained_status
from gemma3_reference import hf_gemma3_greedy
from gemma3_reference import hf_pixel_values as gemma3_pixels
from llava_reference import hf_llava_greedy, hf_pixel_values
from qwen_vl_reference import hf_qwen_vl_greedy, hf_qwen_vl_processor
from PIL import Image
from serve_app import deployed_app

from raycluster.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
pytest.importorskip("transformers")

ROUTER = "router-images"


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(31, 45, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _reference(arch: str, path, ids: list[int], png: bytes) -> list[int]:
    """transformers' 12 greedy tokens for the expanded prompt `ids` with the image `png`."""
    image = Image.open(io.BytesIO(png))
    if arch == "LlavaForConditionalGeneration":
        return hf_llava_greedy(path, ids, hf_pixel_values(path, [image]), 12)
    if arch == "Gemma3ForConditionalGeneration":
        return hf_gemma3_greedy(path, ids, gemma3_pixels(path, [image]), 12)
    hf = hf_qwen_vl_processor(path).image_processor([image], return_tensors="pt")
    return hf_qwen_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 12)


@pytest.mark.parametrize("arch,seed", [("LlavaForConditionalGeneration", 1), ("Qwen2VLForConditionalGeneration", 5),
                                       ("Gemma3ForConditionalGeneration", 3)])
def test_image_chats_through_pd_pools(ray_cluster, tmp_path, arch, seed):
    """LLaVA, Qwen2-VL (whose multimodal RoPE positions the tp ranks and the decode side lay
    out from the request's images) and Gemma 3 (whose images attend both ways, each computed in one step)."""
    from raycluster.model.tiny_gemma3_vl import write_tiny_gemma3_vl
    from raycluster.model.tiny_multimodal import write_tiny_multimodal

    path = write_tiny_gemma3_vl(tmp_path / "vlm", seed=seed) if arch == "Gemma3ForConditionalGeneration" else \
        write_tiny_multimodal(tmp_path / "vlm", arch, seed=seed, vision_weights=True)
    cfg = {"model": path, "policy": "lars", "threads_per_instance": 1, "router_name": f"{ROUTER}-{seed}",
           "connector": "torch_dist", "initial_l_m": 32, "engine": {"kv_cache_tokens": 4096, "chunk_size": 16},
           "pools": [{"role": "prefill-short", "instances": 1, "engine": {"tp": 2, "group_launch": "ray"}},
                     {"role": "prefill-long", "instances": 1},
                     {"role": "decode", "instances": 1, "engine": {"policy": "fcfs", "packer": "token"}}]}
    texts = ["what is in this picture", "describe it " * 20 + "in one line"]      # short, long
    pngs = [_png(0), _png(3)]
    tok = Tokenizer(path)
    with deployed_app(cfg, f"{ROUTER}-{seed}", 300, "images cluster") as url:
        # /health answers once one instance serves; the tp group's ranks may start later.
        deadline = time.monotonic() + 120
        while len(httpx.get(url + "/v1/cluster/status", timeout=5).json()["instances"]) < 3:
            assert time.monotonic() < deadline, "the three instances did not all register"
            time.sleep(0.5)
        for text, png in zip(texts, pngs):
            url_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
            messages = [{"role": "user", "content": [{"type": "text", "text": text}, url_part]}]
            ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
            want = _reference(arch, path, ids, png)
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == tok.decode(want), (len(ids), text)
        if arch == "Qwen2VLForConditionalGeneration":
            _check_video(url, path, tok)
        status = drained_status(url)
        # (The pressure controller may have moved the tp group to another pool by now.)
        assert sorted(i["layout"] for i in status["instances"]) == ["single", "single", "tp2"]
        assert status["model"]["images"] and not status["model"]["text_only"]


def _check_video(url: str, path, tok) -> None:
    """A chat with a video (three frames, vLLM's frame list) answered with transformers' tokens."""
    import torch
    from llava_reference import _greedy
    from qwen_vl_reference import hf_qwen_vl

    from raycluster.model.llava import image_facts
    from raycluster.model.tiny_qwen_vl import VIDEO_TOKEN_ID

    rng = np.random.default_rng(11)
    frames = []
    for _ in range(3):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(28, 420, 3), dtype=np.uint8)).save(buf, "JPEG")
        frames.append(buf.getvalue())
    video = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}},
                                             {"type": "text", "text": "what happens"}]}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    facts = image_facts(path)
    pixels, size, n = facts.prepare_video([Image.open(io.BytesIO(f)) for f in frames])
    assert ids.count(VIDEO_TOKEN_ID) == n
    t, h, w = facts.video_grid.grid_thw(size)
    want = _greedy(hf_qwen_vl(str(path)), ids, None, 12, False, pixel_values_videos=pixels,
                   video_grid_thw=torch.tensor([[t, h, w]]),
                   mm_token_type_ids=torch.tensor([[2 if i == VIDEO_TOKEN_ID else 0 for i in ids]]))
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)


def test_image_hop_bench_runs_both_ways(ray_cluster, tmp_path):
    """`raycluster bench image-hop`: each case's pixels come back whole both ways, and the router
    passes a handle faster than the pixels of the largest image."""
    import argparse

    from raycluster.bench.image_hop_bench import run

    res = run(argparse.Namespace(repeats=2, concurrent=2, out=str(tmp_path / "hop.json")))
    big = res["cases"]["qwen2-vl 1280x960"]
    assert big["mb"] > 20 and big["router_ratio_handle_over_pixels"] < 1
