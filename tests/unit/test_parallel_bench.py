"""`raycluster bench parallel` end to end on tiny sizes: every configuration runs and reports."""

from __future__ import annotations

import json

import pytest

from raycluster.bench.parallel_bench import main


def test_parallel_bench_writes_every_configuration(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "par.json"
    assert main(["--model", str(tiny_model_dir), "--contexts", "300", "--prompt", "400", "--chunk", "128",
                 "--decode-steps", "3", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    names = {"1 process, 1 thread", "1 process, 2 threads"}
    assert set(res["kvp"][0]["tpot_ms"]) == names | {"kvp2, 1 thread per rank"}
    assert set(res["spp"]["ttft_s"]) == names | {"spp2, 1 thread per rank"}
    assert res["kvp"][0]["speedup_vs_1_thread"]["1 process, 1 thread"] == 1.0
    assert all(t > 0 for t in res["spp"]["ttft_s"].values())
    assert set(res["tp"]["ttft_s"]) == set(res["tp"]["tpot_ms"]) == names | {"tp2, 1 thread per rank"}
    assert all(t > 0 for t in res["tp"]["tpot_ms"].values())
    assert "spp-tp" not in res                   # only when asked for:
    assert main(["--model", str(tiny_model_dir), "--parts", "spp-tp", "--contexts", "300", "--prompt", "200",
                 "--chunk", "64", "--decode-steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"meta", "spp-tp"}
    assert set(res["spp-tp"]["tpot_ms"]) == {"1 process, 1 thread", "1 process, 4 threads",
                                             "spp2xtp2, 1 thread per rank"}
    assert all(t > 0 for t in res["spp-tp"]["ttft_s"].values())
    assert main(["--model", str(tiny_model_dir), "--parts", "kvp-tp", "--contexts", "300", "--chunk", "128",
                 "--decode-steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"meta", "kvp-tp"}
    assert set(res["kvp-tp"][0]["tpot_ms"]) == {"1 process, 1 thread", "1 process, 4 threads",
                                                "kvp2xtp2, 1 thread per rank"}
    assert all(t > 0 for t in res["kvp-tp"][0]["tpot_ms"].values())
    with pytest.raises(SystemExit, match="context"):
        main(["--model", str(tiny_model_dir), "--contexts", "40000", "--out", str(out)])


def test_the_expert_parallel_part_needs_a_moe_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    from raycluster.model.tiny import write_tiny_model

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "ep.json"
    moe = write_tiny_model(tmp_path / "mixtral", architectures=["MixtralForCausalLM"], num_hidden_layers=2)
    assert main(["--model", moe, "--parts", "tp-ep", "--contexts", "300", "--prompt", "200", "--chunk", "64",
                 "--decode-steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"meta", "tp-ep"}
    assert set(res["tp-ep"]["tpot_ms"]) == {"1 process, 1 thread", "tp2, 1 thread per rank",
                                            "tp2 expert-parallel, 1 thread per rank"}
    assert all(t > 0 for t in res["tp-ep"]["ttft_s"].values())
    with pytest.raises(SystemExit, match="mixture-of-experts"):
        main(["--model", str(tiny_model_dir), "--parts", "tp-ep", "--contexts", "300", "--prompt", "200",
              "--out", str(out)])
