"""Kill the router of a running local cluster mid-stream and measure how the streams recover.

    raycluster up --detach && python scripts/router_restart_check.py [--url URL] [--streams 8]

Runs the same greedy streams twice, undisturbed and with `ray.kill(router, no_restart=False)`
partway through (Ray restarts the actor; gateways resubmit, instances drop what they held).
Prints the longest pause between two tokens of a stream in each run, whether the texts are equal,
and the cluster's state afterwards (router id, requests in flight, KV free, resubmissions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import ray


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                  times: list[float], text: list[str]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text.append(c["text"])
                    times.append(time.monotonic())


async def _run(url: str, prompts: list[list[int]], max_tokens: int, router=None, kill_after_s: float = 2.0):
    times: list[list[float]] = [[] for _ in prompts]
    texts: list[list[str]] = [[] for _ in prompts]
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(_stream(client, url, p, max_tokens, times[i], texts[i]))
                 for i, p in enumerate(prompts)]
        if router is not None:
            await asyncio.sleep(kill_after_s)
            await asyncio.to_thread(ray.kill, router, no_restart=False)   # off the event loop
        await asyncio.gather(*tasks)
    pauses = [max((b - a for a, b in zip(ts, ts[1:])), default=0.0) for ts in times]
    return pauses, ["".join(t) for t in texts]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--router", default="raycluster-router")
    args = ap.parse_args()
    ray.init(address="auto", namespace="raycluster", logging_level="ERROR")
    router = ray.get_actor(args.router, namespace="raycluster")
    prompts = [[(7 * i + j) % 900 + 6 for j in range(30 + 40 * i)] for i in range(args.streams)]
    calm, want = asyncio.run(_run(args.url, prompts, args.max_tokens))
    pauses, got = asyncio.run(_run(args.url, prompts, args.max_tokens, router))
    med = sorted(pauses)[len(pauses) // 2]
    print(f"longest pause between two tokens of a stream: median {med:.2f} s, max {max(pauses):.2f} s "
          f"(undisturbed run: max {max(calm):.2f} s)")
    print(f"texts equal the undisturbed run: {got == want}")
    time.sleep(3)
    st = httpx.get(args.url + "/v1/cluster/status", timeout=30).json()
    free = all(i["kv_free_blocks"] == i["kv_total_blocks"] for i in st["instances"])
    print(f"router {st['router_id']}, in flight {st['inflight']}, KV all free {free}, "
          f"resubmitted so far {httpx.get(args.url + '/health', timeout=30).json().get('resubmitted')}")
    return 0 if got == want else 1


if __name__ == "__main__":
    raise SystemExit(main())
