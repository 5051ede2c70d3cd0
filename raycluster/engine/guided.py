"""Structured outputs: constraining sampled tokens to a regular expression (outlines-core) or a
context-free grammar (llguidance).

A request's whole output must match its `SamplingParams.guided_regex` (the gateway builds it
from a JSON schema, a choice list, `json_object` or a user regex: raycluster.server.structured)
or its `guided_grammar` (a Lark or GBNF grammar, vLLM's `grammar`); `constraint_of` reads
which, as a `Regex` or a `Grammar`. `GuidedDecoding` owns the tokenizer's vocabulary (as bytes
for outlines, as the tokenizer itself for llguidance), compiled indexes (one per constraint,
least recently used first out: an automaton over token ids for a regex, a parser ready to copy
for a grammar) and one guide (the automaton's or parser's state) per request. Each step the
engine hands it the logits rows of its guided requests (`mask`): both kinds write a bitmask of
allowed tokens, and every token not allowed goes to -inf; once the pattern is complete only EOS
is left, so the request stops there. Sampled tokens advance the guides (`advance`).

A guide is built when its request is first sampled here and walked through the tokens the
request already has, so a request that resumes on another instance (a P/D handoff, a router
restart) continues in the same state; nothing of a guide travels between instances.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import torch

from raycluster.request import SamplingParams

MAX_REGEX_CHARS = 32768     # a pattern this long compiles for seconds: refuse longer ones
MAX_GRAMMAR_CHARS = 65536
# Row v: which of byte value v's 8 bits are clear (token not allowed).
_BLOCKED = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


class _RegexGuide:
    def __init__(self, index) -> None:
        from outlines_core import Guide

        self._guide = Guide(index)

    def write_mask(self, words: torch.Tensor) -> None:
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)

    def advance(self, token: int) -> None:
        self._guide.advance(token, return_tokens=False)

    def rollback(self, n: int) -> None:
        self._guide.rollback_state(n)


class _GrammarGuide:
    def __init__(self, matcher) -> None:
        self._matcher = matcher.deep_copy()     # the compiled parser, at its start

    def write_mask(self, words: torch.Tensor) -> None:
        # A matcher in its error state (a token it did not allow) allows EOS only.
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)

    def rollback(self, n: int) -> None:
        self._matcher.rollback(n)


class GuidedVocab:
    """The tokenizer as each library wants it, built at first use: outlines-core's byte
    vocabulary, llguidance's tokenizer (from the tokenizer.json text)."""

    def __init__(self, token_bytes: dict[bytes, list[int]], eos_token_ids: tuple[int, ...],
                 tokenizer_json: str | None, vocab_size: int | None) -> None:
        self._token_bytes, self._eos = token_bytes, eos_token_ids
        self._json, self._size = tokenizer_json, vocab_size
        self._outlines = self._llg = None

    def outlines(self):
        if self._outlines is None:
            from outlines_core import Vocabulary

            self._outlines = Vocabulary(self._eos[0], self._token_bytes)
        return self._outlines

    def llguidance(self):
        if self._llg is None:
            if self._json is None:
                raise ValueError("grammars need the model's tokenizer.json")
            from llguidance import LLTokenizer

            self._llg = LLTokenizer(self._json, n_vocab=self._size, eos_token=list(self._eos))
        return self._llg


@dataclass(frozen=True)
class Regex:
    """The whole output matches this regular expression (Rust regex syntax, outlines-core)."""
    text: str
    field: ClassVar[str] = "guided_regex"

    def compile(self, vocab: GuidedVocab):
        from outlines_core import Index

        if len(self.text) > MAX_REGEX_CHARS:
            raise ValueError(f"the pattern has {len(self.text)} characters; at most {MAX_REGEX_CHARS}")
        try:
            return Index(self.text, vocab.outlines())
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"cannot be compiled: {e}") from e

    @staticmethod
    def guide(index) -> _RegexGuide:
        return _RegexGuide(index)

    def into(self, sp: SamplingParams) -> None:
        sp.guided_regex = self.text


@dataclass(frozen=True)
class Grammar:
    """The whole output is a sentence of this context-free grammar (Lark, or llama.cpp's GBNF,
    as vLLM's `grammar` takes; llguidance, whose parser bounds its own work per token)."""
    text: str
    field: ClassVar[str] = "guided_grammar"

    def compile(self, vocab: GuidedVocab):
        from llguidance import LLMatcher, grammar_from

        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar has {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")
        try:
            definition = grammar_from("grammar", self.text)     # Lark as is, GBNF converted
        except ValueError as e:
            raise ValueError(f"is not a Lark or GBNF grammar: {e}") from None
        matcher = LLMatcher(vocab.llguidance(), definition, log_level=0)
        if matcher.is_error():
            raise ValueError(f"cannot be compiled: {matcher.get_error().strip()}")
        return matcher

    @staticmethod
    def guide(matcher) -> _GrammarGuide:
        return _GrammarGuide(matcher)

    def into(self, sp: SamplingParams) -> None:
        sp.guided_grammar = self.text


def constraint_of(sp: SamplingParams) -> Regex | Grammar | None:
    """What `sp` asks its output to match, if anything (at most one is set: the gateway and
    `SamplingParams.validate` see to it)."""
    if sp.guided_regex is not None:
        return Regex(sp.guided_regex)
    if sp.guided_grammar is not None:
        return Grammar(sp.guided_grammar)
    return None


class GuidedDecoding:
    def __init__(self, token_bytes: dict[bytes, list[int]], eos_token_ids: tuple[int, ...],
                 max_indexes: int = 32, tokenizer_json: str | None = None, vocab_size: int | None = None) -> None:
        """`tokenizer_json` (the tokenizer.json text) and `vocab_size` (the model's logits width)
        are what grammars need; regexes need the token bytes only."""
        self.eos_token_ids = tuple(eos_token_ids)
        self._vocab = GuidedVocab(token_bytes, self.eos_token_ids, tokenizer_json, vocab_size)
        self._indexes: OrderedDict[Regex | Grammar, object] = OrderedDict()
        self._lock = threading.Lock()         # the gateway compiles in worker threads
        self._max_indexes = max_indexes
        self._guides: dict[str, object] = {}

    def index(self, constraint: Regex | Grammar):
        """The compiled form of `constraint` (cached). ValueError if it cannot be compiled."""
        with self._lock:
            idx = self._indexes.get(constraint)
            if idx is not None:
                self._indexes.move_to_end(constraint)
                return idx
        idx = constraint.compile(self._vocab)
        with self._lock:
            self._indexes[constraint] = idx
            if len(self._indexes) > self._max_indexes:
                self._indexes.popitem(last=False)
        return idx

    def compiled(self, constraint: Regex | Grammar) -> bool:
        with self._lock:
            return constraint in self._indexes

    def _guide(self, request_id: str, constraint: Regex | Grammar, output_token_ids: list[int]):
        guide = self._guides.get(request_id)
        if guide is None:
            guide = constraint.guide(self.index(constraint))
            for tok in output_token_ids:        # a resumed request: replay what it has
                if tok not in self.eos_token_ids:
                    guide.advance(tok)
            self._guides[request_id] = guide
        return guide

    def mask(self, logits: torch.Tensor, rows: list[int], request_ids: list[str], constraints: list[Regex | Grammar],
             outputs: list[list[int]], raw: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` with each listed row limited to its guide's allowed tokens (a copy). Give
        `raw` (the logits before penalties) when penalties ran: a row they left with no allowed
        finite logit (min_tokens banned the EOS a complete pattern needs) takes its allowed
        tokens from `raw` instead."""
        vocab = logits.shape[-1]
        # One bitmask row per guided request (its guide writes it; bit i of byte k is token
        # 8k + i), unpacked through a byte -> 8 bits table: a gather, not 32 shifts per word.
        words = torch.zeros((len(rows), (vocab + 31) // 32), dtype=torch.int32)
        for k, (rid, constraint, out) in enumerate(zip(request_ids, constraints, outputs)):
            self._guide(rid, constraint, out).write_mask(words[k])
        return self._apply(logits, words, rows, raw)

    def _apply(self, logits: torch.Tensor, words: torch.Tensor, rows: list[int],
               raw: torch.Tensor | None) -> torch.Tensor:
        """`logits` (cloned here) with row rows[k] limited to the tokens bitmask `words[k]` allows."""
        logits = logits.clone()
        vocab = logits.shape[-1]
        blocked = _BLOCKED[words.view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
        eos = list(self.eos_token_ids)
        blocked[:, eos] &= blocked[:, eos[:1]]          # every EOS id where the pattern allows the first
        for k, row in enumerate(rows):
            masked = logits[row].masked_fill_(blocked[k], float("-inf"))
            if raw is not None and not torch.isfinite(masked).any():
                masked.copy_(raw[row].masked_fill(blocked[k], float("-inf")))
        return logits

    def mask_drafts(self, logits: torch.Tensor, request_id: str, constraint: Regex | Grammar, output: list[int],
                    drafts: list[int], raw: torch.Tensor | None = None) -> torch.Tensor:
        """The rows [1 + k, vocab] of a request that ran k drafts (speculative decoding), row j
        limited to what its pattern allows after the drafts before it (a copy). The guide steps
        through the drafts the pattern allows and is rolled back after: it advances later by
        the tokens kept (an EOS, which guides never consume, leaves the state as it was: with
        ignore_eos the output goes on after it). Rows after a draft the pattern refuses are left
        unmasked: verification stops at that draft, whose row cannot give it."""
        guide = self._guide(request_id, constraint, output)
        words = torch.zeros((len(drafts) + 1, (logits.shape[-1] + 31) // 32), dtype=torch.int32)
        guide.write_mask(words[0])
        eos, stepped, rows = self.eos_token_ids, 0, 1
        for j, d in enumerate(drafts):
            bit = eos[0] if d in eos else d
            if not (int(words[j, bit >> 5]) >> (bit & 31)) & 1:
                break
            if d in eos:
                words[j + 1] = words[j]
            else:
                guide.advance(d)
                stepped += 1
                guide.write_mask(words[j + 1])
            rows += 1
        if stepped:
            guide.rollback(stepped)
        return self._apply(logits, words[:rows], list(range(rows)), raw)

    def advance(self, request_id: str, token: int) -> None:
        guide = self._guides.get(request_id)
        if guide is not None and token not in self.eos_token_ids:
            guide.advance(token)

    def forget(self, request_id: str) -> None:
        self._guides.pop(request_id, None)
