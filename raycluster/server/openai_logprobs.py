"""OpenAI `logprobs` objects built from the engine's per-token log-probabilities.

Data enters as token ids with one `TokenLogprob` each (the token's log-probability and its top
alternatives, `raycluster.request`) and leaves as the JSON shapes of OpenAI's two APIs:
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat
(`content: [{token, logprob, bytes, top_logprobs}]`). Token strings are each id decoded alone,
so a character split over several byte-level tokens shows as replacement characters there, as in
other servers; `text_offset` counts those strings from `offset` on.
"""

from __future__ import annotations

from raycluster.request import TokenLogprob


def completion_logprobs(decode, token_ids: list[int], lps: list[TokenLogprob | None], offset: int = 0) -> dict:
    """`lps` entries may be None (an echoed prompt's first token): null logprob and top there."""
    tokens = [decode([t]) for t in token_ids]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in lps],
            "top_logprobs": [None if e is None else {decode([t]): v for t, v in e[1]} for e in lps],
            "text_offset": offsets}


def chat_logprobs(decode, token_ids: list[int], lps: list[TokenLogprob]) -> dict:
    def entry(t: int, v: float) -> dict:
        s = decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                        for t, (lp, top) in zip(token_ids, lps)]}
