"""OpenAI `logprobs` objects, and vLLM's `prompt_logprobs`, built from the engine's per-token
log-probabilities.

Data enters as token ids with one `TokenLogprob` each (the token's log-probability, its rank and
its top alternatives, `raycluster.request`) and leaves as the JSON shapes of OpenAI's two APIs:
completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat
(`content: [{token, logprob, bytes, top_logprobs}]`), or as vLLM's `prompt_logprobs` list (one
entry per prompt token, the first null, each other `{token id: {logprob, rank, decoded_token}}`
holding the prompt token and the top alternatives). Token strings are each id decoded alone,
so a character split over several byte-level tokens shows as replacement characters there, as in
other servers (and vLLM's `decoded_token`); `text_offset` counts those strings from `offset` on.
"""

from __future__ import annotations

from raycluster.request import TokenLogprob

# vLLM's stand-in for a -inf log-probability: JSON has no infinity.
_MIN_LOGPROB = -9999.0


def completion_logprobs(decode, token_ids: list[int], lps: list[TokenLogprob | None], offset: int = 0,
                        num_top: int | None = None) -> dict:
    """`lps` entries may be None (an echoed prompt's first token): null logprob and top there.
    `num_top`: at most this many alternatives per token (an echoed prompt's entries may hold more,
    computed for `prompt_logprobs` too)."""
    tokens = [decode([t]) for t in token_ids]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in lps],
            "top_logprobs": [None if e is None else {decode([t]): v for t, v in e.top[:num_top]} for e in lps],
            "text_offset": offsets}


def chat_logprobs(decode, token_ids: list[int], lps: list[TokenLogprob]) -> dict:
    def entry(t: int, v: float) -> dict:
        s = decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [{**entry(t, e.logprob), "top_logprobs": [entry(a, v) for a, v in e.top]}
                        for t, e in zip(token_ids, lps)]}


def prompt_logprobs(decode, token_ids: list[int], lps: list[TokenLogprob | None], num_top: int) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None (the first: nothing precedes it) or a dict
    keyed by token id (a string in JSON, as vLLM's int keys serialise) of {logprob, rank,
    decoded_token}: the prompt token first with its rank in the vocabulary, then the `num_top`
    likeliest tokens ranked 1..num_top (the prompt token once, if it is among them)."""
    def entry(v: float, rank: int, t: int) -> dict:
        return {"logprob": max(v, _MIN_LOGPROB), "rank": rank, "decoded_token": decode([t])}

    out: list[dict | None] = []
    for t, e in zip(token_ids, lps):
        if e is None:
            out.append(None)
            continue
        d = {str(t): entry(e.logprob, e.rank, t)}
        for rank, (a, v) in enumerate(e.top[:num_top], 1):
            d.setdefault(str(a), entry(v, rank, a))
        out.append(d)
    return out
