"""ClusterConfig's GPU pools: GPUs per instance make the engine's device default to cuda, an
engine on cuda without GPUs from Ray is refused naming the pool's field, and an explicit device
wins. Group placement: a replica leading Ray-actor ranks reserves one bundle per rank, and a
strategy that may span nodes needs a routable group_host. tool_call_parser takes each parser's
name (llama4_pythonic too) and refuses others."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from raycluster.cluster.config import ClusterConfig

PD = [{"role": "prefill-short"}, {"role": "prefill-long"}, {"role": "decode"}]


def test_gpus_per_instance_default_the_device_to_cuda():
    cfg = ClusterConfig(pools=[{**PD[0], "num_gpus": 1}, PD[1], {**PD[2], "num_gpus": 0.5}])
    assert [cfg.engine_config(p).device for p in cfg.pools] == ["cuda", "cpu", "cuda"]
    assert [p.num_gpus for p in cfg.pools] == [1, 0, 0.5]


def test_an_explicit_device_wins():
    cfg = ClusterConfig(engine={"device": "cuda:1"}, pools=[{"role": "mixed", "num_gpus": 2}])
    assert cfg.engine_config(cfg.pools[0]).device == "cuda:1"
    cfg = ClusterConfig(pools=[{"role": "mixed", "num_gpus": 1, "engine": {"device": "cpu"}}])
    assert cfg.engine_config(cfg.pools[0]).device == "cpu"


def test_cuda_without_gpus_names_the_pool_field():
    with pytest.raises(ValidationError, match=r"pools\[1\]\.num_gpus"):
        ClusterConfig(pools=[PD[0], {**PD[1], "engine": {"device": "cuda"}}, PD[2]])
    with pytest.raises(ValidationError, match="num_gpus"):
        ClusterConfig(pools=[{"role": "mixed", "num_gpus": -1}])


def _group_pool(**kw):
    return {"role": "mixed", "num_cpus": 2, "num_gpus": 1,
            "engine": {"spp": 2, "tp": 2, "group_launch": "ray", "group_host": "node"}, **kw}


def test_a_group_leading_replica_reserves_one_bundle_per_rank():
    from deployments.app import placement

    cfg = ClusterConfig(pools=[_group_pool(placement_strategy="PACK")])
    assert placement(cfg, cfg.pools[0]) == {"placement_group_bundles": [{"CPU": 2, "GPU": 1}] * 4,
                                            "placement_group_strategy": "PACK"}
    cfg = ClusterConfig(pools=[{"role": "mixed", "engine": {"tp": 2, "group_launch": "ray"}}])
    assert placement(cfg, cfg.pools[0]) == {"placement_group_bundles": [{"CPU": 1.0}] * 2,
                                            "placement_group_strategy": "STRICT_PACK"}
    # Thread ranks or a single engine: the replica's own resources only.
    for engine in ({"tp": 2}, {}):
        cfg = ClusterConfig(pools=[{"role": "mixed", "engine": engine}])
        assert placement(cfg, cfg.pools[0]) == {}


def test_a_group_that_may_span_nodes_needs_a_routable_group_host():
    for strategy in ("PACK", "SPREAD", "STRICT_SPREAD"):
        with pytest.raises(ValidationError, match=r"pools\[0\]\.engine\.group_host.*set group_host: node"):
            ClusterConfig(pools=[{**_group_pool(placement_strategy=strategy),
                                  "engine": {"tp": 2, "group_launch": "ray"}}])
    ClusterConfig(pools=[{**_group_pool(), "engine": {"tp": 2, "group_launch": "ray"}}])   # STRICT_PACK: one node
    with pytest.raises(ValidationError, match=r"pools\[0\]\.placement_strategy"):
        ClusterConfig(pools=[{"role": "mixed", "placement_strategy": "SPREAD", "engine": {"tp": 2}}])


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[2] / "deployments").glob("*.yaml")))
def test_every_shipped_serve_config_validates(name):
    from deployments.launcher import load_app_spec

    ClusterConfig(**load_app_spec(name)["args"])


def test_tool_call_parser_takes_each_parsers_name():
    for name in ("pythonic", "llama4_pythonic", "qwen3_coder"):
        assert ClusterConfig(tool_call_parser=name).tool_call_parser == name
    with pytest.raises(ValidationError, match="unknown tool_call_parser 'llama4'"):
        ClusterConfig(tool_call_parser="llama4")


def test_reasoning_parser_takes_each_parsers_name():
    for name in ("deepseek_r1", "qwen3"):
        assert ClusterConfig(reasoning_parser=name).reasoning_parser == name
    with pytest.raises(ValidationError, match="unknown reasoning_parser 'r1'; choose one of deepseek_r1, qwen3"):
        ClusterConfig(reasoning_parser="r1")


def test_the_dashboard_hint_says_where_the_login_token_is(tmp_path, monkeypatch):
    from deployments.launcher import dashboard_hint

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dashboard_hint("127.0.0.1:8265") == "http://127.0.0.1:8265"         # no token written: no auth
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert dashboard_hint("127.0.0.1:8265") == f"http://127.0.0.1:8265 (token in {tmp_path}/.ray/auth_token)"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert dashboard_hint("http://h:1") == "http://h:1 (token: $RAY_AUTH_TOKEN)"


def test_served_model_name_takes_one_or_more_names(tmp_path):
    """vLLM's --served-model-name: a string or a list; the default is 'tiny' or the checkpoint
    directory's name; empty or repeated names are refused naming the field."""
    assert ClusterConfig().served_names() == ["tiny"]
    ckpt = tmp_path / "Llama-3-8B-Instruct"
    assert ClusterConfig(model=str(ckpt) + "/").served_names() == ["Llama-3-8B-Instruct"]
    assert ClusterConfig(served_model_name="llm").served_names() == ["llm"]
    assert ClusterConfig(served_model_name=["llm", "tiny"]).served_names() == ["llm", "tiny"]
    for bad in ([], [""], ["a", "a"], [" "]):
        with pytest.raises(ValidationError, match="served_model_name"):
            ClusterConfig(served_model_name=bad)


def test_the_cli_overrides_carry_the_served_names():
    from deployments.launcher import override_args

    args = override_args({"policy": "lars"}, None, None, None, served_model_name=["a", "b"])
    assert args == {"policy": "lars", "served_model_name": ["a", "b"]}
    assert ClusterConfig(**args).served_names() == ["a", "b"]
    assert override_args({"served_model_name": ["a"]}, None, None, None) == {"served_model_name": ["a"]}


def test_hf_overrides_are_one_json_object_for_every_pool():
    """`--hf-overrides` reaches the app's engine options as JSON text: every pool (and the gateway,
    which reads the first pool's) sees the same object; a pool that overrides differently is refused."""
    cfg = ClusterConfig(engine={"hf_overrides": '{"max_position_embeddings": 96}'},
                        pools=[{"role": "mixed", "instances": 1}])
    assert cfg.engine_config(cfg.pools[0]).hf_overrides == {"max_position_embeddings": 96}
    pd = [{"role": "prefill-short", "instances": 1}, {"role": "prefill-long", "instances": 1},
          {"role": "decode", "instances": 1, "engine": {"hf_overrides": {"max_position_embeddings": 64}}}]
    with pytest.raises(ValidationError, match=r"pools\[2\].engine.hf_overrides"):
        ClusterConfig(engine={"hf_overrides": {"max_position_embeddings": 96}}, pools=pd)


def test_prefill_and_decode_pools_must_lay_kv_out_alike():
    """A model mixing sliding and full layers: a decode pool that keeps one table while the
    prefill pools use the hybrid cache's groups could not take their KV; refused naming the pool.
    The same options everywhere, or a model without the mix, are fine."""
    from raycluster.model.config import ModelConfig
    from raycluster.model.tiny import tiny_config

    mixed_layers = ModelConfig.from_dict(tiny_config(architectures=["GptOssForCausalLM"], num_hidden_layers=4))
    split = ClusterConfig(pools=[*PD[:2], {"role": "decode", "engine": {"disable_hybrid_kv_cache_manager": True}}])
    problem = split.kv_layout_problem(mixed_layers)
    assert problem.startswith("pools[2].engine:") and "pools[0] (prefill-short)" in problem
    assert split.kv_layout_problem(ModelConfig.from_dict(tiny_config())) is None
    same = ClusterConfig(pools=PD, engine={"enable_prefix_caching": True})
    assert same.kv_layout_problem(mixed_layers) is None
    assert ClusterConfig(pools=PD).kv_layout_problem(mixed_layers) is None
    # A mixed pool hands no KV over: it may differ.
    assert ClusterConfig(pools=[{"role": "mixed", "engine": {"disable_hybrid_kv_cache_manager": True}}, *PD]) \
        .kv_layout_problem(mixed_layers) is None
