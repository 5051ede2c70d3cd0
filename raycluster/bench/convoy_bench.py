"""The convoy effect on the real engine: one trace with a few long prompts among short ones,
replayed in real time through one engine per scheduling configuration, side by side in one run.

    raycluster bench convoy [--qps 2] [--duration 60] [--long-fraction 0.05]
                            [--long-tokens 4096:8192] [--configs fcfs-unchunked,fcfs,lars] --out F.json

Configurations: `fcfs-unchunked` (non-preemptive prefill), `fcfs` (chunked prefill where a
prefill may take the whole token budget, as vLLM's default scheduler does), `lars` (Medha:
LARS order, time-budget packer). Requests carry no TTFT SLO of their own, so every request's
deadline is Medha's max(ttft_ms, ttft_scale x predicted isolated prefill time), computed with the
same profiled predictor for every configuration. Output: per configuration, the loadgen results
schema (`summary`, `by_class`) plus the long requests' deadline attainment, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from loadgen.metrics import RequestRecord, build_results
from loadgen.workloads import make_workload
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.profiler import load_or_profile
from raycluster.model.loader import load_model
from raycluster.model.registry import resolve_model_path
from raycluster.model.tokenizer import Tokenizer
from raycluster.request import SamplingParams

CONFIGS = {
    "fcfs-unchunked": dict(policy="fcfs", packer="token", chunk_size=None),
    "fcfs": dict(policy="fcfs", packer="token", chunk_size=2048),
    "lars": dict(policy="lars", packer="medha"),
}


def replay(engine: LLMEngine, work, id_range: tuple[int, int], max_wall_s: float) -> list[RequestRecord]:
    """Submit each request at its arrival offset while stepping; TTFT = first token - arrival."""
    pending = sorted(work, key=lambda w: w.arrival_s)
    records: dict[str, RequestRecord] = {}
    reqs = {}
    t0 = time.monotonic()
    i = 0
    while (i < len(pending) or engine.has_unfinished()) and time.monotonic() - t0 < max_wall_s:
        now = time.monotonic() - t0
        while i < len(pending) and pending[i].arrival_s <= now:
            w = pending[i]
            reqs[w.request_id] = engine.add_request(
                w.request_id, w.prompt_token_ids(id_range),
                SamplingParams(max_tokens=w.output_tokens, ignore_eos=True), arrival_time=t0 + w.arrival_s)
            records[w.request_id] = RequestRecord(w.request_id, w.arrival_s, send_s=w.arrival_s, klass=w.klass,
                                                  prompt_tokens=len(reqs[w.request_id].prompt_token_ids),
                                                  expected_output_tokens=w.output_tokens,
                                                  tpot_slo_ms=w.tpot_slo_ms)
            i += 1
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[i].arrival_s - now)) if i < len(pending) else 0)
            continue
        step = engine.step()
        for out in step.outputs:
            rec = records[out.request_id]
            t = time.monotonic() - t0
            if rec.first_token_s is None and out.new_token_ids:
                rec.first_token_s = t
            rec.num_output_tokens = out.num_output_tokens
            if out.finished:
                rec.finish_s = t
    for rid, rec in records.items():
        if rec.finish_s is None:
            rec.status, rec.error = "timeout", "benchmark wall-clock limit"
            engine.abort_request(rid)
    return list(records.values())


def deadline_s(predictor, cfg: EngineConfig, prompt_tokens: int) -> float:
    return max(cfg.ttft_ms / 1e3, cfg.ttft_scale * predictor.prefill_time(prompt_tokens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench convoy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--long-tokens", default="4096:8192")
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--ttft-ms", type=float, default=500.0,
                    help="TTFT SLO of requests without one (deadline = max(this, ttft_scale x isolated prefill))")
    ap.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT SLO; the medha packer's step budget")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.long_tokens.split(":"))
    work = make_workload("long-mix", seed=args.seed, qps=args.qps, duration=args.duration,
                         long_fraction=args.long_fraction, long_tokens=(lo, hi),
                         max_output_tokens=args.max_output_tokens)
    path = resolve_model_path(args.model)
    model, mcfg = load_model(path)
    tok = Tokenizer(path, mcfg.eos_token_id)
    id_range = (6, mcfg.vocab_size)
    results: dict = {"meta": {"argv": sys.argv, "workload": work.params, "num_requests": len(work),
                              "threads": args.threads, "model": args.model, "ttft_ms": args.ttft_ms,
                              "tpot_ms": args.tpot_ms}, "runs": {}}
    predictor = None
    for name in args.configs.split(","):
        cfg = EngineConfig(**CONFIGS[name], kv_cache_tokens=131072, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms,
                           predictor="none" if name.startswith("fcfs") else "auto")
        engine = LLMEngine(cfg, model, tok)
        predictor = predictor or engine.predictor or load_or_profile(
            engine.runner, engine.max_model_len, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        print(f"convoy: running {name} on {len(work)} requests ...", flush=True)
        records = replay(engine, work, id_range, max_wall_s=args.duration * 6 + 120)
        for rec in records:
            rec.ttft_slo_ms = 1e3 * deadline_s(predictor, cfg, rec.prompt_tokens)
        res = build_results(records, {"config": name, **CONFIGS[name]})
        results["runs"][name] = {k: res[k] for k in ("meta", "summary", "by_class")}
        s = res["by_class"].get("short", {})
        l = res["by_class"].get("long", {})
        print(f"  {name:15s} short TTFT p50 {s.get('ttft_p50_s')} p99 {s.get('ttft_p99_s')}; "
              f"long TTFT-deadline attainment {l.get('ttft_slo_attainment')}", flush=True)
    runs = results["runs"]
    if "lars" in runs:
        for base in ("fcfs", "fcfs-unchunked"):
            if base in runs:
                b, x = runs[base]["by_class"]["short"], runs["lars"]["by_class"]["short"]
                results[f"ratio_{base}_over_lars"] = {
                    k: (b[k] / x[k] if b.get(k) and x.get(k) else None) for k in ("ttft_p50_s", "ttft_p99_s")}
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    for k, v in results.items():
        if k.startswith("ratio_"):
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
