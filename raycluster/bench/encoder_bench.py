"""What the engine's encoder path costs against transformers on the same BERT-style checkpoint:
a batch of pooling requests through one engine (whole prompts, one step; attention in length
groups) vs transformers' model over the batch padded to its longest prompt, and over the prompts
one by one.

    raycluster bench encoder [--model PATH] [--requests 64] [--mixes uniform,skewed] [--rounds 5]
                             [--threads 2] [--out FILE.json]

Without --model a random checkpoint of all-MiniLM-L6's shape (6 layers, hidden 384, 12 heads,
intermediate 1536, vocab 30522, 512 positions) is written to a temporary directory. Mixes:
`uniform` (prompt lengths 16-128), `skewed` (one 512-token prompt, the rest 8-32: what padding
to the longest costs). The three ways run in turn --rounds times per mix; medians and their
ratios to the engine's, so the ratios hold on a noisy host. transformers is imported here only
(it is a bench-time reference, not a serving dependency).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
              hidden_act="gelu", pad_token_id=0, architectures=["BertModel"], model_type="bert")


def write_random_bert(path: Path, seed: int = 0) -> Path:
    """A BertModel checkpoint of MINILM's shape with random weights (config.json + safetensors)."""
    from safetensors.torch import save_file

    from raycluster.model.bert import BertEncoderModel
    from raycluster.model.config import ModelConfig

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = BertEncoderModel(ModelConfig.from_dict(MINILM))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(MINILM))
    return path


def _prompts(mix: str, n: int, vocab: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Random token ids of the mix's lengths (cut to the model's context)."""
    lengths = [rng.randint(16, 128) for _ in range(n)] if mix == "uniform" else \
        [512] + [rng.randint(8, 32) for _ in range(n - 1)]
    return [[rng.randrange(5, vocab) for _ in range(min(k, max_len))] for k in lengths]


def run(args: argparse.Namespace) -> dict:
    import transformers

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.model.loader import load_model
    from raycluster.request import SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else write_random_bert(Path(tmp) / "bert")
        model, mcfg = load_model(path)
        hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    eng = LLMEngine(EngineConfig(kv_cache_tokens=65536, policy="fcfs", predictor="none",
                                 max_num_batched_tokens=16384, max_num_seqs=args.requests), model)
    rng = random.Random(args.seed)
    sampling = SamplingParams(embed=True)
    counter = iter(range(10 ** 9))

    def engine(prompts):
        for p in prompts:
            eng.add_request(f"r{next(counter)}", p, sampling)
        for _ in range(100):
            if not eng.has_unfinished():
                return
            eng.step()
        raise RuntimeError("the engine did not finish the batch in 100 steps")

    def padded(prompts):
        ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=mask)

    def one_by_one(prompts):
        with torch.no_grad():
            for p in prompts:
                hf(input_ids=torch.tensor([p]))

    ways = {"engine (one step)": engine, "transformers, padded batch": padded, "transformers, one by one": one_by_one}
    out = {"model": str(args.model or "random all-MiniLM-L6 shape"), "threads": args.threads, "mixes": {}}
    for mix in args.mixes:
        prompts = _prompts(mix, args.requests, mcfg.vocab_size, mcfg.max_model_len, rng)
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn(prompts)
                times[name].append(time.perf_counter() - t0)
        ours = statistics.median(times["engine (one step)"])
        tokens = sum(map(len, prompts))
        out["mixes"][mix] = {"requests": len(prompts), "tokens": tokens,
                             "ways": {name: {"median_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t),
                                             "vs_engine": statistics.median(t) / ours} for name, t in times.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raycluster bench encoder", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a BERT-style checkpoint (default: a random MiniLM-shaped one)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--mixes", type=lambda s: s.split(","), default=["uniform", "skewed"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args)
    for mix, r in result["mixes"].items():
        print(f"{mix}: {r['requests']} prompts, {r['tokens']} tokens")
        for name, w in r["ways"].items():
            print(f"  {name:28s} {w['median_s'] * 1000:8.0f} ms  {w['tokens_per_s']:8.0f} tok/s  {w['vs_engine']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
