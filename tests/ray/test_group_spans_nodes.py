"""Groups whose placement spans nodes: on a Ray cluster of two nodes (two raylets on this host),
pools placed STRICT_SPREAD put each replica (rank 0) and its rank 1 on different nodes, and a
P/D app prefilling on an spp2 group and decoding on a tp2 group (KV over torch_dist) answers over
HTTP with the single engine's greedy text. Runs `two_node_groups.py` in a process of its own:
this one already holds the session's Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]     # ~60-80 s: CI runs it (RUN_SLOW=1)

SCRIPT = Path(__file__).with_name("two_node_groups.py")


def test_spp_and_tp_groups_span_two_nodes(tiny_model_dir):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == 1, proc.stderr[-3000:]
    row = rows[0]
    assert row["texts"] == row["want"]
    assert {r: i["layout"] for r, i in row["instances"].items()} == {"prefill-short": "spp2", "decode": "tp2"}
    for inst in row["instances"].values():
        # rank 0 (the replica) and rank 1 on the cluster's two nodes, one each
        assert sorted(inst["nodes"]) == row["cluster_nodes"], row
