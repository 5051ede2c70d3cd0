"""Kairos slack-guided decode selection and its online-updated step-time LUT (hand cases)."""

from __future__ import annotations

import pytest

from raycluster.request import SLO, Request
from raycluster.sched.base import SLOConfig
from raycluster.sched.kairos_decode import KairosDecodeSelector, StepTimeLUT
from raycluster.sched.predictor import LinearBatchPredictor


def lut(two_at_1k: float = 0.006) -> StepTimeLUT:
    return StepTimeLUT([1, 2, 4], [1024, 8192, 131072],
                       [[0.005, 0.010, 0.040],
                        [two_at_1k, 0.012, 0.050],
                        [0.008, 0.015, 0.060]])


def dec(rid: str, seq_len: int, n_out: int, first: float = 0.0, tpot: float | None = None) -> Request:
    r = Request(rid, [1] * (seq_len - n_out), slo=SLO(tpot_s=tpot))
    r.output_token_ids = [5] * n_out
    r.num_computed_tokens = seq_len - 1
    r.first_token_time = first
    return r


SLO50 = SLOConfig(tpot_ms=50.0)


def test_slack_formula():
    sel = KairosDecodeSelector(lut(), SLO50)
    a = dec("A", 100_000, 2)
    # 2 tokens out -> next due at first + 2 * 50 ms; minus its own single-request step (40 ms).
    assert sel.slack(a, 0.01) == pytest.approx(0.1 - 0.01 - 0.04)
    assert sel.slack(dec("x", 500, 1, tpot=0.2), 0.0) == pytest.approx(0.2 - 0.005)   # own SLO wins


def test_shorts_packed_into_slack_long_delayed_order_kept():
    sel = KairosDecodeSelector(lut(), SLO50)
    a, b, c = dec("A", 100_000, 2), dec("B", 500, 1), dec("C", 800, 1)
    # slacks: A 0.06, B 0.045, C 0.045 -> s_min 0.045; B (5 ms), then B+C (6 ms, more tok/s);
    # A would make it LUT[4, 128K] = 60 ms > 45 ms, so A waits this step.
    assert [r.request_id for r in sel.select([a, b, c], 0.0)] == ["B", "C"]
    assert [r.request_id for r in sel.select([c, a, b], 0.0)] == ["C", "B"]


def test_join_rejected_when_it_lowers_throughput():
    sel = KairosDecodeSelector(lut(two_at_1k=0.011), SLO50)
    a, b, c = dec("A", 100_000, 2), dec("B", 500, 1), dec("C", 800, 1)
    assert [r.request_id for r in sel.select([a, b, c], 0.0)] == ["B"]   # 2/11ms < 1/5ms


def test_no_slack_decodes_all():
    sel = KairosDecodeSelector(lut(), SLO50)
    a, b = dec("A", 100_000, 1), dec("B", 500, 1)
    # at t = 20 ms: A's slack = 50 - 20 - 40 = -10 ms: nothing fits, everybody runs.
    assert [r.request_id for r in sel.select([a, b], 0.02)] == ["A", "B"]


def test_single_or_empty():
    sel = KairosDecodeSelector(lut(), SLO50)
    assert sel.select([], 0.0) == []
    b = dec("B", 500, 1)
    assert sel.select([b], 0.0) == [b]


def test_lut_lookup_rounds_up_and_extrapolates():
    t = lut()
    assert t.lookup(3, 2000) == 0.015
    assert t.lookup(1, 10) == 0.005
    assert t.lookup(8, 262144) == pytest.approx(0.06 * 2 * 2)


def test_observe_updates_cell_by_ema():
    sel = KairosDecodeSelector(lut(), SLO50)
    sel.observe(1, 700, 0.015)
    assert sel.lut.lookup(1, 1024) == pytest.approx(0.005 + 0.2 * 0.010)
    assert sel.lut.counts[0][0] == 1
    sel.observe(8, 262144, 0.48)                   # beyond grid: normalized back to the edge cell
    assert sel.lut.table[2][2] == pytest.approx(0.06 + 0.2 * (0.12 - 0.06))


def test_lut_from_predictor():
    p = LinearBatchPredictor(overhead_s=0.002, per_decode_s=1e-4, per_decode_kv_s=1e-8)
    t = StepTimeLUT.from_predictor(p, max_batch=8, max_seq_len=4096)
    assert t.batch_sizes == [1, 2, 4, 8] and t.seq_lens == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert t.lookup(3, 1000) == pytest.approx(0.002 + 4 * 1e-4 + 4 * 1024 * 1e-8)


def test_handoff_anchored_where_first_seen_not_at_local_first_token():
    # A P/D handoff arrives with its prefill token and no first_token_time; the scheduler then
    # stamps first_token_time with its own first decode token (the request's second token).
    sel = KairosDecodeSelector(lut(), SLO50)
    h = dec("H", 500, 1)
    h.first_token_time = None
    assert sel.slack(h, 1.0) == pytest.approx(0.05 - 0.005)        # next token due 1.0 + 50 ms
    h.output_token_ids.append(5)                                    # decoded at 1.004 ...
    h.first_token_time = 1.004                                      # ... and stamped by the scheduler
    # Token 3 is due at 1.0 + 2 * 50 ms. Anchoring at the stamp with n0 = 1 would have said
    # 1.004 + 2 * 50 ms: one extra TPOT of budget (and every delayed token that much later).
    assert sel.slack(h, 1.02) == pytest.approx(1.0 + 0.1 - 1.02 - 0.005)


def test_handoff_with_client_first_token_time_is_paced_from_it():
    # The router tells the decode side when the client got the first token (0.9); the KV
    # landed at 1.0, so 100 ms of the budget are gone: token 2 was due at 0.95, token 3 at 1.0.
    sel = KairosDecodeSelector(lut(), SLO50)
    h = dec("H", 500, 1)
    h.first_token_time = 0.9
    assert sel.slack(h, 1.0) == pytest.approx(0.9 + 0.05 - 1.0 - 0.005)
    h.output_token_ids.append(5)
    assert sel.slack(h, 1.02) == pytest.approx(0.9 + 0.1 - 1.02 - 0.005)


def test_fresh_handoff_does_not_force_decode_all():
    sel = KairosDecodeSelector(lut(), SLO50)
    a, b, c = dec("A", 100_000, 2), dec("B", 500, 1), dec("C", 800, 1)
    c.first_token_time = None                      # just admitted: 50 ms until its next token
    # slacks: A 0.06, B 0.045, C 0.045: the same packing as with C's clock known.
    assert [r.request_id for r in sel.select([a, b, c], 0.0)] == ["B", "C"]
