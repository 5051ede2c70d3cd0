"""Draft tokens for speculative decoding by n-gram prompt lookup (vLLM's `method: ngram`).

After a step samples a decoding request's token, the engine asks `NgramProposer.propose` for
drafts: the longest suffix of the request's tokens (between `prompt_lookup_max` and
`prompt_lookup_min` tokens long) that also occurs earlier in them, and the tokens that followed
its latest earlier occurrence, at most `k`. They wait on the request (`Request.spec_token_ids`);
the scheduler runs the request's last token and its drafts as one chunk when the step has budget
and KV for them (`SchedulerOutput.spec_tokens`), and `Sampler.verify` keeps the drafts the
model agrees with plus one token of its own. Costs nothing but a lookup when nothing repeats.

`drafts_allowed(sp)` says which requests may draft: not those whose next token depends on
output-history processing the verifier does not replay per row (penalties, logit bias, min_tokens,
allowed ids, bad words) or on a structured-output state machine. They decode a token per step.
"""

from __future__ import annotations

import numpy as np

from raycluster.request import SamplingParams


def drafts_allowed(sp: SamplingParams) -> bool:
    return not sp.penalized and sp.guided_regex is None and sp.guided_grammar is None


class NgramProposer:
    def __init__(self, k: int, max_n: int, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default the proposer's) tokens that followed the latest earlier occurrence
        of the longest matching suffix of `tokens`; [] when no suffix of min_n tokens recurs."""
        k = self.k if k is None else min(k, self.k)
        n = len(tokens)
        if k <= 0 or n <= self.min_n:
            return []
        arr = np.asarray(tokens)
        # match[e]: how many tokens before position e equal the context's last ones, for every
        # e < n where a continuation could start (capped at max_n).
        ends = np.arange(1, n)
        match = np.zeros(n - 1, dtype=np.int64)
        alive = np.ones(n - 1, dtype=bool)
        for j in range(1, min(self.max_n, n - 1) + 1):
            alive[:j - 1] = False                  # windows that would start before the context
            alive[j - 1:] &= arr[ends[j - 1:] - j] == arr[n - j]
            if not alive.any():
                break
            match += alive
        best = int(match.max())
        if best < self.min_n:
            return []
        e = int(ends[np.flatnonzero(match == best)[-1]])
        return arr[e:e + k].tolist()
