"""Builds the Serve application from a `ClusterConfig` (the `args` of a Serve config YAML):
creates the named router actor (or hands a running one the new config), one `EngineInstance`
deployment per pool and the gateway.

    import_path: deployments.app:build_app
"""

from __future__ import annotations

import ray
from ray import serve

from deployments.engine_instance import EngineInstance
from deployments.gateway import CONFIG_ENV, Gateway
from deployments.scaling import pool_deployment
from raycluster.cluster.config import ClusterConfig, PoolSpec
from raycluster.cluster.router_actor import get_or_create_router
from raycluster.cluster.router_core import RouterConfig
from raycluster.model.loader import load_config
from raycluster.model.registry import resolve_model_path
from raycluster.sched.base import SLOConfig


ROUTER_WAIT_S = 120.0       # for the router actor to start (first deploy) and take the config


def router_config(cfg: ClusterConfig) -> RouterConfig:
    ecfg = cfg.engine_config(cfg.pools[0])
    return RouterConfig(policy=cfg.policy, max_queue=cfg.max_queue, max_local_waiting=cfg.max_local_waiting,
                        initial_l_m=cfg.initial_l_m, prefix_affinity=cfg.prefix_affinity,
                        decode_affinity_slack=cfg.decode_affinity_slack, standby_roles=cfg.standby_roles(),
                        pressure=cfg.controller.pressure(),
                        pressure_period_s=cfg.controller.period_s,
                        slo=SLOConfig(ttft_ms=ecfg.ttft_ms, tpot_ms=ecfg.tpot_ms, ttft_scale=ecfg.ttft_scale),
                        lora=cfg.lora_modules(), max_stored_responses=cfg.max_stored_responses)


def placement(cfg: ClusterConfig, pool: PoolSpec) -> dict:
    """Serve options that reserve a group-leading replica's ranks with it (one bundle each)."""
    bundles = cfg.placement_bundles(pool)
    if bundles is None:
        return {}
    return {"placement_group_bundles": bundles, "placement_group_strategy": pool.placement_strategy}


def pool_options(cfg: ClusterConfig, pool: PoolSpec) -> dict:
    """The Serve options of pool `pool`'s deployment: a fixed `num_replicas`, or for an autoscaled
    pool Serve's `autoscaling_config` with the router-signal policy (raycluster.cluster.autoscale)."""
    size = {"num_replicas": pool.instances} if pool.autoscaling is None else \
        {"autoscaling_config": pool.autoscaling.serve_config(pool.instances, pool.role, cfg.router_name,
                                                              cfg.namespace)}
    return {"name": pool_deployment(pool.role), **size,
            # Serve force-kills a stopping replica after this: room for its drain and a group's close.
            "graceful_shutdown_timeout_s": cfg.drain_s + 15.0,
            "ray_actor_options": {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus}, **placement(cfg, pool)}


def build_app(args: dict) -> serve.Application:
    cfg = ClusterConfig(**(args or {}))
    path = resolve_model_path(cfg.model, cfg.engine_config(cfg.pools[0]).hf_overrides)
    problem = cfg.kv_layout_problem(load_config(path))
    if problem is not None:         # refused at deploy time, not at the first handoff
        raise ValueError(problem)
    rcfg = router_config(cfg)
    router = get_or_create_router(rcfg, name=cfg.router_name, namespace=cfg.namespace)
    # A router from an earlier deploy outlives it (detached): it takes this deploy's config, and
    # requests arriving while Serve (re)starts the pools' replicas wait for them instead of a 503.
    ray.get([router.reconfigure.remote(rcfg),
             router.expect_instances.remote([p.role for p in cfg.deployed_pools()], cfg.deploy_grace_s)],
            timeout=ROUTER_WAIT_S)
    blob = cfg.model_dump_json()
    pools = [EngineInstance.options(**pool_options(cfg, p)).bind(p.role, blob) for p in cfg.deployed_pools()]
    return Gateway.options(num_replicas=cfg.gateway_replicas,
                           ray_actor_options={"num_cpus": 0.5,
                                              "runtime_env": {"env_vars": {CONFIG_ENV: blob}}}).bind(*pools)
