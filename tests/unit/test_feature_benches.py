"""Smoke tests of `raycluster bench spec-decode` (the JSON's shape, n-gram, draft-model and EAGLE runs
that give the plain run's tokens, the CLI's exit status) and `raycluster bench lora` (its four
mixes); no timing assertions."""

from __future__ import annotations

import json

import pytest

from raycluster.cli import main


def test_spec_decode_bench_runs_side_by_side(tmp_path):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec-decode", "--batch-sizes", "1,2", "--max-tokens", "24", "--k", "2",
                 "--repeats", "1", "--kv-tokens", "4096", "--draft-layers", "2", "--eagle-steps", "3",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["batch_size"], r["setting"]): r for r in result["rows"]}
    assert set(rows) == {(bs, s) for bs in (1, 2) for s in ("plain", "ngram-k2", "draft-k2", "eagle-k2")}
    assert result["draft"] == "first 2 layers" and result["eagle"] == "trained 3 steps"
    assert all(rows[(bs, "draft-k2")]["accepted"] > 0 for bs in (1, 2))
    for (bs, setting), r in rows.items():
        assert r["same_tokens"] and r["wall_s"] > 0 and r["steps"] >= 24 // 3
        if setting == "plain":
            assert r["drafts"] == 0 and r["acceptance"] is None and r["speedup"] == 1.0 and r["steps"] == 24
        else:
            assert 0 <= r["accepted"] <= r["drafts"]
            assert r["steps"] <= 24


@pytest.mark.parametrize("group, layout", [((), "single"), (("--tp", "2"), "tp2")])
def test_lora_bench_runs_the_four_mixes(tmp_path, group, layout):
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--num-requests", "3", "--max-tokens", "4", "--rank", "4", "--repeats", "1",
                 "--kv-tokens", "4096", *group, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["layout"] == layout
    assert [r["mix"] for r in rows] == ["base", "one adapter", "two adapters + base", "four adapters"]
    assert rows[0]["vs_base"] == 1.0 and all(r["median_s"] > 0 and len(r["runs_s"]) == 1 for r in rows)
