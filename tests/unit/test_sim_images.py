"""Images in the simulator (raycluster.sim.images, raycluster.sched.vision_cost): the encoder's
roofline time by hand, a lone request's TTFT as the sum of its steps under the encoder budget,
the engine's encoder cache and prefix cache at work on repeated pictures, the load generator's
picture choice, determinism, and the spec's refusals."""

from __future__ import annotations

import json

import pytest

from loadgen.images import ImageLoad, ImagePool, image_indices
from loadgen.workloads import Workload, WorkloadRequest, make_workload
from raycluster.sched.roofline import A100, GPUS, MODELS, RooflinePredictor
from raycluster.sched.vision_cost import CLIP_L_336, SIGLIP_896, VisionCost
from raycluster.sim.cli import main as sim_main
from raycluster.sim.run import simulate
from raycluster.sim.spec import load_spec

SPEC = {"gpu": "a100", "model": "llama-3-8b", "policy": "fcfs", "vision": "clip-vit-l-336",
        "pools": [{"role": "mixed", "instances": 1, "tp": 1}]}


def test_clip_encoder_time_by_hand():
    # CLIP ViT-L/14-336 under LLaVA's MLP projector into a 4096-wide text model.
    layer = 4 * 1024 ** 2 + 2 * 1024 * 4096
    flops = 2 * 577 * 24 * layer + 4 * 24 * 1024 * 577 ** 2 + 2 * 576 * (1024 * 4096 + 4096 * 4096)
    assert CLIP_L_336.flops(4096) == flops
    cost = VisionCost(A100, CLIP_L_336, 4096, tp=1, mfu=0.5, mbu=0.8)
    assert cost.time(3) == pytest.approx(3 * flops / (312e12 * 0.5))         # compute-bound
    assert cost.time(0) == 0.0
    assert VisionCost(A100, CLIP_L_336, 4096, tp=2).time(3) == pytest.approx(cost.time(3) / 2)
    # One image reads the weights once: compute still dominates (2.6 ms vs ~0.6 ms).
    weights = 2 * (24 * layer + 1024 * 4096 + 4096 * 4096) / (2.039e12 * 0.8)
    assert cost.time(1) > weights and SIGLIP_896.flops(4096) > 10 * flops


def _lone(prompt: int, out: int = 2) -> Workload:
    return Workload("lone", {"qps": 1.0}, [WorkloadRequest("r0", 0.0, prompt, out)])


def test_a_lone_requests_ttft_is_its_steps_under_the_encoder_budget():
    """Two pictures and 100 text tokens, one picture's tokens a step may encode: the first step
    prefills the first picture (and encodes it), the second the other picture and the text."""
    token = {"packer": "token", "chunk_size": 4096, "max_num_batched_tokens": 4096}
    spec = load_spec({**SPEC, "engine": {**token, "max_num_encoder_tokens": 576}})
    res = simulate(spec, _lone(100), images=ImageLoad(2, 336, 336, 8))
    pred = RooflinePredictor(GPUS["A100"], MODELS["llama-3-8b"], 1, 1, 1, mfu=spec.mfu, mbu=spec.mbu)
    enc = VisionCost(A100, CLIP_L_336, 4096, mfu=spec.mfu, mbu=spec.mbu).time(1)
    want = pred.batch_time([(576, 0)], []) + enc + pred.batch_time([(676, 576)], []) + enc
    (rec,) = res["requests"]
    assert rec["ttft_s"] == pytest.approx(want, rel=1e-9)
    assert res["meta"]["sim"]["images"]["encoded"] == 2
    # Without the budget both pictures and the text go in one step.
    spec1 = load_spec({**SPEC, "engine": token})
    (one,) = simulate(spec1, _lone(100), images=ImageLoad(2, 336, 336, 8))["requests"]
    two = VisionCost(A100, CLIP_L_336, 4096, mfu=spec.mfu, mbu=spec.mbu).time(2)
    assert one["ttft_s"] == pytest.approx(pred.batch_time([(1252, 0)], []) + two, rel=1e-9)


def test_repeated_pictures_hit_the_encoder_cache_and_the_prefix_cache():
    wl = make_workload("chat", seed=3, qps=2.0, num_requests=60)
    one = ImageLoad(1, 336, 336, 1)             # every request shows the same picture first
    # Without prefix caching every request reaches the picture: encoded once, then found.
    plain = simulate(load_spec(SPEC), wl, images=one)["meta"]["sim"]["images"]
    assert plain["encoded"] == 1 and plain["encoder_cache_hits"] == len(wl) - 1
    # With it, the picture's 576 tokens (36 whole blocks) come from the prefix cache: no chunk
    # reaches the picture again, so it is neither encoded nor looked up.
    spec = load_spec({**SPEC, "engine": {"enable_prefix_caching": True}})
    res = simulate(spec, wl, images=one)
    images = res["meta"]["sim"]["images"]
    assert images["encoded"] == 1 and images["encoder_cache_hits"] == 0
    block = spec.engine_config(spec.pools[0]).block_size
    assert res["meta"]["sim"]["prefix_hit_tokens"] >= (576 // block) * block * (len(wl) - 1)
    many = simulate(spec, wl, images=ImageLoad(1, 336, 336, 10_000))["meta"]["sim"]
    assert many["images"]["encoded"] == len({image_indices(r.request_id, 1, 10_000)[0] for r in wl})
    assert many["prefix_hit_tokens"] < res["meta"]["sim"]["prefix_hit_tokens"]


def test_pictures_cost_time_and_runs_are_deterministic():
    wl = make_workload("chat", seed=1, qps=4.0, num_requests=80)
    spec = load_spec(SPEC)
    text = simulate(spec, wl)["summary"]
    a = simulate(spec, wl, images=ImageLoad(2, 640, 480, 8))
    b = simulate(spec, wl, images=ImageLoad(2, 640, 480, 8))
    assert json.dumps(a["requests"], sort_keys=True) == json.dumps(b["requests"], sort_keys=True)
    assert a["summary"]["completed"] == len(wl) and a["summary"]["ttft_p50_s"] > text["ttft_p50_s"]


def test_the_simulators_pictures_are_the_load_generators():
    load = ImageLoad(3, 64, 48, 5)
    pool = ImagePool(load)
    for rid in ("a", "chat-17", "x" * 40):
        idx = image_indices(rid, 3, 5)
        assert [pool._url(i) for i in idx] == pool.urls_for(rid) and len(idx) == 3


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="vision: images are timed by the roofline"):
        load_spec({**SPEC, "gpu": "cpu", "model": "tiny"})
    with pytest.raises(ValueError, match="names no vision tower"):
        simulate(load_spec({k: v for k, v in SPEC.items() if k != "vision"}), _lone(10), images=ImageLoad(1))
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "vision"}))
    assert sim_main(["--cluster", str(spec), "--workload", "chat", "--num-requests", "2", "--images", "1",
                     "--out", str(tmp_path / "o.json"), "--quiet"]) == 2


def test_sim_search_sizes_an_image_text_cluster(tmp_path):
    """`raycluster sim-search --images 2`: the same A100 serves fewer QPS under the same TTFT bound
    when every request carries two pictures; a candidate without a vision tower is refused."""
    from raycluster.sim.search_cli import main as search_main

    base = tmp_path / "base.yaml"
    base.write_text(json.dumps(SPEC))
    search = tmp_path / "search.yaml"
    search.write_text(json.dumps({"base": str(base), "candidates": [{"name": "one"}],
                                  "qps": {"min": 0.5, "max": 32, "rel_tol": 0.3},
                                  "slo": [{"metric": "ttft_p99_s", "max": 2.0}]}))
    common = ["--search", str(search), "--workload", "chat", "--duration", "60", "--seed", "1", "--quiet"]
    assert search_main(common + ["--out", str(tmp_path / "text.json")]) == 0
    assert search_main(common + ["--images", "2", "--out", str(tmp_path / "img.json")]) == 0
    text, img = (json.loads((tmp_path / f).read_text())["candidates"][0]["capacity_qps"]
                 for f in ("text.json", "img.json"))
    assert 0 < img < text / 2
    plain = tmp_path / "plain.yaml"
    plain.write_text(json.dumps({k: v for k, v in SPEC.items() if k != "vision"}))
    search.write_text(search.read_text().replace(str(base), str(plain)))
    assert search_main(common + ["--images", "1", "--out", str(tmp_path / "x.json")]) == 2
