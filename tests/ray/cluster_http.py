"""The Ray e2e tests' client side: one greedy completion over the gateway's HTTP API (streamed or
not), the status of a cluster once it has drained, and the text one in-process engine gives."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest


async def complete(client: httpx.AsyncClient, url: str, prompt, max_tokens: int, stream: bool) -> str:
    """The completion's text: `prompt` (text or token ids), greedy, exactly `max_tokens` tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    parts = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(parts)


def complete_all(url: str, prompts: list, max_tokens: int) -> list[str]:
    """`complete` of every prompt at once (odd ones streamed), in prompt order."""
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(complete(client, url, p, max_tokens, i % 2 == 1)
                                          for i, p in enumerate(prompts)))
    return asyncio.run(run())


def drained_status(url: str, timeout: float = 30.0) -> dict:
    """The cluster's status once nothing is in flight and every instance's KV is free and it runs
    nothing (fails the test if that does not happen within `timeout`)."""
    deadline = time.monotonic() + timeout
    status = {}
    while time.monotonic() < deadline:
        status = httpx.get(url + "/v1/cluster/status", timeout=5).json()
        if status["inflight"] == 0 and all(i["kv_free_blocks"] == i["kv_total_blocks"] and not i["running"]
                                           for i in status["instances"]):
            return status
        time.sleep(0.3)
    pytest.fail(f"cluster did not drain: {status}")


def single_engine_texts(path: str, prompts: list[list[int]], max_tokens: int, **load) -> list[str]:
    """Greedy texts of exactly `max_tokens` tokens from one in-process engine on the checkpoint
    (`load`: load_model's options): what the cluster must give."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import SamplingParams

    model, mcfg = load_model(path, **load)
    eng = LLMEngine(EngineConfig(policy="fcfs", packer="token", kv_cache_tokens=16384), model)
    tok = Tokenizer(path, mcfg.eos_token_id)
    return [tok.decode(o) for o in eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
