"""Structured outputs: constraining sampled tokens to a regular expression (outlines-core).

A request's `SamplingParams.guided_regex` (the gateway builds it from a JSON schema, a choice
list, `json_object` or a user regex: raycluster.server.structured) must match its whole output.
`GuidedDecoding` owns the tokenizer's vocabulary as bytes, compiled indexes (an automaton over
token ids, one per regex, least recently used first out) and one `Guide` (the automaton's state)
per request. Each step the engine hands it the logits rows of its guided requests (`mask`): every
token the guide does not allow goes to -inf; once the regex is complete only EOS is left, so
the request stops there. Sampled tokens advance the guides (`advance`).

A guide is built when its request is first sampled here and walked through the tokens the
request already has, so a request that resumes on another instance (a P/D handoff, a router
restart) continues in the same state; nothing of a guide travels between instances.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

MAX_REGEX_CHARS = 32768     # a pattern this long compiles for seconds: refuse longer ones
# Row v: which of byte value v's 8 bits are clear (token not allowed).
_BLOCKED = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


class GuidedDecoding:
    def __init__(self, token_bytes: dict[bytes, list[int]], eos_token_ids: tuple[int, ...],
                 max_indexes: int = 32) -> None:
        from outlines_core import Vocabulary

        self.eos_token_ids = tuple(eos_token_ids)
        self._vocab = Vocabulary(self.eos_token_ids[0], token_bytes)
        self._indexes: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()         # the gateway compiles in worker threads
        self._max_indexes = max_indexes
        self._guides: dict[str, object] = {}

    def index(self, regex: str):
        """The compiled automaton of `regex` (cached). ValueError if it cannot be compiled."""
        from outlines_core import Index

        with self._lock:
            idx = self._indexes.get(regex)
            if idx is not None:
                self._indexes.move_to_end(regex)
                return idx
        if len(regex) > MAX_REGEX_CHARS:
            raise ValueError(f"the pattern has {len(regex)} characters; at most {MAX_REGEX_CHARS}")
        try:
            idx = Index(regex, self._vocab)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"cannot be compiled: {e}") from e
        with self._lock:
            self._indexes[regex] = idx
            if len(self._indexes) > self._max_indexes:
                self._indexes.popitem(last=False)
        return idx

    def compiled(self, regex: str) -> bool:
        with self._lock:
            return regex in self._indexes

    def _guide(self, request_id: str, regex: str, output_token_ids: list[int]):
        guide = self._guides.get(request_id)
        if guide is None:
            from outlines_core import Guide

            guide = Guide(self.index(regex))
            for tok in output_token_ids:        # a resumed request: replay what it has
                if tok not in self.eos_token_ids:
                    guide.advance(tok, return_tokens=False)
            self._guides[request_id] = guide
        return guide

    def mask(self, logits: torch.Tensor, rows: list[int], request_ids: list[str], regexes: list[str],
             outputs: list[list[int]], raw: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` with each listed row limited to its guide's allowed tokens (a copy). Give
        `raw` (the logits before penalties) when penalties ran: a row they left with no allowed
        finite logit (min_tokens banned the EOS a complete pattern needs) takes its allowed
        tokens from `raw` instead."""
        logits = logits.clone()
        vocab = logits.shape[-1]
        # One bitmask row per guided request (outlines writes them; bit i of byte k is token
        # 8k + i), unpacked through a byte -> 8 bits table: a gather, not 32 shifts per word.
        words = torch.zeros((len(rows), (vocab + 31) // 32), dtype=torch.int32)
        for k, (rid, regex, out) in enumerate(zip(request_ids, regexes, outputs)):
            self._guide(rid, regex, out).write_mask_into(words[k].data_ptr(), words.shape[1], 4)
        blocked = _BLOCKED[words.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
        eos = list(self.eos_token_ids)
        blocked[:, eos] &= blocked[:, eos[:1]]          # every EOS id where the pattern allows the first
        for k, row in enumerate(rows):
            masked = logits[row].masked_fill_(blocked[k], float("-inf"))
            if raw is not None and not torch.isfinite(masked).any():
                masked.copy_(raw[row].masked_fill(blocked[k], float("-inf")))
        return logits

    def advance(self, request_id: str, token: int) -> None:
        guide = self._guides.get(request_id)
        if guide is not None and token not in self.eos_token_ids:
            guide.advance(token, return_tokens=False)

    def forget(self, request_id: str) -> None:
        self._guides.pop(request_id, None)
