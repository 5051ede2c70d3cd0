"""Resolves a `--model` value to a checkpoint directory.

"tiny" is the embedded default: written once by `write_tiny_model` into a cache directory
(`$RAYCLUSTER_CACHE` or ~/.cache/raycluster) and reused; anything else must be a directory
holding config.json. Writing goes to a temporary sibling first and is renamed into place, so
several processes (Ray actors) asking at once never see a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

TINY = "tiny"


def cache_dir() -> Path:
    return Path(os.environ.get("RAYCLUSTER_CACHE", Path.home() / ".cache" / "raycluster"))


def resolve_model_path(model: str, hf_overrides: dict | None = None) -> str:
    """The checkpoint directory `model` names; with `hf_overrides` (vLLM's --hf-overrides), the
    directory that reads as it with those config changes (raycluster.model.overrides)."""
    if model == TINY:
        path = ensure_tiny_model()
    else:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {model!r} is neither 'tiny' nor a checkpoint directory with config.json")
    if hf_overrides:
        from raycluster.model.overrides import overridden_checkpoint
        return str(overridden_checkpoint(path, hf_overrides, cache_dir()))
    return str(path)


def default_model_name(model: str) -> str:
    """The name the API serves a `--model` under when none is given: "tiny", or the checkpoint
    directory's name (vLLM uses the path as given; a directory's name is what clients can type)."""
    return TINY if model == TINY else Path(model).expanduser().resolve().name


def _tiny_fingerprint() -> str:
    """Changes whenever the generator or its corpus does, so a stale cached checkpoint is never used."""
    from raycluster.model import tiny

    h = hashlib.sha256(Path(tiny.__file__).read_bytes())
    h.update(tiny.corpus_text().encode())
    return h.hexdigest()[:12]


def ensure_tiny_model() -> Path:
    from raycluster.model.tiny import write_tiny_model

    target = cache_dir() / f"tiny-{_tiny_fingerprint()}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():   # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
