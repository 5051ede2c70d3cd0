"""Smoke tests of `raycluster bench spec-decode` (the JSON's shape, n-gram, draft-model and EAGLE runs
that give the plain run's tokens, on TP groups too, the CLI's exit status), `raycluster bench lora` (its four
mixes), `bench window`, `bench hybrid-kv` and `bench images`; no timing assertions."""

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


def test_spec_decode_bench_on_tp_groups(tmp_path):
    """`--tp 2`: every engine a TP group; the EAGLE head drafts on the leader, same tokens."""
    out = tmp_path / "spec-tp.json"
    assert main(["bench", "spec-decode", "--batch-sizes", "2", "--max-tokens", "16", "--k", "2", "--repeats", "1",
                 "--kv-tokens", "4096", "--eagle-steps", "3", "--tp", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tp"] == 2
    assert {r["setting"] for r in result["rows"]} == {"plain", "ngram-k2", "eagle-k2"}
    assert all(r["same_tokens"] for r in result["rows"])
    assert next(r for r in result["rows"] if r["setting"] == "eagle-k2")["drafts"] > 0


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


def test_window_bench_times_full_and_windowed_attention(tmp_path):
    """`raycluster bench window`: each call timed both ways, every windowed output checked
    against the reference; bad sizes are refused."""
    out = tmp_path / "window.json"
    assert main(["bench", "window", "--context", "300", "--window", "64", "--decodes", "3", "--chunk", "40",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "8", "--repeats", "2",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["call"] for r in res["rows"]] == ["decode", "prefill_chunk", "prefill_whole"]
    assert all(r["full_ms"] > 0 and r["window_ms"] > 0 and r["max_abs_err_vs_reference"] < 1e-4 for r in res["rows"])
    with pytest.raises(SystemExit, match="--window < --context"):
        main(["bench", "window", "--context", "64", "--window", "64", "--out", str(out)])
    # With Gemma 2's cap: the windowed calls cap too (checked against the capped formula), and
    # full attention is timed capped as well.
    assert main(["bench", "window", "--context", "200", "--window", "64", "--decodes", "2", "--chunk", "40",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "8", "--repeats", "2",
                 "--softcap", "1.5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["softcap"] == 1.5
    assert all(r["capped_full_ms"] > 0 and r["cap_cost"] > 0 and r["max_abs_err_vs_reference"] < 1e-4
               for r in res["rows"])
    with pytest.raises(SystemExit, match="--softcap"):
        main(["bench", "window", "--context", "200", "--window", "64", "--chunk", "40", "--softcap", "0",
              "--out", str(out)])
    # Llama 4's chunked attention in place of the window, checked against the chunks' mask.
    assert main(["bench", "window", "--context", "200", "--attention-chunk", "48", "--decodes", "2", "--chunk", "40",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--block-size", "8", "--repeats", "2",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["attention_chunk"] == 48 and res["window"] is None
    assert all(r["window_ms"] > 0 and r["max_abs_err_vs_reference"] < 1e-4 for r in res["rows"])


def test_quant_bench_compares_each_scheme_with_the_dense_model(tmp_path):
    """`raycluster bench quant`: the dense model and each scheme (int ones both ways, FP8 dequantized)
    timed in turn; packed int4 weights take well under half the bytes; the quantized logits stay
    near the dense ones."""
    out = tmp_path / "quant.json"
    assert main(["bench", "quant", "--schemes", "w4a16,fp8", "--group-size", "64", "--decode-batches", "1,2",
                 "--kv-len", "32", "--prefill-tokens", "48", "--steps", "2", "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["dense", "w4a16 quantized kernels", "w4a16 dequantized at load", "fp8 dequantized at load"]
    assert rows["dense"]["weight_bytes_vs_dense"] == 1.0 and rows["dense"]["decode_ms"]["1"]["vs_dense"] == 1.0
    assert rows["w4a16 quantized kernels"]["matmuls"] == ["Int4Matmul"]
    assert rows["w4a16 quantized kernels"]["weight_bytes_vs_dense"] < 0.5
    assert rows["fp8 dequantized at load"]["matmuls"] == ["DenseMatmul"]
    for r in rows.values():
        assert r["top1_agreement"] > 0.8 and r["logit_max_rel_diff"] < 0.1
        assert all(v["median"] > 0 for v in (*r["decode_ms"].values(), *r["prefill_ms"].values()))
    with pytest.raises(SystemExit):
        main(["bench", "quant", "--schemes", "int3", "--out", str(out)])


def test_encoder_bench_times_the_engine_against_transformers(tmp_path, encoders):
    """`raycluster bench encoder`: each mix's batch through the engine, transformers padded and one
    by one, in turn; ratios to the engine's median."""
    out = tmp_path / "encoder.json"
    assert main(["bench", "encoder", "--model", str(encoders["bert"]), "--requests", "5", "--rounds", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["mixes"]) == {"uniform", "skewed"}
    for mix in res["mixes"].values():
        assert mix["requests"] == 5 and mix["ways"]["engine (one step)"]["vs_engine"] == 1.0
        assert all(w["median_s"] > 0 for w in mix["ways"].values())


def test_hybrid_kv_bench_runs_both_caches_to_the_same_tokens(tmp_path):
    """`raycluster bench hybrid-kv`: both engines each round (the tokens compared inside), the
    hybrid one on a pool of blocks of fewer layers."""
    out = tmp_path / "hkv.json"
    assert main(["bench", "hybrid-kv", "--arch", "Gemma3ForCausalLM", "--layers", "3", "--full-every", "3",
                 "--window", "16", "--requests", "3", "--prompt", "60", "--output", "12", "--kv-tokens", "256",
                 "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    hybrid, one = res["rounds"][0]["hybrid"], res["rounds"][0]["one_table"]
    assert hybrid["kv_groups"] == 3 and one["kv_groups"] == 1
    assert hybrid["pool_blocks"] == 3 * one["pool_blocks"] and res["wall_ratio_one_table_over_hybrid"] > 0


def test_image_bench_finds_the_same_image_in_the_prefix_cache(tmp_path):
    """`raycluster bench images`: the same image prompt again finds every full block before its
    last token cached, the same text with another image only the blocks before the image."""
    out = tmp_path / "img.json"
    assert main(["bench", "images", "--image-size", "56", "--tower-layers", "1", "--text-tokens", "20",
                 "--photo", "64x48", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["tokens_per_image"] == 16 and res["prompt_tokens"] == 56
    assert res["cached_tokens"] == {"same_image_again": [48], "other_image_same_text": [16]}
    assert res["ratio_image_over_text"] > 0 and set(res["median_s"]) == set(res["seconds"])
    assert len(res["seconds"]["given_embeddings"]) == 1 and res["ratio_given_embeddings_over_image"] > 0
