"""Drives an engine through arrivals at given steps (a shared helper of the no-Ray engine tests)."""

from __future__ import annotations


def run_arrivals(eng, arrivals, max_steps: int = 5000, step_s: float = 0.01, after_step=None) -> dict:
    """Add each (step, id, prompt, sampling) at its step and step until done (bounded in steps),
    advancing the engine's virtual clock by `step_s` and calling `after_step(eng)` after each
    step; checks the KV is consistent and all free at the end. Returns the requests by id."""
    reqs, pending = {}, sorted(arrivals, key=lambda a: a[0])
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, rid, prompt, sp = pending.pop(0)
            reqs[rid] = eng.add_request(rid, prompt, sp)
        if not pending and not eng.has_unfinished():
            break
        eng.step()
        eng.clock.advance(step_s)
        if after_step is not None:
            after_step(eng)
    else:
        raise AssertionError("did not finish")
    eng.kv.check()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return reqs


def shared_prefix_arrivals(rng, n: int, prefix_len: tuple[int, int], last_step: int, max_tokens: tuple[int, int]):
    """`n` arrivals (step, id, prompt, sampling) at random steps up to `last_step`: each prompt is
    one of 3 random prefixes (lengths in `prefix_len`) plus 1-19 random tokens; greedy up to a
    random `max_tokens`, EOS ignored. Token ids in [3, 500)."""
    from raycluster.request import SamplingParams

    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(*prefix_len))] for _ in range(3)]
    arrivals = []
    for i in range(n):
        p = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))]
        arrivals.append((rng.randrange(0, last_step), f"q{i}", p,
                         SamplingParams(max_tokens=rng.randrange(*max_tokens), ignore_eos=True)))
    return arrivals


def pooled_vectors(eng, prompts, max_steps: int = 500) -> list:
    """Each prompt's pooling output (`Request.embedding` as a tensor: a vector, or a classifier's
    logits), the prompts run together as pooling requests; checks the KV is all free after."""
    import torch

    from raycluster.request import SamplingParams
    reqs = [eng.add_request(f"pool{i}", p, SamplingParams(max_tokens=1, embed=True)) for i, p in enumerate(prompts)]
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        eng.step()
    else:
        raise AssertionError("did not finish")
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [torch.tensor(r.embedding) for r in reqs]
