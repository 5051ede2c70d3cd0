"""The Hugging Face baseline of `raycluster bench engine`: static batches through
`transformers` `generate` (left padded, greedy, every row generating its batch's longest
max_new_tokens), and the token agreement between two sets of outputs.

In: a loaded HF model and [(prompt ids, max_new_tokens)]; out: a dict of wall time, useful output
tokens (only what each request asked for) and the outputs themselves. transformers is imported
only when a model is loaded (it is a test/bench-time reference, not a serving dependency).
"""

from __future__ import annotations

import statistics
import time

import torch


def load_hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def static_batch(hf, batch, pad_id: int) -> tuple[list[list[int]], int]:
    """One static batch, left padded; every row generates exactly max(max_new) tokens."""
    plen = max(len(p) for p, _ in batch)
    mnt = max(m for _, m in batch)
    ids = torch.full((len(batch), plen), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), plen), dtype=torch.long)
    for i, (p, _) in enumerate(batch):
        ids[i, plen - len(p):] = torch.tensor(p)
        mask[i, plen - len(p):] = 1
    with torch.inference_mode():
        seq = hf.generate(ids, attention_mask=mask, max_new_tokens=mnt, min_new_tokens=mnt, do_sample=False,
                          pad_token_id=pad_id, top_p=None, top_k=None, temperature=None)
    gen = seq[:, plen:]
    if gen.shape[1] != mnt:
        raise RuntimeError(f"HF generated {gen.shape[1]} tokens, expected {mnt}")
    return [gen[i, :m].tolist() for i, (_, m) in enumerate(batch)], len(batch) * mnt


def run_hf(hf, workload, batch_size: int, pad_id: int) -> dict:
    t0 = time.perf_counter()
    outputs: list[list[int]] = []
    computed = 0
    for s in range(0, len(workload), batch_size):
        outs, n = static_batch(hf, workload[s:s + batch_size], pad_id)
        outputs.extend(outs)
        computed += n
    wall = time.perf_counter() - t0
    useful = sum(m for _, m in workload)
    return {"batch_size": batch_size, "wall_s": wall, "output_tokens": useful,
            "output_tokens_per_s": useful / wall, "generated_tokens_incl_padding": computed,
            "useful_fraction": useful / computed, "outputs": outputs}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first = sum(x[:1] == y[:1] for x, y in zip(a, b))
    full = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) / max(len(x), 1)
              for x, y in zip(a, b)]
    return {"first_token_equal": first / len(a), "all_tokens_equal": full / len(a),
            "mean_equal_prefix_fraction": statistics.fmean(prefix)}
