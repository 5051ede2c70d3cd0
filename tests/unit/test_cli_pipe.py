"""The console script stays quiet when the reader of its output stops early (`raycluster ... | head -1`)."""

from __future__ import annotations

import subprocess
import sys


def _run(entry_point: str) -> bytes:
    """stderr of a process whose command prints 10 MB through `entry_point` into a pipe closed
    after one line (far more than the pipe holds: the writer hits the closed pipe)."""
    code = ("import sys; import raycluster.cli as cli; "
            "cli.main = lambda: [print('x' * 99) for _ in range(100_000)] and 0; "
            f"sys.exit(cli.{entry_point}())")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"x" * 99 + b"\n"
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    return err


def test_a_closed_pipe_is_not_a_traceback():
    assert b"BrokenPipeError" in _run("main")        # what a plain main does
    assert _run("entry") == b""
