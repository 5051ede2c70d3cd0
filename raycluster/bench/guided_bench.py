"""Structured outputs on one engine: what enforcing a JSON schema costs a batch of requests.

    raycluster bench guided [--model tiny|PATH] [--num-requests 16] [--max-tokens 64]
                            [--rounds 5] [--threads 1] --out FILE.json

`--num-requests` prompts run as one burst, exactly `--max-tokens` tokens each (ignore_eos: the
output runs on with EOS once the JSON is complete), once free and once under a JSON schema
whose string field is long enough that most tokens stay allowed. The two runs alternate in
each round on the same engine (the pattern compiled before the first), so a noisy shared host
moves both alike; the figure to quote is the median ratio of guided to free output tokens per
second. The time `GuidedDecoding.mask` takes per step that samples guided rows is reported too, and every guided
output is checked to start with a schema-valid JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.guided import Regex
from raycluster.request import SamplingParams
from raycluster.server.structured import schema_regex

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                           "draft": {"type": "boolean"}},
          "required": ["title", "draft"]}


def _burst(eng: LLMEngine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> tuple[float, list]:
    t0 = time.perf_counter()
    reqs = [eng.add_request(f"{tag}-{i}", p, sp) for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0, [list(r.output_token_ids) for r in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench guided", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    eng = LLMEngine.from_config(EngineConfig(model=args.model, policy="fcfs", packer="token", predictor="none",
                                             num_threads=args.threads))
    tok = eng.tokenizer
    regex = schema_regex(SCHEMA, "schema")
    t0 = time.perf_counter()
    eng.guided_decoding().index(Regex(regex))
    compile_s = time.perf_counter() - t0
    guided = eng.guided_decoding()
    mask_s, mask_calls = [0.0], [0]
    timed_mask = guided.mask

    def mask(*a, **kw):
        t = time.perf_counter()
        try:
            return timed_mask(*a, **kw)
        finally:
            mask_s[0] += time.perf_counter() - t
            mask_calls[0] += 1

    guided.mask = mask          # this engine only: time the masking inside the steps
    prompts = [tok.encode(f"Write the title of essay number {i}:") for i in range(args.num_requests)]
    rate = {"free": [], "guided": []}
    valid = True
    for rnd in range(args.rounds):
        order = ("free", "guided") if rnd % 2 == 0 else ("guided", "free")
        for kind in order:
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                guided_regex=regex if kind == "guided" else None)
            before = mask_s[0]
            dt, outs = _burst(eng, prompts, sp, f"{kind}{rnd}")
            rate[kind].append(sum(map(len, outs)) / dt)
            if kind == "guided":
                for o in outs:
                    text = tok.decode(o)
                    try:
                        doc = json.loads(text)
                        valid &= set(doc) == {"title", "draft"} and isinstance(doc["draft"], bool)
                    except ValueError:
                        valid &= len(o) == args.max_tokens      # cut by max_tokens, not broken
                assert mask_s[0] > before
    res = {
        "config": vars(args),
        "compile_s": compile_s,
        "tokens_per_s": {k: statistics.median(v) for k, v in rate.items()},
        "guided_over_free": statistics.median(g / f for g, f in zip(rate["guided"], rate["free"])),
        "mask_ms_per_step": 1e3 * mask_s[0] / max(1, mask_calls[0]),
        "valid": valid,
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=2))
    return 0 if valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
