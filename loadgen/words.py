"""Synthetic prompt text of a target token length, built from a shipped word list.

Owns: WORDS (common English words that byte-level BPE tokenizers such as GPT-2's, Llama-3's and
Qwen's encode as one token each when preceded by a space) and the two functions that turn a
prompt *segment* -- a (seed, n_tokens) pair -- into text or token ids. Data enters as segments
from `workloads.WorkloadRequest.segments`; it leaves as a str (about one token per word, so
length ~= n_tokens, plus a BOS token if the server adds one) or a list of ints.
Segments make prompts lazy (the simulator never builds the text of a 1M-token prompt) and make
shared prefixes exact: a multi-turn session re-sends the same segments, hence the same text.
"""

from __future__ import annotations

import numpy as np

WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his it an were are which this be
has had not but one their its after new who first two also they been more time other all
she when her would into over only there state most during up can may some out years many
about three world where these such then most year under he them both city high early
through made than while school used film part later between since well known any being
back work use well before same second how each what four will so like people could great
just life long him until against found should game home team public end day music then
national place group including among each three did band made take set last good best
show number name right large make small own power point little house small area family
south north east west water times found series period become still around general major
very show several much run given system without best case three season book water never
order river form within family country line late government least history main however
land left field does third down data side open light city war short today along next body
free general local must upon build church role less need play held old past full below
club early south point true rather hand role real child start model level word space
age men women black white red blue green love head fact road room care lead road body
""".split())

# De-duplicated, order kept: the same seed gives the same text on every machine.
WORDS = tuple(dict.fromkeys(WORDS))


def segment_text(seed: int, n_tokens: int) -> str:
    """`n_tokens` words drawn with a generator seeded by `seed`, joined by single spaces."""
    if n_tokens <= 0:
        return ""
    idx = np.random.default_rng(seed).integers(0, len(WORDS), size=n_tokens)
    return " ".join(WORDS[i] for i in idx)


def segment_ids(seed: int, n_tokens: int, id_range: tuple[int, int] = (100, 1000)) -> list[int]:
    """`n_tokens` token ids uniform in [lo, hi), seeded by `seed` (exact length, any tokenizer)."""
    if n_tokens <= 0:
        return []
    lo, hi = id_range
    return np.random.default_rng(seed).integers(lo, hi, size=n_tokens).tolist()
