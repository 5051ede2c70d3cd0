"""Per-request output text: incremental detokenization plus stop strings.

`TextStream.add(token)` returns (text delta safe to emit, stop string hit). Text that could be
the start of a stop string is held back until it is known not to be one, so a client never sees
any part of the stop string (unless `include_stop`, vLLM's include_stop_str_in_output: then the
output ends with it); `flush()` releases what is held back when the request ends for another
reason.

`min_tokens` follows vLLM v1 (`vllm/v1/engine/detokenizer.py`, PR 22014): stop strings are not
checked while at most `min_tokens` tokens have been generated, and a match must END in text
decoded after those tokens. It may START inside their text: that text is held back like any
other, and a stop string that completes later truncates the output there (so the text can be
shorter than the first `min_tokens` tokens' text, as in vLLM). Text is attributed to the token
whose decoding emitted it.
"""

from __future__ import annotations

from raycluster.model.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop      # vLLM's include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = 0       # tokens added so far
        self._floor = 0        # length of the text decoded within the first min_tokens tokens
        self._text = ""        # everything decoded so far
        self._emitted = 0      # characters of _text already returned
        self.stopped = False

    @classmethod
    def of(cls, tokenizer, prompt_token_ids: list[int], sp) -> "TextStream":
        """The text stream of a request with SamplingParams `sp`."""
        return cls(tokenizer, prompt_token_ids, sp.stop, sp.min_tokens, sp.include_stop_str_in_output,
                   sp.skip_special_tokens)

    def add(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._tokens += 1
        delta = self._detok.add(token_id)
        if not delta:
            return "", False
        search_from = max(0, len(self._text) - self._hold)
        self._text += delta
        if self._tokens <= self._min_tokens:      # too early for a stop string to end here
            self._floor = len(self._text)
            return self._take(len(self._text) - self._hold), False
        for s in self._stop:
            at = self._text.find(s, max(search_from, self._floor - len(s) + 1))
            if at >= 0:
                self._text = self._text[:at + len(s) if self._include_stop else at]
                self.stopped = True
                return self._take(len(self._text)), True
        return self._take(len(self._text) - self._hold), False

    def flush(self) -> str:
        if not self.stopped:
            self._text += self._detok.flush()
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self._text[self._emitted:upto]
        self._emitted = upto
        return out
