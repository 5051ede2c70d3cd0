"""Synthetic prompt text of a target token length, built from a shipped word list.

Owns WORDS -- 161 frequent English words that byte-level BPE tokenizers encode as one token
each when preceded by a space (checked against the project's tiny-model tokenizer, where a text
of n words is exactly n tokens plus BOS; such frequent words are single tokens in GPT-2 / Llama-3 /
Qwen vocabularies too) -- and the two functions that turn a prompt *segment*, a (seed, n_tokens)
pair, into text or token ids. Data enters as segments
from `workloads.WorkloadRequest.segments`; it leaves as a str (about one token per word, so
length ~= n_tokens, plus a BOS token if the server adds one) or a list of ints.
Segments make prompts lazy (the simulator never builds the text of a 1M-token prompt) and make
shared prefixes exact: a multi-turn session re-sends the same segments, hence the same text.
"""

from __future__ import annotations

import numpy as np

WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from it an were are which this be has had not
but one their its after new who first two they more time she when her would into over only there
most during up can may some out years many about three world where then year under he them both
city early through made than while school used part later between any being back use before how
what four will so like people could just long until found should home end day music
did set good best number right large make small own power little house south water times become
still very several much system without case book never order river line late least history left
does down data side open light short next body free local must build less need play old past
full rather hand child space age men white red blue green love road
""".split())

# De-duplicated, order kept: the same seed gives the same text on every machine.
WORDS = tuple(dict.fromkeys(WORDS))


def segment_text(seed: int, n_tokens: int) -> str:
    """`n_tokens` words drawn with a generator seeded by `seed`, each preceded by one space."""
    if n_tokens <= 0:
        return ""
    idx = np.random.default_rng(seed).integers(0, len(WORDS), size=n_tokens)
    return "".join(" " + WORDS[i] for i in idx)  # leading space: the first word is one token too


def segment_ids(seed: int, n_tokens: int, id_range: tuple[int, int] = (100, 1000)) -> list[int]:
    """`n_tokens` token ids uniform in [lo, hi), seeded by `seed` (exact length, any tokenizer)."""
    if n_tokens <= 0:
        return []
    lo, hi = id_range
    return np.random.default_rng(seed).integers(lo, hi, size=n_tokens).tolist()
