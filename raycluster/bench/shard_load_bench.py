"""Memory of a TP / SPP / SPP x TP engine's leader: built from a loaded full model (what every
group did before shard loading: the leader keeps the full model and cuts its shard from it)
against built from the checkpoint path (each rank reads only its part).

    python -m raycluster.bench.shard_load_bench --model PATH [--tp 2] [--spp 1]
        [--launch threads,ray] [--out FILE.json]

Each (launch, mode) runs in a fresh process, which reports the parameter bytes the leader keeps
(every tensor reachable from the engine's model, the runner's model and the leader rank's own
shard, each counted once), the process's peak RSS (VmHWM; not getrusage's ru_maxrss, which a
child process inherits from before its exec), its peak anonymous
RSS (`PeakAnon`: private memory, without the mapped checkpoint's file pages) and both before
loading (imports, Ray client). With `threads` the other ranks live in the same process, so the
RSS is the whole group's; with `ray` they are actors and the RSS is the leader's alone. The
"before" mode gives thread ranks no path, as before (they cut their shards from the leader's
model); Ray ranks always load their own part now. Both modes generate the same 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

GEN = 8


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM: this process's peak RSS, RssAnon)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """The peak of this process's anonymous RSS (RssAnon: its private memory, the tensors),
    sampled every few ms on a thread. The peak RSS also counts the checkpoint's file pages
    while safetensors has the file mapped: clean page cache, touched by any read of the
    tensors' bytes (a slice along dim 1 touches every row), which the kernel may drop."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        return _status_bytes("RssAnon")

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now())


def _leader_param_bytes(eng) -> int:
    from raycluster.parallel.shard import GroupModel

    runner = eng.runner
    mods = [r.model for r in (getattr(runner, "rank0", None), getattr(runner, "stage", None)) if r is not None]
    for m in (eng.model, runner.model):
        mods.append(m.leader_shard if isinstance(m, GroupModel) else m)
    seen = {}
    for m in mods:
        for p in m.parameters():
            if p.device.type != "meta":       # the whole storage: a view keeps all of it
                seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def _one(path: str, mode: str, launch: str, tp: int, spp: int) -> dict:
    """Build, generate, measure, close: run in a process of its own."""
    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_config, load_model
    from raycluster.parallel.factory import build_runner
    from raycluster.request import SamplingParams

    if launch == "ray":
        import ray
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        ray.init(num_cpus=spp * tp, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": env}, logging_level="ERROR")
    cfg = EngineConfig(model=path, tp=tp, spp=spp, group_launch=launch, policy="fcfs", packer="token",
                       predictor="none", num_threads=1, kv_cache_tokens=1024, group_timeout_s=120)
    cfg = cfg.for_model(load_config(path).dtype)
    rss0, anon0 = _status_bytes("VmRSS"), PeakAnon.now()
    anon = PeakAnon()
    if mode == "after":
        eng = LLMEngine.from_config(cfg)
    else:
        model, _ = load_model(path, dtype=cfg.torch_dtype())
        runner = build_runner(cfg, model, cfg.torch_dtype(), model_path=path if launch == "ray" else None)
        eng = LLMEngine(cfg, model, runner=runner)
    try:
        tokens = eng.generate([[7, 8, 9, 10, 11]], SamplingParams(max_tokens=GEN, ignore_eos=True))[0]
        out = {"mode": mode, "launch": launch, "layout": eng.runner.layout, "tokens": tokens,
               "leader_param_bytes": _leader_param_bytes(eng), "rss_before_load_bytes": rss0,
               "peak_rss_bytes": _status_bytes("VmHWM"),
               "anon_before_load_bytes": anon0, "peak_anon_bytes": anon.stop()}
    finally:
        eng.close()
        if launch == "ray":
            ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raycluster.bench.shard_load_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--spp", type=int, default=1)
    ap.add_argument("--launch", default="threads,ray")
    ap.add_argument("--out")
    ap.add_argument("--one", help=argparse.SUPPRESS)        # mode:launch, run in this process
    args = ap.parse_args(argv)
    if args.one:
        mode, launch = args.one.split(":")
        print(json.dumps(_one(args.model, mode, launch, args.tp, args.spp)))
        return 0
    import math

    import torch

    from raycluster.engine.config import EngineConfig
    from raycluster.model.loader import load_config, model_shapes

    # From the shapes alone: this process loads nothing (its children are measured).
    elem = torch.empty((), dtype=EngineConfig().for_model(load_config(args.model).dtype).torch_dtype()).element_size()
    model_bytes = sum(math.prod(s) for s in model_shapes(load_config(args.model)).values()) * elem
    rows = []
    for launch in args.launch.split(","):
        for mode in ("before", "after"):
            cmd = [sys.executable, "-m", "raycluster.bench.shard_load_bench", "--model", args.model,
                   "--tp", str(args.tp), "--spp", str(args.spp), "--one", f"{mode}:{launch}"]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    mb = 1 << 20
    print(f"full model parameters: {model_bytes / mb:.0f} MiB")
    for r in rows:
        print(f"{r['launch']:8s} {r['layout']:9s} {r['mode']:6s} leader params {r['leader_param_bytes'] / mb:6.0f} MiB"
              f"  peak RSS {r['peak_rss_bytes'] / mb:6.0f} MiB (before loading {r['rss_before_load_bytes'] / mb:.0f})"
              f"  peak anon {r['peak_anon_bytes'] / mb:6.0f} MiB (before loading {r['anon_before_load_bytes'] / mb:.0f})"
              f"  tokens {r['tokens']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_param_bytes": model_bytes, "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
