"""Images over real HTTP (raycluster.server.images): a tiny LLaVA served by one engine answers a
chat message with an image, given inline as a data URL, fetched from an http URL on loopback or read
from a file: URL under the allowed local media path,
with transformers' greedy tokens for the prompt `/tokenize` shows (its image token expanded), and
so does the Responses API given the image as an input_image part;
what a client gets wrong about an image is a 400 naming `messages`, and the engine is left clean."""

from __future__ import annotations

import base64
import json
import contextlib
import functools
import http.server
import io
import threading

import httpx
import numpy as np
import pytest
import torch
from engine_http import all_free, serve_engine, tiny_parts
from llava_reference import _greedy, hf_llava_greedy, hf_llava_next_greedy, hf_pixel_values
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.model.llava import image_encoder_for
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_llava_onevision import IMAGE_TOKEN_ID as OV_IMAGE_TOKEN_ID
from raycluster.model.tiny_llava_onevision import write_tiny_llava_onevision
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.server.images import MAX_IMAGES_PER_PROMPT, image_spec_for

pytest.importorskip("transformers")


def _png(seed: int, size=(37, 29)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _message(url: str, text: str = "what is in this picture") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


@contextlib.contextmanager
def _file_server(files: dict[str, bytes]):
    """An HTTP server on 127.0.0.1 serving `files` by path (404 otherwise)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=functools.partial(srv.serve_forever, poll_interval=0.05), daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        th.join(timeout=10)


def test_chat_with_images_over_http(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    enc = image_encoder_for(path)
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", enable_prefix_caching=True)
    png = _png(0)
    gen = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with _file_server({"/cat.png": png, "/junk.png": b"not an image"}) as files, \
            serve_engine(cfg, model, tok, image_encoder=enc, images=image_spec_for(path, tok)) as (url, aeng):
        r = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": [_message(_data_url(png))]})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids.count(IMAGE_TOKEN_ID) == enc.tokens_per_image == 4
        want = hf_llava_greedy(path, ids, hf_pixel_values(path, [Image.open(io.BytesIO(png))]), 10)
        for image_url in (_data_url(png), f"{files}/cat.png"):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [_message(image_url)], **gen})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["message"]["content"] == tok.decode(want)
            assert out["usage"]["prompt_tokens"] == len(ids)
        # The Responses API's input_image parts are the chat's image_url parts.
        r = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is in this picture"},
                                                   {"type": "input_image", "image_url": _data_url(png)}]}],
            "max_output_tokens": 10, "temperature": 0})
        assert r.status_code == 200, r.text
        stop = hf_llava_greedy(path, ids, hf_pixel_values(path, [Image.open(io.BytesIO(png))]), 10, stop_at_eos=True)
        assert r.json()["output"][-1]["content"][0]["text"] == tok.decode(stop)
        # Another picture, same text (a prefix-cache hit up to the image): its own tokens.
        other = _png(3)
        want_other = hf_llava_greedy(path, ids, hf_pixel_values(path, [Image.open(io.BytesIO(other))]), 10)
        assert want_other != want
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [_message(_data_url(other))], **gen})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == tok.decode(want_other)

        bad = {
            "data:image/png;base64,@@@": "not base64",
            "data:image/png,abc": "data:<type>;base64",
            _data_url(b"GIF89a-but-not-really"): "cannot decode image",
            f"{files}/junk.png": "cannot decode image",
            f"{files}/missing.png": "answered HTTP 404",
            "ftp://127.0.0.1/x.png": "must be http(s)://, data: or file:",
            "file:///etc/hostname": "file: URLs are not served",
        }
        for image_url, why in bad.items():
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [_message(image_url)], **gen})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (image_url, r.text)
            assert why in r.json()["error"]["message"], (image_url, r.text)
        many = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(png)}}]
                * (MAX_IMAGES_PER_PROMPT + 1)}
        assistant = {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _data_url(png)}}]}
        typed = _message(_data_url(png), "a literal <image> in the text")
        for messages, why in (([many], "at most"), ([_message(_data_url(png)), assistant], "belong in user messages"),
                              ([typed], "image tokens")):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": messages, **gen})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"messages": [_message(_data_url(png))], "truncate_prompt_tokens": 5, **gen})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert all_free(aeng)


def test_llava_next_images_of_two_sizes_over_http(tmp_path):
    """LLaVA-NeXT tiles each image by its size, so two images take different numbers of tokens;
    the reply equals transformers' for the prompt `/tokenize` shows and its processor's tiles."""
    from transformers import LlavaNextImageProcessor

    path = write_tiny_multimodal(tmp_path / "next", "LlavaNextForConditionalGeneration", seed=3, vision_weights=True,
                                 num_hidden_layers=2)
    model, tok = tiny_parts(path)
    enc = image_encoder_for(path)
    pngs = [_png(0, (30, 40)), _png(3, (100, 17))]
    parts = lambda png: {"type": "image_url", "image_url": {"url": _data_url(png)}}    # noqa: E731
    messages = [{"role": "user", "content": [parts(pngs[0]), {"type": "text", "text": "Compare"}, parts(pngs[1]),
                                             {"type": "text", "text": "these."}]}]
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=16)
    with serve_engine(cfg, model, tok, image_encoder=enc, images=image_spec_for(path, tok)) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        counts = [enc.tokens_for((30, 40)), enc.tokens_for((100, 17))]
        assert counts[0] != counts[1] and ids.count(IMAGE_TOKEN_ID) == sum(counts)
        hf = LlavaNextImageProcessor.from_pretrained(str(path))([Image.open(io.BytesIO(p)) for p in pngs],
                                                                return_tensors="pt")
        want = hf_llava_next_greedy(path, ids, hf["pixel_values"], hf["image_sizes"], 10)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert all_free(aeng)


def test_loadgen_sends_pictures_to_an_image_model(tmp_path):
    """`loadgen run --images 2`: chat messages with two pictures each, drawn from a pool of 3, all
    answered; the results record the image load, and repeated pictures are prefix-cache hits."""
    from loadgen.cli import main as loadgen

    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    cfg = EngineConfig(kv_cache_tokens=4096, policy="fcfs", packer="token", enable_prefix_caching=True, block_size=4)
    out = tmp_path / "run.json"
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok)) \
            as (url, aeng):
        assert loadgen(["run", "--url", url, "--workload", "chat", "--num-requests", "8", "--qps", "20", "--seed", "1",
                        "--max-output-tokens", "4", "--images", "2", "--image-size", "64x48", "--distinct-images", "3",
                        "--quiet", "--out", str(out)]) == 0
        hits = aeng.engine.kv.hit_tokens
        assert all_free(aeng)
    res = json.loads(out.read_text())
    assert res["summary"]["completed"] == 8 and res["summary"]["failed"] == 0
    assert res["meta"]["images"] == {"per_request": 2, "width": 64, "height": 48, "distinct": 3, "videos": 0,
                                     "frames": 8}
    assert hits > 0


def test_limit_mm_per_prompt(tmp_path):
    """vLLM's limit_mm_per_prompt: a server taking one image per request refuses two, naming the
    limit; the cluster config and the engine-server flag check it."""
    from raycluster.cli import build_parser, detach_command
    from raycluster.cluster.config import ClusterConfig
    from raycluster.server.images import image_limit

    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token")
    png = _png(0)
    two = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(png)}}] * 2}
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok),
                      max_images=1) as (url, aeng):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [two], "max_tokens": 2})
        assert r.status_code == 400 and "at most 1 per request (limit_mm_per_prompt)" in r.text, r.text
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [_message(_data_url(png))],
                                                                         "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert all_free(aeng)
    assert image_limit(None) == 16 and image_limit({"image": 0}) == 0
    assert ClusterConfig(limit_mm_per_prompt={"image": 3}).limit_mm_per_prompt == {"image": 3}
    assert ClusterConfig(limit_mm_per_prompt={"video": 1}).limit_mm_per_prompt == {"video": 1}
    for bad, why in (({"audio": 1}, "only 'image' and 'video'"), ({"image": -1}, "a count >= 0")):
        with pytest.raises(ValueError, match=why):
            ClusterConfig(limit_mm_per_prompt=bad)
    args = build_parser().parse_args(["engine-server", "--limit-mm-per-prompt", '{"image": 2}'])
    assert args.limit_mm_per_prompt == {"image": 2}
    cmd = detach_command(args)
    assert cmd[cmd.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'


def test_local_media_path(tmp_path):
    """vLLM's --allowed-local-media-path: file: URLs under the directory are read (the same tokens
    as the image inline, and the image encoded once: the encoder cache); outside it (by path, by
    `..`, by a link), missing, or with a host, a 400 naming `messages`."""
    from raycluster.cli import build_parser, detach_command
    from raycluster.cluster.config import ClusterConfig

    path = write_tiny_multimodal(tmp_path / "llava", "LlavaForConditionalGeneration", seed=1, vision_weights=True)
    model, tok = tiny_parts(path)
    media, outside = tmp_path / "media", tmp_path / "outside"
    media.mkdir()
    outside.mkdir()
    png = _png(0)
    (media / "cat 1.png").write_bytes(png)
    (outside / "dog.png").write_bytes(_png(1))
    (media / "link.png").symlink_to(outside / "dog.png")
    gen = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token")
    with serve_engine(cfg, model, tok, image_encoder=image_encoder_for(path), images=image_spec_for(path, tok),
                      allowed_local_media_path=str(media)) as (url, aeng):
        texts = []
        for image_url in (_data_url(png), f"file://{media}/cat%201.png", f"file://localhost{media}/cat%201.png"):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [_message(image_url)], **gen})
            assert r.status_code == 200, (image_url, r.text)
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[1:] == texts[:1] * 2
        # The same picture three times, no prefix cache: encoded once (vLLM's mm_cache metrics).
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'vllm:mm_cache_queries_total{model_name="tiny"} 3' in metrics
        assert 'vllm:mm_cache_hits_total{model_name="tiny"} 2' in metrics
        for image_url, why in ((f"file://{outside}/dog.png", "outside the allowed local media path"),
                               (f"file://{media}/../outside/dog.png", "outside the allowed local media path"),
                               (f"file://{media}/link.png", "outside the allowed local media path"),
                               (f"file://{media}/missing.png", "cannot read"),
                               (f"file://example.com{media}/cat%201.png", "names no host")):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"messages": [_message(image_url)], **gen})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (image_url, r.text)
            assert why in r.json()["error"]["message"], (image_url, r.text)
        assert all_free(aeng)
    assert ClusterConfig(allowed_local_media_path="/data").allowed_local_media_path == "/data"
    args = build_parser().parse_args(["engine-server", "--allowed-local-media-path", str(media)])
    cmd = detach_command(args)
    assert cmd[cmd.index("--allowed-local-media-path") + 1] == str(media)


def test_llava_onevision_images_over_http(tmp_path):
    """LLaVA-OneVision (its tiles shrunk under anyres_max for the larger picture): the reply equals
    transformers' for the prompt `/tokenize` shows and its processor's tiles."""
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil

    path = write_tiny_llava_onevision(tmp_path / "ov", seed=5)
    model, tok = tiny_parts(path)
    enc = image_encoder_for(path)
    pngs = [_png(1, (120, 90)), _png(2, (30, 40))]
    parts = lambda png: {"type": "image_url", "image_url": {"url": _data_url(png)}}    # noqa: E731
    messages = [{"role": "user", "content": [parts(pngs[0]), {"type": "text", "text": "Compare"}, parts(pngs[1]),
                                             {"type": "text", "text": "these."}]}]
    cfg = EngineConfig(kv_cache_tokens=2048, policy="fcfs", packer="token", chunk_size=64)
    with serve_engine(cfg, model, tok, image_encoder=enc, images=image_spec_for(path, tok)) as (url, aeng):
        ids = httpx.post(f"{url}/tokenize", timeout=30, json={"messages": messages}).json()["tokens"]
        assert ids.count(OV_IMAGE_TOKEN_ID) == enc.tokens_for((120, 90)) + enc.tokens_for((30, 40))
        hf = LlavaOnevisionImageProcessorPil.from_pretrained(str(path))(
            [Image.open(io.BytesIO(p)) for p in pngs], return_tensors="pt")
        ref = LlavaOnevisionForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
        want = _greedy(ref, ids, hf["pixel_values"], 10, False, image_sizes=hf["image_sizes"])
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want)
        assert all_free(aeng)
