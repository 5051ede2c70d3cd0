"""Where a running `raycluster up` records itself: `up.json` (the PID and URL of what `--detach`
started) and `cluster.json` (how to reach its Ray cluster), under $RAYCLUSTER_STATE_DIR, else the
cache directory. `status`, `scale`, `apply` and `down` read them."""

from __future__ import annotations

import os
from pathlib import Path

from raycluster.model.registry import cache_dir


def pid_file() -> Path:
    """Where `up --detach` records what it started ($RAYCLUSTER_STATE_DIR, else the cache dir)."""
    return Path(os.environ.get("RAYCLUSTER_STATE_DIR", cache_dir())) / "up.json"


def cluster_file() -> Path:
    """Where a running `up` (foreground or detached) says how to reach its Ray cluster."""
    return pid_file().with_name("cluster.json")
