"""Token sampling from the logits rows of one step.

Greedy rows are one batched argmax. Random rows apply temperature, min-p, top-k and top-p (vLLM
v1's order), then draw
with the request's own `torch.Generator` when it has a seed, so a seeded request yields the same
tokens whatever it is batched with. Logits enter as [n, vocab] float tensors; token ids leave as
a Python list. `logprobs` reads the same rows for the requests that ask for log-probabilities
(raw logits: before penalties, temperature, top-k and top-p), with each token's rank in the
vocabulary. `penalize` returns the logits with each penalized row adjusted by its request's
history and `logit_bias`, and `banned` ids (EOS and stop ids before `min_tokens`) at -inf (a
copy; other rows untouched).
"""

from __future__ import annotations

import math

import torch

from raycluster.request import SamplingParams, TokenLogprob


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = self._per_request[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        out = logits.argmax(dim=-1).tolist()
        for i, (rid, sp) in enumerate(zip(request_ids, params)):
            if sp.temperature > 0:
                out[i] = self._sample_row(logits[i], sp, self._generator(rid, sp))
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

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
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
        return int(torch.multinomial(probs, 1, generator=gen).item())
