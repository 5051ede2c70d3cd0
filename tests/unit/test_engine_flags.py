"""EngineConfig's fields as CLI flags (vLLM's engine args): given ones become overrides that
EngineConfig coerces, `none` unsets an optional field, a bad value is refused naming its flag,
and `up` carries them into every pool's engine options (also through --detach's re-exec)."""

import argparse

import pytest

from deployments.launcher import override_args
from raycluster.cli import build_parser, main
from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine_flags import add_engine_flags, check_overrides, engine_overrides


def test_given_flags_become_engine_options():
    args = build_parser().parse_args(["engine-server", "--max-model-len", "1024", "--dtype", "bfloat16",
                                      "--chunk-size", "none", "--kvp-layout", "progressive", "--max-num-seqs", "4"])
    over = engine_overrides(args)
    assert over == {"max_model_len": "1024", "dtype": "bfloat16", "chunk_size": None,
                    "kvp_layout": "progressive", "max_num_seqs": "4"}
    cfg = EngineConfig(**check_overrides(over))
    assert (cfg.max_model_len, cfg.dtype, cfg.chunk_size, cfg.kvp_layout, cfg.max_num_seqs) == \
        (1024, "bfloat16", None, "progressive", 4)
    assert engine_overrides(build_parser().parse_args(["engine-server"])) == {}


def test_every_field_has_a_flag_unless_skipped():
    p = argparse.ArgumentParser()
    add_engine_flags(p, skip=("model",))
    dests = {a.dest for a in p._actions}
    assert {"engine_" + f for f in EngineConfig.model_fields if f != "model"} <= dests
    assert "engine_model" not in dests


@pytest.mark.parametrize("argv, flag", [(["--max-num-seqs", "0"], "--max-num-seqs"),
                                         (["--dtype", "int8"], "--dtype"),
                                         (["--block-size", "x"], "--block-size")])
def test_a_bad_value_is_refused_naming_its_flag(argv, flag, capsys):
    assert main(["engine-server", *argv]) == 2
    assert f"raycluster engine-server: {flag}:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine-server", "--kvp-layout", "diagonal"])    # not a choice


def test_up_applies_them_to_every_pool():
    args = build_parser().parse_args(["up", "--max-model-len", "2048", "--kv-cache-tokens", "8192"])
    app = {"engine": {"enable_prefix_caching": True}, "pools": [{"role": "mixed"}, {"role": "decode"},
                                                                {"role": "prefill-short"}]}
    merged = override_args(app, None, None, None, engine=engine_overrides(args))
    assert merged["engine"] == {"enable_prefix_caching": True, "max_model_len": "2048", "kv_cache_tokens": "8192"}
    cfg = ClusterConfig(**merged)
    assert {(cfg.engine_config(p).max_model_len, cfg.engine_config(p).kv_cache_tokens) for p in cfg.pools} == \
        {(2048, 8192)}


@pytest.mark.parametrize("argv", [
    ["up", "--detach", "--policy", "edf", "--max-model-len", "2048", "--chunk-size", "none",
     "--served-model-name", "a", "b", "--no-enable-prefix-caching", "--kvp-layout", "progressive"],
    ["engine-server", "--detach", "--enable-log-requests", "--reasoning-parser", "qwen3",
     "--generation-config", "vllm", "--max-num-seqs", "8", "--threads", "1"],
])
def test_detach_reexecs_with_every_option_given(argv):
    from raycluster.cli import detach_command

    args = build_parser().parse_args(argv)
    cmd = detach_command(args)
    assert cmd[1:4] == ["-m", "raycluster.cli", argv[0]] and "--detach" not in cmd
    again = build_parser().parse_args(cmd[3:])
    skip = {"detach", "fn"}
    assert {k: v for k, v in vars(again).items() if k not in skip} == \
        {k: v for k, v in vars(args).items() if k not in skip}
