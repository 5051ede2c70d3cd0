"""One greedy completion over the gateway's HTTP API, streamed or not (the Ray e2e tests' client)."""

from __future__ import annotations

import json

import httpx


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
