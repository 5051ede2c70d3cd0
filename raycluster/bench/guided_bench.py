"""Structured outputs on one engine: what enforcing a JSON schema costs a batch of requests, as a
regular expression (outlines-core) and as the same language written as a grammar (llguidance).

    raycluster bench guided [--model tiny|PATH] [--num-requests 16] [--max-tokens 64]
                            [--rounds 5] [--threads 1] --out FILE.json

`--num-requests` prompts run as one burst, exactly `--max-tokens` tokens each (ignore_eos: the
output runs on with EOS once the JSON is complete), free, under a JSON schema whose string
field is long enough that most tokens stay allowed (`guided`: its regex), and under a Lark
grammar of the same objects (`grammar`). The runs rotate their order in each round on the same
engine (the patterns compiled before the first), so a noisy shared host moves all alike; the
figures to quote are the median ratios of guided (and grammar) to free output tokens per
second. The time `GuidedDecoding.mask` takes per step that samples guided rows is reported per
kind too, and every constrained output is checked to start with a schema-valid JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.guided import Grammar, Regex
from raycluster.request import SamplingParams
from raycluster.server.structured import schema_regex

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                           "draft": {"type": "boolean"}},
          "required": ["title", "draft"]}
# SCHEMA's objects as a grammar: the regex's whitespace (one optional space) and JSON strings.
GRAMMAR = r"""
start: "{" S? "\"title\"" S? ":" S? TITLE S? "," S? "\"draft\"" S? ":" S? ("true" | "false") S? "}"
S: " "
TITLE: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,400}"/
"""
KINDS = ("free", "guided", "grammar")


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
    compile_s = {}
    for name, constraint in (("guided", Regex(regex)), ("grammar", Grammar(GRAMMAR))):
        t0 = time.perf_counter()
        eng.guided_decoding().index(constraint)
        compile_s[name] = time.perf_counter() - t0
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
    rate = {k: [] for k in KINDS}
    mask_ms = {"guided": [], "grammar": []}
    valid = True
    for rnd in range(args.rounds):
        for kind in KINDS[rnd % 3:] + KINDS[:rnd % 3]:
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                guided_regex=regex if kind == "guided" else None,
                                guided_grammar=GRAMMAR if kind == "grammar" else None)
            before, calls = mask_s[0], mask_calls[0]
            dt, outs = _burst(eng, prompts, sp, f"{kind}{rnd}")
            rate[kind].append(sum(map(len, outs)) / dt)
            if kind != "free":
                for o in outs:
                    text = tok.decode([t for t in o if t not in eng.eos_token_ids])
                    try:
                        doc = json.loads(text)
                        valid &= set(doc) == {"title", "draft"} and isinstance(doc["draft"], bool)
                    except ValueError:
                        valid &= len(o) == args.max_tokens      # cut by max_tokens, not broken
                assert mask_s[0] > before
                mask_ms[kind].append(1e3 * (mask_s[0] - before) / (mask_calls[0] - calls))
    res = {
        "config": vars(args),
        "compile_s": compile_s,
        "tokens_per_s": {k: statistics.median(v) for k, v in rate.items()},
        "guided_over_free": statistics.median(g / f for g, f in zip(rate["guided"], rate["free"])),
        "grammar_over_free": statistics.median(g / f for g, f in zip(rate["grammar"], rate["free"])),
        "mask_ms_per_step": {k: statistics.median(v) for k, v in mask_ms.items()},
        "valid": valid,
    }
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=2))
    return 0 if valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
