"""Builds an engine's model runner from its config: one process (`ModelRunner`), or the leader of
a KVP / SPP / TP / SPP x TP / KVP x TP / KVP x SPP / KVP x SPP x TP group whose other ranks run
as threads here or as Ray actors (raycluster.parallel.ray_group). The runner's `kv` is the
engine's block bookkeeping (over the KVP ranks when kvp > 1, in `kvp_layout`).

The model enters as a full model in memory or, for the kinds whose ranks hold only their shard
(`SHARDED_KINDS`: all but plain KVP), as a `Checkpoint` each rank reads its own part from
(raycluster.parallel.shard); plain KVP ranks replicate the full model."""

from __future__ import annotations

import dataclasses
import functools

import torch

from raycluster.engine.config import HEAD_METHODS, EngineConfig
from raycluster.engine.hybrid_kv import HybridKVManager
from raycluster.engine.hybrid_prefix import HybridPrefixCachingKVManager
from raycluster.engine.kv_groups import KVGroups, kv_groups
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.kv_memory import check_kv_fits
from raycluster.engine.model_runner import ModelRunner
from raycluster.engine.prefix_cache import PrefixCachingKVManager
from raycluster.engine.window_kv import SlidingWindowKVManager
from raycluster.parallel.group import Collective, GroupAddress, ThreadRanks
from raycluster.ports import free_port
from raycluster.parallel.shard import Checkpoint

# Each rank loads only its part of the weights.
SHARDED_KINDS = ("tp", "spp", "spp-tp", "kvp-tp", "kvp-spp", "kvp-spp-tp")
SPP_KINDS = ("spp", "spp-tp", "kvp-spp", "kvp-spp-tp")         # pipelines, led by SPPRunner


def group_kind(config: EngineConfig) -> str:
    """"single", "kvp", "spp", "tp", "spp-tp", "kvp-tp", "kvp-spp" or "kvp-spp-tp"."""
    if config.kvp > 1 and config.spp > 1:
        return "kvp-spp-tp" if config.tp > 1 else "kvp-spp"
    if config.spp > 1 and config.tp > 1:
        return "spp-tp"
    if config.kvp > 1 and config.tp > 1:
        return "kvp-tp"
    return next((k for k, n in (("kvp", config.kvp), ("spp", config.spp), ("tp", config.tp)) if n > 1), "single")


def group_worker(kind: str, model, coll: Collective, config: EngineConfig, dtype: torch.dtype):
    """The handler rank `coll.rank` (not the leader) runs for each message in a group of `kind`
    (`group_kind`'s kinds but "single"). `model` is the full model (a TP rank shards it)
    or, for `SHARDED_KINDS`, the `Checkpoint` the rank reads its part from."""
    blocks = config.kv_cache_tokens // config.block_size
    if kind in ("kvp", "kvp-tp"):
        from raycluster.parallel.kvp import kvp_worker
        return kvp_worker(model, coll, blocks, config.block_size, dtype, config.device, config.tp,
                          config.enable_expert_parallel)
    if kind == "tp":
        from raycluster.parallel.tp import tp_worker
        return tp_worker(model, coll, blocks, config.block_size, dtype, config.device, config.enable_expert_parallel,
                         hybrid_groups(config, model.config))
    from raycluster.parallel.spp import spp_worker
    # tp: 1, or the lanes of each stage (or of each KVP rank of it); kvp: 1, or each stage's KVP
    # ranks, each holding `blocks` blocks as a plain KVP rank does.
    return spp_worker(model, coll, config.spp, blocks, config.block_size, dtype, config.device,
                      config.spp_micro_tokens, config.tp, config.kvp, config.enable_expert_parallel)


def group_host(config: EngineConfig) -> str:
    """The address the group's store binds to: `group_host`, or for 'node' this Ray node's."""
    if config.group_host != "node":
        return config.group_host
    import ray

    if not ray.is_initialized():
        raise ValueError("group_host: 'node' means the Ray node's address, but this process is not in Ray")
    return ray.util.get_node_ip_address()


def build_runner(config: EngineConfig, model, dtype: torch.dtype, model_path: str | None = None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0):
    """The engine's runner; for a group, start its other ranks (Ray actors need `model_path`
    and take `num_cpus` and `num_gpus` each), join them, and return the leader. `model`: the
    full model, or (`SHARDED_KINDS` only) a `Checkpoint`; with a full model and a `model_path`,
    thread ranks of those kinds read their own part from the path rather than cut it from it."""
    extra = eagle_kv_layers(config)
    runner = _build_runner(config, model, dtype, model_path, num_cpus, num_gpus, extra)
    if extra and config.enable_prefix_caching:
        # As vLLM: a cached run's last head KV was made with another request's next token.
        runner.kv.rerun_last_match = True
    return runner


def releasable_window(config: EngineConfig, mcfg) -> int | None:
    """The window whose out-of-reach blocks the engine gives back (raycluster.engine.window_kv):
    when every layer slides, without prefix caching, an EAGLE head or KV parallelism; else None."""
    if mcfg.is_encoder or not mcfg.sliding_window or len(mcfg.sliding_layers) != mcfg.num_hidden_layers:
        return None
    if config.enable_prefix_caching or config.speculative_method in HEAD_METHODS or config.kvp > 1:
        return None
    return mcfg.sliding_window


def hybrid_groups(config: EngineConfig, mcfg) -> KVGroups | None:
    """The KV groups of a model mixing sliding and full layers, when the engine keeps a table per
    group (raycluster.engine.hybrid_kv): one process or a TP group, without an EAGLE head / MTP
    layer, unless `disable_hybrid_kv_cache_manager`; else None (one table)."""
    if mcfg.is_encoder or config.disable_hybrid_kv_cache_manager:
        return None
    if config.speculative_method in HEAD_METHODS or config.kvp > 1 or config.spp > 1:
        return None
    return kv_groups(mcfg)


def _encoder_runner(config: EngineConfig, model, dtype: torch.dtype, kind: str, blocks: int):
    """A BERT-style encoder's runner: one process, no KV to cache, nothing generated."""
    from raycluster.engine.encoder_runner import EncoderRunner

    if kind != "single":
        raise ValueError(f"tp / kvp / spp: a BERT-style encoder runs in one process (got a {kind} group of "
                         f"{config.parallel_world} ranks); use tp, kvp and spp 1")
    if config.speculative_method != "none":
        raise ValueError("speculative_method: an encoder generates no tokens to draft")
    if config.lora_modules:
        raise ValueError("lora_modules: LoRA adapters are served on decoder models only")
    return EncoderRunner(model, KVCacheManager(blocks, config.block_size), dtype, config.device)


def _build_runner(config: EngineConfig, model, dtype: torch.dtype, model_path: str | None, num_cpus: float,
                  num_gpus: float, extra: int):
    """`build_runner`'s runner, `extra`: the EAGLE head's KV layers (0 without one)."""
    blocks = config.kv_cache_tokens // config.block_size
    kv_manager = PrefixCachingKVManager if config.enable_prefix_caching else KVCacheManager
    window = releasable_window(config, model.config)
    if window:
        kv_manager = functools.partial(SlidingWindowKVManager, window=window)
    groups = hybrid_groups(config, model.config)
    if groups is not None:      # the same memory as a pool of blocks of `slots` layers each
        kv_manager = functools.partial(_hybrid_manager, groups=groups, prefix_caching=config.enable_prefix_caching)
    kind = group_kind(config)
    if kind == "single" or config.group_launch == "threads":     # every rank's KV in this host's memory
        mcfg = dataclasses.replace(model.config, num_hidden_layers=model.config.num_hidden_layers + extra)
        check_kv_fits(blocks * config.block_size, mcfg, dtype, torch.device(config.device))
    world = config.parallel_world
    if model.config.is_encoder:
        return _encoder_runner(config, model, dtype, kind, blocks)
    if kind == "single":
        return ModelRunner(model, kv_manager(blocks, config.block_size), dtype, config.device, extra_kv_layers=extra)
    if config.kvp > 1 and model.config.sliding_layers:
        raise ValueError(f"kvp: {config.kvp} KVP ranks for a sliding-window model (window "
                         f"{model.config.sliding_window}): KV parallelism does not mask by a window; use kvp 1")
    if config.kvp > 1 and model.config.attention_chunk is not None:
        raise ValueError(f"kvp: {config.kvp} KVP ranks for a model with chunked attention (attention_chunk_size "
                         f"{model.config.attention_chunk}): KV parallelism does not mask by a chunk; use kvp 1")
    if config.kvp > 1 and model.config.gemma is not None and model.config.gemma.attn_softcap is not None:
        raise ValueError(f"kvp: {config.kvp} KVP ranks for a model that soft-caps attention scores "
                         f"(attn_logit_softcapping {model.config.gemma.attn_softcap}): KV-parallel attention "
                         "does not cap them; use kvp 1")
    if kind in SPP_KINDS and not model.config.has_lm_head:
        raise ValueError(f"spp: {config.spp} stages for a checkpoint without an output head: it serves pooling "
                         "requests only, and an spp group's stages do not return the final hidden states; use spp 1")
    if kind in SPP_KINDS and config.spp > model.config.num_hidden_layers:
        raise ValueError(f"spp: {config.spp} stages for {model.config.num_hidden_layers} layers")
    if config.tp > 1:
        from raycluster.parallel.tp import check_tp
        check_tp(model.config, config.tp, config.enable_expert_parallel)       # before any rank starts
    host = group_host(config)
    addr = GroupAddress(host, free_port(host), world, config.group_timeout_s)
    if config.group_launch == "ray":
        from raycluster.parallel.ray_group import RayRanks
        ranks = RayRanks(addr, kind, config, model_path, num_cpus, num_gpus)
    else:
        source = model
        if kind in SHARDED_KINDS and model_path is not None and not isinstance(model, Checkpoint):
            source = Checkpoint(model_path, model.config, config.quant_kernels)
        ranks = ThreadRanks(addr, lambda coll: group_worker(kind, source, coll, config, dtype), config.device)
    coll = Collective(addr, 0, config.device)      # returns once every rank has joined
    if kind in ("kvp", "kvp-tp"):
        from raycluster.parallel.kvp import KVPRunner
        # KVP x TP too: the lanes of a KVP rank hold their heads of that rank's blocks.
        return KVPRunner(model, coll, config.kvp, blocks, config.block_size, dtype, config.device, ranks=ranks,
                         prefix_caching=config.enable_prefix_caching, tp=config.tp,
                         tokens_per_rank=config.kvp_progressive_tokens(), start=config.kvp_start,
                         extra_kv_layers=extra, expert_parallel=config.enable_expert_parallel)
    if kind == "tp":
        from raycluster.parallel.tp import TPRunner
        # Every rank holds its heads of the same block ids: the engine's bookkeeping is unchanged.
        return TPRunner(model, kv_manager(blocks, config.block_size), coll, world, dtype, config.device, ranks=ranks,
                        extra_kv_layers=extra, expert_parallel=config.enable_expert_parallel)
    from raycluster.parallel.spp import SPPRunner
    # SPP x TP too: every rank holds its layers and heads of the same block ids. With KVP, each
    # stage's KVP ranks hold the blocks the layout gives them, the same in every stage.
    if config.kvp > 1:
        from raycluster.parallel.kvp_layout import kvp_kv_manager
        kv = kvp_kv_manager(blocks, config.kvp, config.block_size, config.enable_prefix_caching,
                            config.kvp_progressive_tokens(), config.kvp_start)
    else:
        kv = kv_manager(blocks, config.block_size)
    return SPPRunner(model, kv, coll, config.spp, dtype, config.device, config.spp_micro_tokens, ranks=ranks,
                     tp=config.tp, kvp=config.kvp, expert_parallel=config.enable_expert_parallel)


def _hybrid_manager(blocks: int, block_size: int, groups: KVGroups, prefix_caching: bool) -> HybridKVManager:
    manager = HybridPrefixCachingKVManager if prefix_caching else HybridKVManager
    return manager(groups.pool_blocks(blocks), block_size, groups)


def eagle_kv_layers(config: EngineConfig) -> int:
    """The EAGLE head's (or MTP layer's) layers, whose KV the runner holds beside the model's (0
    without one; the config keeps them to single-process, TP and KVP engines)."""
    if config.speculative_method == "mtp":
        return 1
    if config.speculative_method not in HEAD_METHODS:
        return 0
    from raycluster.model.eagle import head_config
    from raycluster.model.registry import resolve_model_path
    return head_config(resolve_model_path(config.speculative_model), config.speculative_method)[0].num_hidden_layers


def model_source(config: EngineConfig, path: str):
    """What `build_runner` takes for `config`, from the checkpoint at `path`: a `Checkpoint` for
    `SHARDED_KINDS` (each rank, the leader too, reads only its part: no process holds the full
    model), else the full model loaded onto the config's device."""
    from raycluster.model.loader import load_config, load_model

    if group_kind(config) in SHARDED_KINDS:
        return Checkpoint(str(path), load_config(path), config.quant_kernels)
    config = config.for_model(load_config(path).dtype)
    return load_model(path, dtype=config.torch_dtype(), device=config.device, quant_kernels=config.quant_kernels)[0]
