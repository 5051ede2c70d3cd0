"""EngineConfig's fields as CLI flags (vLLM's engine args): given ones become overrides that
EngineConfig coerces, `none` unsets an optional field, a bad value is refused naming its flag,
and `up` carries them into every pool's engine options (also through --detach's re-exec).
And vLLM's default `--dtype auto`: the checkpoint's dtype."""

import argparse

import pytest
import torch

from deployments.launcher import override_args
from raycluster.cli import build_parser, main
from raycluster.cluster.config import ClusterConfig
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import SamplingParams
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


def test_lora_modules_take_several_name_path_entries():
    args = build_parser().parse_args(["up", "--lora-modules", "sql=/a/sql", "chat=/a/chat"])
    over = engine_overrides(args)
    assert over == {"lora_modules": ["sql=/a/sql", "chat=/a/chat"]}
    merged = override_args({"pools": [{"role": "mixed"}]}, None, None, None, engine=over)
    assert ClusterConfig(**merged).lora_names() == ["sql", "chat"]
    assert main(["engine-server", "--lora-modules", "sql"]) == 2


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
     "--served-model-name", "a", "b", "--no-enable-prefix-caching", "--kvp-layout", "progressive",
     "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"],
    ["engine-server", "--detach", "--enable-log-requests", "--reasoning-parser", "qwen3", "--chat-template",
     "{{ messages[0].content }}",
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


@pytest.mark.parametrize("checkpoint_dtype, device, want", [
    ("bfloat16", "cpu", "bfloat16"), ("float32", "cpu", "float32"), (None, "cpu", "float32"),
    ("float16", "cpu", "bfloat16"), ("float16", "cuda", "float16")])
def test_dtype_auto_is_the_checkpoints(checkpoint_dtype, device, want):
    assert EngineConfig(device=device).for_model(checkpoint_dtype).dtype == want
    assert EngineConfig(device=device, dtype="float32").for_model(checkpoint_dtype).dtype == "float32"
    with pytest.raises(ValueError, match="^dtype: 'auto'"):
        EngineConfig().torch_dtype()


def test_a_bf16_checkpoint_is_served_in_bf16_by_default(tmp_path):
    """vLLM's --dtype auto: weights and KV in the checkpoint's dtype (float32 on the tiny model)."""
    from raycluster.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    eng = LLMEngine.from_config(EngineConfig(model=str(path), kv_cache_tokens=256, policy="fcfs", packer="token",
                                             predictor="none"))
    assert eng.config.dtype == "bfloat16" and eng.runner.kv_cache.dtype == torch.bfloat16
    assert next(eng.runner.model.parameters()).dtype == torch.bfloat16
    assert len(eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]) == 3
    tiny = LLMEngine.from_config(EngineConfig(kv_cache_tokens=256, policy="fcfs", packer="token", predictor="none"))
    assert tiny.config.dtype == "float32" and tiny.runner.kv_cache.dtype == torch.float32


def test_vllms_speculative_config_sets_the_speculative_fields(capsys):
    args = build_parser().parse_args(["up", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'])
    over = engine_overrides(args)
    assert over == {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    cfg = EngineConfig(**check_overrides(over))
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == \
        ("ngram", 3, 2, 1)
    # A draft model: vLLM's `model` key, its method implied.
    draft = engine_overrides(build_parser().parse_args(["up", "--speculative-config",
                                                        '{"model": "tiny", "num_speculative_tokens": 3}']))
    assert draft == {"speculative_method": "draft_model", "speculative_model": "tiny", "num_speculative_tokens": 3}
    assert EngineConfig(**check_overrides(draft)).speculative_model == "tiny"
    eagle = engine_overrides(build_parser().parse_args(["up", "--speculative-config",
                                                        '{"method": "eagle", "model": "/heads/e1"}']))
    assert eagle == {"speculative_method": "eagle", "speculative_model": "/heads/e1"}
    assert engine_overrides(build_parser().parse_args(["up", "--speculative-config", '{"method": "deepseek_mtp"}'])) \
        == {"speculative_method": "mtp"}
    for spec, msg in (('{"method": "medusa", "model": "h"}', "method 'medusa' not supported"),
                      ('{"method": "mtp", "model": "h"}', "a draft model or EAGLE head is only for"),
                      ('{"method": "eagle"}', "speculative_method 'eagle' needs an EAGLE head"),
                      ('{"method": "ngram", "model": "draft"}', "a draft model or EAGLE head is only for"),
                      ('{"method": "draft_model"}', "speculative_model: speculative_method 'draft_model' needs"),
                      ('{"model": "tiny", "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size not"),
                      ('{"num_speculative_tokens": 2}', "method None not supported"),
                      ("[1]", "must be a JSON object"), ("{", "not JSON"),
                      ('{"method": "ngram", "num_speculative_tokens": 0}', "--num-speculative-tokens")):
        assert main(["engine-server", "--speculative-config", spec]) == 2
        assert msg in capsys.readouterr().err
    assert main(["engine-server", "--speculative-config", '{"method": "ngram"}', "--speculative-method", "none"]) == 2
    assert "speculative_method is also given as --speculative-method" in capsys.readouterr().err
    detached = build_parser().parse_args(["up", "--detach", "--speculative-config", '{"method": "ngram"}'])
    from raycluster.cli import detach_command
    again = build_parser().parse_args(detach_command(detached)[3:])
    assert engine_overrides(again) == {"speculative_method": "ngram"}


def test_engine_server_lora_resolver_max_loaded(capsys, monkeypatch):
    """--lora-resolver-max-loaded needs a resolver (VLLM_LORA_RESOLVER_CACHE_DIR with runtime
    updating): without one the server refuses to start, naming the setting; --detach passes it on."""
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR", raising=False)
    assert main(["engine-server", "--kv-cache-tokens", "256", "--lora-resolver-max-loaded", "2"]) == 2
    assert "raycluster engine-server: lora_resolver_max_loaded: there is no LoRA resolver" in capsys.readouterr().err
    from raycluster.cli import detach_command
    args = build_parser().parse_args(["engine-server", "--detach", "--lora-resolver-max-loaded", "3"])
    cmd = detach_command(args)
    assert cmd[cmd.index("--lora-resolver-max-loaded") + 1] == "3"
    assert build_parser().parse_args(cmd[3:]).lora_resolver_max_loaded == 3
