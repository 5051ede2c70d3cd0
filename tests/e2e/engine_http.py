"""Serve one engine over real HTTP on 127.0.0.1 for the e2e tests: the OpenAI app (`build_app`)
on an `AsyncEngine`, under uvicorn in a daemon thread, torn down when the context exits."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.loader import load_model
from raycluster.model.tokenizer import Tokenizer
from raycluster.server.app import build_app
from raycluster.ports import free_port
from raycluster.server.async_engine import AsyncEngine


def tiny_parts(path) -> tuple:
    """(model, tokenizer) of the checkpoint at `path`."""
    model, mcfg = load_model(path)
    return model, Tokenizer(path, mcfg.eos_token_id)


@contextlib.contextmanager
def serve_engine(config: EngineConfig, model, tok, log_level: str = "warning", api_keys=(),
                 tool_call_parser: str | None = None, names=("tiny",), sampling_defaults: dict | None = None,
                 log_requests: bool = False, reasoning_parser: str | None = None,
                 allow_runtime_lora: bool | None = None, lora_resolver_dir: str | None = None,
                 lora_resolver_max_loaded: int | None = None, response_store=None, image_encoder=None,
                 images=None, max_images: int = 16, allowed_local_media_path: str | None = None,
                 mm_embeds: bool = False):
    """Yields (base URL, the AsyncEngine) while the server runs (`api_keys`, `tool_call_parser`,
    `names`, `sampling_defaults`, `log_requests`, `reasoning_parser`, `allow_runtime_lora`,
    `lora_resolver_dir`, `lora_resolver_max_loaded`, `response_store`, `images`, `max_images`,
    `allowed_local_media_path`, `mm_embeds`: build_app's;
    `image_encoder`: the engine's)."""
    engine = LLMEngine(config, model, tok, image_encoder=image_encoder)
    aeng = AsyncEngine(engine)
    port = free_port()
    app = build_app(aeng, tok, names, api_keys=api_keys, tool_call_parser=tool_call_parser,
                    sampling_defaults=sampling_defaults, log_requests=log_requests,
                    reasoning_parser=reasoning_parser, allow_runtime_lora=allow_runtime_lora,
                    lora_resolver_dir=lora_resolver_dir, lora_resolver_max_loaded=lora_resolver_max_loaded,
                    model_config=model.config, response_store=response_store, images=images, max_images=max_images,
                    allowed_local_media_path=allowed_local_media_path, mm_embeds=mm_embeds)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start in 30 s"
    try:
        yield f"http://127.0.0.1:{port}", aeng
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        aeng.shutdown()


@contextlib.contextmanager
def served_with_reference(tiny_model_dir):
    """Yields (URL, AsyncEngine, tokenizer, reference engine): the tiny checkpoint served with
    prefix caching under the names tiny and tiny-alias, and an engine on the same weights without
    it, for exact greedy comparisons (so each also checks that cached prefixes change no token)."""
    model, tok = tiny_parts(tiny_model_dir)
    cfg = EngineConfig(kv_cache_tokens=8192, policy="fcfs", packer="token", enable_prefix_caching=True)
    with serve_engine(cfg, model, tok, names=("tiny", "tiny-alias")) as (url, aeng):
        ref = LLMEngine(EngineConfig(kv_cache_tokens=8192, policy="fcfs", packer="token"), model, tok)
        yield url, aeng, tok, ref


def all_free(aeng, timeout: float = 5.0) -> bool:
    """Whether the served engine holds no request and all its KV is free (checked consistent),
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kv = aeng.engine.kv
        if kv.num_free_blocks == kv.num_blocks and not aeng.engine.has_unfinished():
            kv.check()
            return True
        time.sleep(0.02)
    return False

