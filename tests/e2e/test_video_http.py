"""Videos over real HTTP on Qwen2-VL, Qwen2.5-VL and LLaVA-OneVision: a chat message with a video (vLLM's frame list,
data:video/jpeg;base64,<frame>,...) and an image is answered with transformers' greedy tokens for
the prompt `/tokenize` shows; what a client gets wrong about a video is a 400 naming `messages`
(containers, bad frames, frames of two sizes, too many videos, a model without videos), and the
engine is left clean."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from engine_http import all_free, serve_engine, tiny_parts
from llava_reference import _greedy
from PIL import Image
from qwen_vl_reference import hf_qwen_vl

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen_vl import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID
from raycluster.server.images import image_spec_for, template_content
from raycluster.server.protocol import ChatMessage

pytest.importorskip("transformers")


def _frame(h: int, w: int, seed: int, fmt: str = "JPEG") -> tuple[bytes, Image.Image]:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue(), Image.open(io.BytesIO(buf.getvalue()))


def _video_url(frames: list[bytes]) -> str:
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _video_then_picture(frames: list[tuple[bytes, Image.Image]]) -> tuple[list[dict], Image.Image]:
    """A user message of the video, "and", a 60x40 picture and the question; and that picture."""
    png, picture = _frame(60, 40, 9, "PNG")
    return [{"role": "user", "content": [
        _video_part(_video_url([f for f, _ in frames])), {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": "what happens?"}]}], picture


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_chat_with_a_video_and_an_image(tmp_path, arch):
    path = write_tiny_multimodal(tmp_path / "q", arch, seed=6, vision_weights=True, num_hidden_layers=2)
    model, tok = tiny_parts(path)
    spec = image_spec_for(path, tok)
    assert spec.video_text == "<|vision_start|><|video_pad|><|vision_end|>"
    frames = [_frame(28, 420, s) for s in range(3)]           # wide frames: see test_qwen_vl_video
    messages, picture = _video_then_picture(frames)
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=16)
    facts, enc = image_facts(path), image_encoder_for(path)
    with serve_engine(cfg, model, tok, image_encoder=enc, images=spec) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        vpx, vsize, vn = facts.prepare_video([im for _, im in frames])
        ipx, isize, inn = facts.prepare(picture)
        assert vsize == (3, 28, 420) and ids.count(VIDEO_TOKEN_ID) == vn and ids.count(IMAGE_TOKEN_ID) == inn
        assert ids.index(VIDEO_TOKEN_ID) < ids.index(IMAGE_TOKEN_ID)
        types_ = torch.tensor([[2 if t == VIDEO_TOKEN_ID else 1 if t == IMAGE_TOKEN_ID else 0 for t in ids]])
        extra = {"second_per_grid_ts": torch.tensor([1.0])} if arch.startswith("Qwen2_5") else {}
        want = _greedy(hf_qwen_vl(str(path)), ids, ipx, 10, False, image_grid_thw=torch.tensor([enc.grid.grid_thw(isize)]),
                       pixel_values_videos=vpx, video_grid_thw=torch.tensor([enc.video_grid.grid_thw(vsize)]),
                       mm_token_type_ids=types_, **extra)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)

        def refused(content, why):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert why in r.json()["error"]["message"], r.text

        frame = frames[0][0]
        refused([_video_part("data:video/mp4;base64,AAAA")], "container files")
        refused([_video_part("https://127.0.0.1:9/clip.mp4")], "container files")
        refused([_video_part("data:video/jpeg;base64,@@@")], "frame 0 is not base64")
        refused([_video_part(_video_url([frame, b"not an image"]))], "frame 1: cannot decode")
        refused([_video_part(_video_url([frame, _frame(30, 40, 1)[0]]))], "one size")
        refused([_video_part(_video_url([frame]))] * 3, "3 videos; this server takes at most 2")
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200
        assert all_free(aeng)


def test_a_model_without_videos_refuses_them(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    cfg = EngineConfig(kv_cache_tokens=1024, policy="fcfs", packer="token")
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok)) \
            as (url, aeng):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [{"role": "user", "content": [
            _video_part(_video_url([_frame(28, 28, 0)[0]]))]}], "max_tokens": 2})
        assert r.status_code == 400 and "takes no videos" in r.json()["error"]["message"], r.text
        assert all_free(aeng)


def test_a_string_template_gets_the_video_placeholder_text():
    m = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:x"}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "data:y"}}]})
    image, video = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    assert template_content(m, False, image, video) == f"{video}\n{image}\nand"
    assert template_content(m, True, image, video) == [{"type": "video"}, {"type": "text", "text": "and"},
                                                       {"type": "image"}]
    with pytest.raises(ValueError, match="belong in user messages"):
        ChatMessage.model_validate({"role": "assistant", "content": [{"type": "video_url", "video_url": {"url": "x"}}]})


def test_llava_onevision_chat_with_a_video_and_an_image(tmp_path):
    """LLaVA-OneVision: each frame a tile pooled 2 x 2, a newline after the video; the reply equals
    transformers' for the prompt `/tokenize` shows."""
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil

    from raycluster.model.tiny_llava_onevision import IMAGE_TOKEN_ID as OV_IMAGE, VIDEO_TOKEN_ID as OV_VIDEO
    from raycluster.model.tiny_llava_onevision import write_tiny_llava_onevision

    path = write_tiny_llava_onevision(tmp_path / "ov", seed=7)
    model, tok = tiny_parts(path)
    spec = image_spec_for(path, tok)
    assert spec.video_text == "<video>"
    frames = [_frame(40, 50, s) for s in range(4)]
    messages, picture = _video_then_picture(frames)
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=16)
    facts, enc = image_facts(path), image_encoder_for(path)
    with serve_engine(cfg, model, tok, image_encoder=enc, images=spec) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        vpx, vsize, vn = facts.prepare_video([im for _, im in frames])
        assert vsize == (4, 40, 50) and ids.count(OV_VIDEO) == vn == enc.tokens_for(vsize)
        assert ids.count(OV_IMAGE) == enc.tokens_for((60, 40))
        hf = LlavaOnevisionImageProcessorPil.from_pretrained(str(path))([picture], return_tensors="pt")
        ref = LlavaOnevisionForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
        want = _greedy(ref, ids, hf["pixel_values"], 10, False, image_sizes=hf["image_sizes"],
                       pixel_values_videos=vpx[None])
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert all_free(aeng)


def test_loadgen_sends_videos_to_a_video_model(tmp_path):
    """`loadgen run --videos 1 --images 1`: chat messages with a frame-list video and a picture,
    drawn from a pool of 2, all answered; the results record the load; repeated videos are
    prefix-cache hits. `raycluster sim` refuses --videos (it simulates pictures only)."""
    import json

    from loadgen.cli import main as loadgen
    from raycluster.sim.cli import main as sim_main

    path = write_tiny_multimodal(tmp_path / "q", "Qwen2VLForConditionalGeneration", seed=6, vision_weights=True,
                                 num_hidden_layers=2)
    model, tok = tiny_parts(path)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", enable_prefix_caching=True, block_size=4)
    out = tmp_path / "run.json"
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok)) \
            as (url, aeng):
        assert loadgen(["run", "--url", url, "--workload", "chat", "--num-requests", "6", "--qps", "20", "--seed", "1",
                        "--max-output-tokens", "3", "--videos", "1", "--video-frames", "3", "--images", "1",
                        "--image-size", "56x28", "--distinct-images", "2", "--quiet", "--out", str(out)]) == 0
        hits = aeng.engine.kv.hit_tokens
        assert all_free(aeng)
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 6 and res["summary"]["failed"] == 0
    assert res["meta"]["images"] == {"per_request": 1, "width": 56, "height": 28, "distinct": 2, "videos": 1,
                                     "frames": 3}
    assert hits > 0
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"gpu": "a100", "model": "llama-3-8b", "vision": "clip-vit-l-336"}))
    assert sim_main(["--cluster", str(spec), "--workload", "chat", "--num-requests", "2", "--videos", "1",
                     "--out", str(tmp_path / "o.json"), "--quiet"]) == 2
