"""ClusterConfig's GPU pools: GPUs per instance make the engine's device default to cuda, an
engine on cuda without GPUs from Ray is refused naming the pool's field, and an explicit device
wins."""

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
