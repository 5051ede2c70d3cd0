"""Token sampling from the logits rows of one step.

Greedy rows are one batched argmax. Random rows apply temperature, min-p, top-k and top-p (vLLM
v1's order), then draw. A seeded request's k-th output token is drawn from a generator seeded by
(seed, k) alone (`token_seed`), so it is the same whatever the request is batched with and
wherever it runs: a P/D handoff or a resume on another instance continues the stream the first
instance started, where a generator carried by one process would restart it. Unseeded rows share
the sampler's own generator. Logits enter as [n, vocab] float tensors, with each row's count of
output tokens so far; token ids leave as a Python list. `logprobs` reads the same rows for the requests that ask for log-probabilities
(raw logits: before penalties, temperature, top-k and top-p), with each token's rank in the
vocabulary. `penalize` returns the logits with each penalized row adjusted by its request's
history and `logit_bias`, the last token of each bad word the output would complete, every id
outside `allowed_token_ids` (when given) and `banned` ids (EOS and stop ids before `min_tokens`)
at -inf (a copy; other rows untouched).
"""

from __future__ import annotations

import math

import torch

from raycluster.request import SamplingParams, TokenLogprob


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, k: int) -> int:
    """The generator seed for output token k of a request seeded `seed`: splitmix64 of the pair,
    so neighbouring seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()        # reseeded per seeded row

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
        """One token per row; `num_generated[i]`: output tokens row i's request has so far."""
        out = logits.argmax(dim=-1).tolist()
        for i, sp in enumerate(params):
            if sp.temperature > 0:
                out[i] = self._sample_row(logits[i], sp, self._generator(sp, num_generated[i]))
        return out

    @staticmethod
    def penalize(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                 outputs: list[list[int]], banned: list[list[int]] | None = None) -> torch.Tensor:
        rows = [i for i, sp in enumerate(params) if sp.penalized]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            sp, row = params[i], logits[i]
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(prompts[i]) | set(outputs[i])), dtype=torch.long)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals < 0, vals * sp.repetition_penalty, vals / sp.repetition_penalty)
            if outputs[i] and (sp.presence_penalty or sp.frequency_penalty):
                counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=vocab)[:vocab]
                row -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty * (counts > 0).to(row.dtype)
            if sp.logit_bias:
                ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
                row[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype)
            for seq in sp.bad_words_token_ids:
                # vLLM's rule: ban the word's last token where the output ends with the rest.
                if len(seq) == 1 or outputs[i][len(outputs[i]) - len(seq) + 1:] == seq[:-1]:
                    row[seq[-1]] = float("-inf")
            if sp.allowed_token_ids is not None:
                keep = torch.zeros(vocab, dtype=torch.bool)
                keep[torch.tensor(sp.allowed_token_ids, dtype=torch.long)] = True
                row.masked_fill_(~keep, float("-inf"))
            if banned and banned[i] and len(outputs[i]) < sp.min_tokens:
                row[torch.tensor(banned[i], dtype=torch.long)] = float("-inf")
        return logits

    @staticmethod
    def logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
        """Per listed row: log_softmax of the raw logits at `tokens[i]` (the sampled token, or the
        prompt token the row predicts), its rank in the vocabulary, and the `tops[i]` most likely
        tokens."""
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1))
        # One comparison pass over rows already in hand (no sort): ties share the better rank.
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        chosen = chosen.view(-1).tolist()
        k = max(tops)
        if k == 0:
            return [TokenLogprob(c, [], r) for c, r in zip(chosen, ranks)]
        vals, ids = lp.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        return [TokenLogprob(c, list(zip(ids[i][:n], vals[i][:n])), r)
                for i, (c, n, r) in enumerate(zip(chosen, tops, ranks))]

    def verify(self, logits: torch.Tensor, drafts: list[int], sp: SamplingParams, num_generated: int) -> list[int]:
        """Speculative decoding's check of `drafts` against `logits` [k + 1, vocab] (row j
        follows the context and drafts[:j]). Returns the accepted drafts and one more token:
        the model's own at the first draft it disagrees with, or the bonus after the last.
        Row j's token is drawn exactly as plain decoding draws output token num_generated + j
        (greedy: the argmax; sampled: from the same distribution and, for a seeded request, the
        same generator stream), and a draft is kept while it equals that token. For drafts that
        are single tokens, not distributions, this is the rejection rule of speculative sampling
        (a draft d is kept with probability p(d); otherwise the token is drawn from p without d),
        and it gives a seeded request the very tokens it gets without drafts."""
        if sp.temperature == 0:
            target = logits.argmax(dim=-1).tolist()
            for j, d in enumerate(drafts):
                if target[j] != d:
                    return target[:j + 1]
            return target
        out = []
        for j in range(len(drafts) + 1):
            out.append(self._sample_row(logits[j], sp, self._generator(sp, num_generated + j)))
            if j == len(drafts) or out[j] != drafts[j]:
                return out
        return out

    def _generator(self, sp: SamplingParams, k: int) -> torch.Generator:
        return self._default if sp.seed is None else self._seeded.manual_seed(token_seed(sp.seed, k))

    @classmethod
    def _sample_row(cls, row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        return int(torch.multinomial(cls._probs(row, sp), 1, generator=gen).item())

    @staticmethod
    def _probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """The distribution a random row draws from: temperature, min-p, top-k, top-p."""
        row = row.float() / sp.temperature
        if sp.min_p > 0.0:
            # p_i < min_p * p_max  <=>  logit_i < max logit + log(min_p): no softmax needed.
            row = row.masked_fill(row < row.max() + math.log(sp.min_p), float("-inf"))
        if 0 < sp.top_k < row.numel():
            kth = torch.topk(row, sp.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= sp.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return probs
