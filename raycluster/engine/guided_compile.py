"""A child process that compiles structured-output patterns, so a caller can bound the time.

A regex's automaton over a vocabulary can be huge: nested counted repetitions such as
`(.{0,100}x){0,10}` take a minute to compile over a 4K-token vocabulary, and `a{100000}` three.
The gateway compiles each new pattern here first (`PatternCompiler.check`) and refuses one that
has not compiled within its time limit; the child is then killed and the next check starts a
fresh one. This module imports outlines-core only (no torch), so the child starts in well under
a second; the vocabulary (token bytes -> ids) reaches it once, when it starts.
"""

from __future__ import annotations

import multiprocessing
import threading

_vocab = None       # the child's vocabulary, set by its initializer (one per child process)


def _init(eos_token_id: int, token_bytes: dict[bytes, list[int]]) -> None:
    global _vocab
    from outlines_core import Vocabulary

    _vocab = Vocabulary(eos_token_id, token_bytes)


def _compile(regex: str) -> str | None:
    from outlines_core import Index

    try:
        Index(regex, _vocab)
    except Exception as e:      # outlines-core's errors are ValueError / RuntimeError
        return f"cannot be compiled: {e}"
    return None


class PatternCompiler:
    """Compiles one pattern at a time in a child process; `check` returns None when the pattern
    compiles within `timeout_s`, else the reason it is refused."""

    def __init__(self, token_bytes: dict[bytes, list[int]], eos_token_id: int, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._args = (eos_token_id, token_bytes)
        self._pool = None
        self._lock = threading.Lock()

    def check(self, regex: str) -> str | None:
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(1, initializer=_init, initargs=self._args)
            job = self._pool.apply_async(_compile, (regex,))
            try:
                return job.get(self.timeout_s)
            except multiprocessing.TimeoutError:
                self._pool.terminate()
                self._pool = None
                return f"too complex: it did not compile within {self.timeout_s:g} s"

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool = None
