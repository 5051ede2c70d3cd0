"""JSONL traces round-trip exactly; hand-written traces load; re-timing keeps applications together."""

import json

import pytest

from loadgen.trace import load_trace, write_trace
from loadgen.workloads import make_workload


@pytest.mark.parametrize("name", ["chat", "long-mix", "multiturn", "apps", "tenants"])
def test_roundtrip_is_identical(name, tmp_path):
    w = make_workload(name, seed=11, qps=3.0, num_requests=80, long_fraction=0.2)
    path = tmp_path / f"{name}.jsonl"
    write_trace(w, path)
    back = load_trace(path)
    assert back.requests == w.requests
    assert [r.prompt_text() for r in back] == [r.prompt_text() for r in w]
    # And through make_workload (what `--workload FILE.jsonl` does).
    assert make_workload(str(path), arrival="trace").requests == w.requests


def test_hand_written_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0.5, "prompt": "hello there", "output_tokens": 3},
             {"arrival_s": 0.1, "prompt": [1, 2, 3, 4], "output_tokens": 2, "tenant": "B"},
             {"arrival_s": 0.2, "prompt_tokens": 50, "output_tokens": 9, "ttft_slo_ms": 100}]
    path.write_text("# a comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = load_trace(path)
    assert [r.arrival_s for r in w] == [0.1, 0.2, 0.5]
    assert w.requests[0].prompt_tokens == 4 and w.requests[0].prompt_token_ids() == [1, 2, 3, 4]
    assert w.requests[1].prompt_tokens == 50 and len(w.requests[1].prompt_text().split()) == 50
    assert w.requests[2].prompt_text() == "hello there" and w.requests[2].ttft_slo_ms is None
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="output_tokens"):
        load_trace(path)


def test_retime_moves_applications_together(tmp_path):
    w = make_workload("apps", seed=2, qps=1.0, num_requests=60)
    path = tmp_path / "apps.jsonl"
    write_trace(w, path)
    r = load_trace(path, arrival="constant", qps=4.0)
    times = {}
    for q in r:
        times.setdefault(q.app_id, set()).add(q.arrival_s)
    assert all(len(v) == 1 for v in times.values())
    starts = sorted(next(iter(v)) for v in times.values())
    assert starts == pytest.approx([i * 0.25 for i in range(len(starts))])
    assert len(load_trace(path, num_requests=10)) == 10
