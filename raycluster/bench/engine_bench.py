"""Engine throughput vs Hugging Face static batching, plus MBU/MFU against peaks measured in the
same run.

    raycluster bench engine [--model tiny|PATH] [--num-requests 64] [--threads N] [--seed S]
                            [--batch-size 16,64] --out FILE.json

Everything runs in one process, side by side, on the same torch threads, so a noisy shared
machine moves all figures together and the ratios stay meaningful:

1. Peaks: memory bandwidth (x.sum() / y.copy_(x) over a working set far larger than the LLC,
   plus one the size of the weights, i.e. cache resident) and fp32 matmul FLOP/s (torch.mm).
2. Throughput: the same N seeded requests of mixed lengths (prompts and outputs log-uniform in
   their ranges, random non-special token ids), greedy, every request generates exactly its
   max_tokens (engine: ignore_eos; HF: min_new_tokens = max_new_tokens). The engine gets all N
   at once and is stepped to completion (continuous batching). HF `generate` runs static
   batches of --batch-size in arrival order with left padding; a static batch runs until its
   longest request's max_new_tokens, and only the tokens each request asked for count as useful
   output. The best HF batch size is the baseline of the ratio.
3. Decode MBU: engine decode steps at batch sizes x KV lengths; the bound is
   (weight bytes read + KV bytes read) / DRAM bandwidth.
4. Prefill MFU: one request of T tokens alone (default chunked config and unchunked);
   achieved FLOP/s / matmul peak with FLOPs = 2 * P_matmul * T + 2 * H * V (logits of the one
   sampled row) + sum over layers of 4 * Hq * D * T (T + 1) / 2 (causal QK^T and PV).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from raycluster.bench.hf_baseline import agreement, load_hf, run_hf, static_batch
from raycluster.bench.hw_peaks import matmul_peak, memory_bandwidth
from raycluster.bench.model_facts import decode_weight_bytes, model_facts, prefill_flops
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams

FIRST_NORMAL_TOKEN = 6   # the tiny tokenizer's special tokens are 0..5; harmless for other models


@dataclass
class BenchOptions:
    model: str = "tiny"
    num_requests: int = 64
    threads: int | None = None
    seed: int = 0
    batch_sizes: list[int] = field(default_factory=lambda: [16, 64])
    prompt_len: tuple[int, int] = (16, 1024)
    output_len: tuple[int, int] = (16, 256)
    max_num_seqs: int = 128
    decode_batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    decode_kv_lens: list[int] = field(default_factory=lambda: [256, 1024])
    decode_steps: int = 10
    prefill_tokens: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    bandwidth_mb: int = 1024
    matmul_n: int = 2048
    skip_hf: bool = False
    # Scheduler of the throughput engine (stated in the JSON): FCFS + fixed-size token chunks, no
    # latency predictor, i.e. plain continuous batching. The micro-benchmarks always use this.
    policy: str = "fcfs"
    packer: str = "token"
    predictor: str = "none"


# ---- workload -------------------------------------------------------------------------------
def make_workload(n: int, seed: int, vocab: int, prompt_len=(16, 1024), output_len=(16, 256)
                  ) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_new_tokens) pairs; lengths log-uniform in the inclusive ranges."""
    rng = random.Random(seed)

    def loguniform(lo: int, hi: int) -> int:
        return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))

    out = []
    for _ in range(n):
        p = loguniform(*prompt_len)
        out.append(([rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(p)], loguniform(*output_len)))
    return out


# ---- timing helpers -------------------------------------------------------------------------
class _ForwardTimer:
    """Times the model's forward (hooks) and the runner's execute (wrapper) inside engine steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.forward_s = 0.0
        self.execute_s = 0.0
        self._t = 0.0
        model = engine.runner.model
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]
        self._runner = engine.runner
        inner = engine.runner.execute

        def execute(out):
            t0 = time.perf_counter()
            try:
                return inner(out)
            finally:
                self.execute_s += time.perf_counter() - t0
        engine.runner.execute = execute

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.forward_s += time.perf_counter() - self._t

    def reset(self) -> None:
        self.forward_s = self.execute_s = 0.0

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._runner.__dict__.pop("execute", None)


# The decode/prefill micro-benchmarks need deterministic step shapes (a pure decode of `batch`,
# fixed chunks): FCFS + token packer, no predictor (the default lars/medha scheduler would
# profile a predictor at start and pack time-budgeted chunks).
MICRO_SCHED = {"policy": "fcfs", "packer": "token", "predictor": "none"}


def _engine(model, threads: int | None, seed: int = 0, **cfg) -> LLMEngine:
    cfg = {**MICRO_SCHED, **cfg}
    return LLMEngine(EngineConfig(num_threads=threads, seed=seed, **cfg), model)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- engine throughput ----------------------------------------------------------------------
def run_engine(model, workload, threads: int | None, seed: int = 0, max_num_seqs: int = 128,
               sched: dict | None = None) -> dict:
    kv_need = sum(len(p) + m for p, m in workload) + 16 * len(workload)
    engine = _engine(model, threads, seed, max_num_seqs=max(max_num_seqs, len(workload)),
                     kv_cache_tokens=max(262144, kv_need), **(sched or {}))
    timer = _ForwardTimer(engine)
    t0 = time.perf_counter()
    reqs = [engine.add_request(f"bench-{i}", p, _greedy(m)) for i, (p, m) in enumerate(workload)]
    steps = prefill_steps = preempted = 0
    step_s = 0.0
    while engine.has_unfinished():
        r = engine.step()
        steps += 1
        step_s += r.duration_s
        prefill_steps += r.num_prefill_tokens > 0
        preempted += r.num_preempted
    wall = time.perf_counter() - t0
    timer.close()
    outputs = [list(r.output_token_ids) for r in reqs]
    n_out = sum(len(o) for o in outputs)
    exact = all(len(o) == m for o, (_, m) in zip(outputs, workload))
    return {
        "config": engine.config.model_dump(),
        "wall_s": wall, "output_tokens": n_out, "output_tokens_per_s": n_out / wall,
        "exact_lengths": exact, "steps": steps, "steps_with_prefill": prefill_steps,
        "preemptions": preempted,
        "time_in_model_forward_s": timer.forward_s,
        "time_in_runner_execute_s": timer.execute_s,
        "time_in_step_s": step_s,
        "outputs": outputs,
    }


# ---- decode MBU -----------------------------------------------------------------------------
def bench_decode(model, facts: dict, batch: int, kv_len: int, threads: int | None, steps: int,
                 bandwidth_Bps: float, llc_bandwidth_Bps: float | None = None, warmup: int = 2) -> dict:
    """Time pure decode steps of `batch` requests whose prompts are kv_len tokens."""
    bs = 16
    # Requests prefilled in earlier steps decode while later ones still prefill: leave room.
    max_tokens = batch * kv_len // 256 + warmup + steps + 16
    per_req = kv_len + max_tokens + 2 * bs
    engine = _engine(model, threads, kv_cache_tokens=batch * per_req + bs, max_num_seqs=max(batch, 1),
                     max_num_batched_tokens=max(2048, batch))
    rng = random.Random(kv_len * 1000 + batch)
    vocab = facts["vocab_size"]
    reqs = [engine.add_request(f"d{i}", [rng.randrange(FIRST_NORMAL_TOKEN, vocab) for _ in range(kv_len)],
                               _greedy(max_tokens)) for i in range(batch)]
    while not all(r.output_token_ids for r in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    timer = _ForwardTimer(engine)
    times, fwd, exe, kv_read = [], [], [], []
    for _ in range(steps):
        kv_now = sum(r.num_computed_tokens + 1 for r in reqs)   # KV read incl. the new token
        timer.reset()
        t0 = time.perf_counter()
        r = engine.step()
        times.append(time.perf_counter() - t0)
        if r.num_prefill_tokens or r.num_decode_tokens != batch:
            raise RuntimeError(f"decode bench step was not a pure decode of {batch}")
        fwd.append(timer.forward_s)
        exe.append(timer.execute_s)
        kv_read.append(kv_now)
    timer.close()
    step = statistics.median(times)
    forward = statistics.median(fwd)
    kv_bytes = statistics.fmean(kv_read) * facts["kv_bytes_per_token"]
    w_bytes = decode_weight_bytes(facts, batch) + batch * facts["hidden_size"] * facts["dtype_bytes"]
    bound = (w_bytes + kv_bytes) / bandwidth_Bps
    out = {
        "batch": batch, "kv_len": kv_len, "step_ms": step * 1e3, "forward_ms": forward * 1e3,
        "runner_execute_ms": statistics.median(exe) * 1e3,
        "overhead_outside_forward_ms": (step - forward) * 1e3,
        "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "bound_ms": bound * 1e3,
        "mbu": bound / step, "mbu_forward_only": bound / forward,
        "decode_tokens_per_s": batch / step,
    }
    if llc_bandwidth_Bps:
        out["mbu_vs_cache_bandwidth"] = (w_bytes + kv_bytes) / llc_bandwidth_Bps / step
    return out


# ---- prefill MFU ----------------------------------------------------------------------------
def bench_prefill(model, facts: dict, tokens: int, threads: int | None, peak_flops: float,
                  chunked: bool = True, reps: int = 2) -> dict:
    """One request of `tokens` prompt tokens alone; time from add to its first token."""
    bs = 16
    cfg = dict(kv_cache_tokens=tokens + 4 * bs, max_num_seqs=1)
    if not chunked:
        cfg.update(chunk_size=None, max_num_batched_tokens=max(2048, tokens))
    rng = random.Random(tokens)
    prompt = [rng.randrange(FIRST_NORMAL_TOKEN, facts["vocab_size"]) for _ in range(tokens)]
    best = None
    for _ in range(reps):
        engine = _engine(model, threads, **cfg)
        timer = _ForwardTimer(engine)
        req = engine.add_request("p", prompt, _greedy(1))
        t0 = time.perf_counter()
        steps = 0
        while not req.output_token_ids:
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
        timer.close()
        if best is None or wall < best[0]:
            best = (wall, timer.forward_s, steps, engine.config.chunk_size)
        del engine
    wall, forward, steps, chunk = best
    f = prefill_flops(facts, tokens)
    return {"tokens": tokens, "chunk_size": chunk, "steps": steps, "time_ms": wall * 1e3,
            "forward_ms": forward * 1e3, "flops": f, "achieved_GFLOPs": f["total"] / wall / 1e9,
            "mfu": f["total"] / wall / peak_flops, "mfu_forward_only": f["total"] / forward / peak_flops,
            "prefill_tokens_per_s": tokens / wall}


# ---- meta -----------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _meta(opts: BenchOptions, path: str, facts: dict, threads: int, load_start=None) -> dict:
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    return {
        "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "os_cpu_count": os.cpu_count(),
                    "hostname": platform.node(), "loadavg_start": load_start, "loadavg_end": _loadavg()},
        "threads": threads, "torch": torch.__version__, "transformers": tv, "python": sys.version.split()[0],
        "model": opts.model, "model_path": path, "model_config": facts,
        "options": asdict(opts),
        "notes": {
            "comparison": "Same requests, same checkpoint (fp32), same torch threads, one process. Greedy; "
                          "every request generates exactly its max_tokens (engine ignore_eos, HF "
                          "min_new_tokens = max_new_tokens).",
            "static_batching": "HF generate runs static batches of batch_size in arrival order with left "
                               "padding; a batch runs until its longest request's max_new_tokens, so shorter "
                               "requests' extra tokens are computed but not counted: output tokens = sum of "
                               "each request's max_tokens for both sides. The best HF batch size is the "
                               "baseline of the ratio.",
            "mbu": "bound = (decode weight bytes + batch * hidden * dtype + KV bytes of all batch sequences) / "
                   "DRAM bandwidth (best of x.sum() read, a gemv read and y.copy_(x) read+write over a working set >> LLC). "
                   "mbu = bound / median engine step time; mbu_forward_only uses the model forward alone. "
                   "The tiny model's weights may be cache resident, so mbu_vs_cache_bandwidth uses the "
                   "bandwidth measured over a weights-sized working set. A mixture-of-experts model's "
                   "experts count by the share a batch of b tokens is expected to touch, 1 - (1 - k/E)^b.",
            "mfu": "FLOPs = 2 * matmul_params_per_token (a MoE model's: its top-k experts) * T + 2 * hidden * vocab (one sampled row) + "
                   "num_layers * 4 * num_heads * head_dim * T * (T + 1) / 2 (causal QK^T and PV); "
                   "mfu = FLOPs / prefill wall time / fp32 torch.mm peak (best of reps).",
            "peaks": "best of several repetitions: the bound is what this machine can do.",
            "scheduler": f"throughput engine: policy={opts.policy}, packer={opts.packer}, predictor={opts.predictor} "
                         f"(also results.engine.config); decode/prefill micro-benchmarks: {MICRO_SCHED}.",
        },
    }


# ---- driver ---------------------------------------------------------------------------------
def run(opts: BenchOptions, log=print) -> dict:
    """Run every part of the benchmark; torch's thread count is restored afterwards."""
    saved_threads = torch.get_num_threads()
    try:
        return _run(opts, log)
    finally:
        torch.set_num_threads(saved_threads)


def _run(opts: BenchOptions, log) -> dict:
    from raycluster.model.loader import load_model
    from raycluster.model.registry import resolve_model_path

    if opts.threads:
        torch.set_num_threads(opts.threads)
    threads = torch.get_num_threads()
    t_start = time.perf_counter()
    load_start = _loadavg()
    path = resolve_model_path(opts.model)
    model, mcfg = load_model(path)
    facts = model_facts(model)
    results: dict = {}

    log(f"[bench] threads={threads}; measuring machine peaks")
    dram = memory_bandwidth(opts.bandwidth_mb << 20)
    cache = memory_bandwidth(facts["decode_weight_bytes"], reps=20)
    mm = matmul_peak(opts.matmul_n)
    log(f"[bench] DRAM {dram['peak_GBps']:.1f} GB/s, weights-sized {cache['peak_GBps']:.1f} GB/s, "
        f"matmul {mm['peak_GFLOPs']:.1f} GFLOP/s")
    results["peaks"] = {"dram_bandwidth": dram, "weights_sized_bandwidth": cache, "matmul": mm}

    workload = make_workload(opts.num_requests, opts.seed, mcfg.vocab_size, opts.prompt_len, opts.output_len)
    results["workload"] = {
        "num_requests": len(workload), "seed": opts.seed,
        "prompt_tokens": sum(len(p) for p, _ in workload), "output_tokens": sum(m for _, m in workload),
        "prompt_len": {"min": min(len(p) for p, _ in workload), "max": max(len(p) for p, _ in workload),
                       "mean": statistics.fmean(len(p) for p, _ in workload)},
        "output_len": {"min": min(m for _, m in workload), "max": max(m for _, m in workload),
                       "mean": statistics.fmean(m for _, m in workload)},
    }

    # Warm up both sides once on a small input.
    _engine(model, threads).generate([[FIRST_NORMAL_TOKEN + 1] * 8] * 2, _greedy(4))
    log("[bench] engine throughput")
    sched = {"policy": opts.policy, "packer": opts.packer, "predictor": opts.predictor}
    eng = run_engine(model, workload, threads, opts.seed, opts.max_num_seqs, sched)
    eng["scheduler"] = sched
    log(f"[bench] engine {eng['output_tokens_per_s']:.1f} tok/s ({eng['wall_s']:.1f} s)")
    engine_outputs = eng.pop("outputs")
    results["engine"] = eng

    if not opts.skip_hf:
        hf = load_hf(path)
        pad = mcfg.eos_token_id[0] if mcfg.eos_token_id else 0
        pad = getattr(hf.config, "pad_token_id", None) if getattr(hf.config, "pad_token_id", None) is not None else pad
        static_batch(hf, [([FIRST_NORMAL_TOKEN + 1] * 8, 4)] * 2, pad)
        runs = []
        for b in opts.batch_sizes:
            log(f"[bench] HF generate, static batches of {b}")
            r = run_hf(hf, workload, b, pad)
            log(f"[bench] HF b={b}: {r['output_tokens_per_s']:.1f} tok/s ({r['wall_s']:.1f} s)")
            r["agreement_with_engine"] = agreement(engine_outputs, r.pop("outputs"))
            runs.append(r)
        best = max(runs, key=lambda r: r["output_tokens_per_s"])
        results["hf"] = {"attn_implementation": getattr(hf.config, "_attn_implementation", None),
                         "runs": runs, "best_batch_size": best["batch_size"],
                         "output_tokens_per_s": best["output_tokens_per_s"]}
        results["speedup_vs_hf"] = eng["output_tokens_per_s"] / best["output_tokens_per_s"]
        results["speedup_target"] = 3.0
        results["meets_target"] = results["speedup_vs_hf"] >= 3.0
        del hf

    log("[bench] decode MBU")
    results["decode"] = [bench_decode(model, facts, b, L, threads, opts.decode_steps, dram["peak_GBps"] * 1e9,
                                      cache["peak_GBps"] * 1e9)
                         for L in opts.decode_kv_lens for b in opts.decode_batches]
    log("[bench] prefill MFU")
    peak = mm["peak_GFLOPs"] * 1e9
    results["prefill"] = [bench_prefill(model, facts, t, threads, peak, chunked=c)
                          for t in opts.prefill_tokens for c in (True, False)]
    results["total_wall_s"] = time.perf_counter() - t_start
    return {"meta": _meta(opts, path, facts, threads, load_start), "results": results}


def summary(report: dict) -> str:
    r = report["results"]
    p = r["peaks"]
    sched = r["engine"].get("scheduler", {})
    lines = [f"engine scheduler: {sched}", f"threads={report['meta']['threads']}  DRAM {p['dram_bandwidth']['peak_GBps']:.1f} GB/s  "
             f"weights-sized {p['weights_sized_bandwidth']['peak_GBps']:.1f} GB/s  "
             f"matmul {p['matmul']['peak_GFLOPs']:.1f} GFLOP/s",
             f"workload: {r['workload']['num_requests']} requests, {r['workload']['prompt_tokens']} prompt / "
             f"{r['workload']['output_tokens']} output tokens",
             f"{'side':<22}{'wall s':>9}{'out tok/s':>11}",
             f"{'engine':<22}{r['engine']['wall_s']:>9.2f}{r['engine']['output_tokens_per_s']:>11.1f}"]
    if "hf" in r:
        for run_ in r["hf"]["runs"]:
            lines.append(f"{'HF static b=' + str(run_['batch_size']):<22}{run_['wall_s']:>9.2f}"
                         f"{run_['output_tokens_per_s']:>11.1f}   useful {run_['useful_fraction']:.0%}")
        lines.append(f"speedup vs best HF (b={r['hf']['best_batch_size']}): {r['speedup_vs_hf']:.2f}x "
                     f"(target 3x: {'met' if r['meets_target'] else 'MISSED'})")
    lines.append(f"{'decode b':>8}{'kv':>6}{'step ms':>9}{'fwd ms':>8}{'bound ms':>9}{'MBU':>7}{'MBU fwd':>8}")
    for d in r["decode"]:
        lines.append(f"{d['batch']:>8}{d['kv_len']:>6}{d['step_ms']:>9.2f}{d['forward_ms']:>8.2f}"
                     f"{d['bound_ms']:>9.3f}{d['mbu']:>7.1%}{d['mbu_forward_only']:>8.1%}")
    lines.append(f"{'prefill T':>9}{'chunk':>7}{'ms':>9}{'GFLOP/s':>9}{'MFU':>7}")
    for x in r["prefill"]:
        lines.append(f"{x['tokens']:>9}{str(x['chunk_size']):>7}{x['time_ms']:>9.1f}{x['achieved_GFLOPs']:>9.1f}"
                     f"{x['mfu']:>7.1%}")
    lines.append(f"total wall {r['total_wall_s']:.1f} s")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raycluster bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a checkpoint directory")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=_ints, default=[16, 64],
                   help="HF static batch size(s), comma separated; the best is the baseline")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--decode-batches", type=_ints, default=[1, 16, 64])
    p.add_argument("--decode-kv-lens", type=_ints, default=[256, 1024])
    p.add_argument("--prefill-tokens", type=_ints, default=[512, 2048, 8192])
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--policy", default="fcfs", help="throughput engine's policy (micro-benchmarks: fcfs)")
    p.add_argument("--packer", default="token", choices=["token", "medha"], help="throughput engine's packer")
    p.add_argument("--predictor", default="none", help="throughput engine's predictor")
    p.add_argument("--out", required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "engine":
        argv = argv[1:]
    a = build_parser().parse_args(argv)
    opts = BenchOptions(model=a.model, num_requests=a.num_requests, threads=a.threads, seed=a.seed,
                        batch_sizes=a.batch_size, prompt_len=tuple(a.prompt_len), output_len=tuple(a.output_len),
                        max_num_seqs=a.max_num_seqs, decode_batches=a.decode_batches,
                        decode_kv_lens=a.decode_kv_lens, prefill_tokens=a.prefill_tokens, skip_hf=a.skip_hf,
                        policy=a.policy, packer=a.packer, predictor=a.predictor)
    report = run(opts, log=lambda m: print(m, file=sys.stderr, flush=True))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(summary(report))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
