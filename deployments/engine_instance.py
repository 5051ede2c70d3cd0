"""An engine pool replica: one `InstanceWorker` (engine + KV connector) fed by the router.

Serve owns the replica's life (replicas, health checks, dashboard); the work itself flows
through the named router actor, which the worker long-polls and reports to once per step.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray
import torch
from ray import serve

from raycluster.cluster.config import ClusterConfig
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.router_calls import await_router
from raycluster.engine.stat_log import StatLogger


def rank_nodes(runner, world: int) -> list[str]:
    """The Ray node id of each rank of `runner`'s group, the leader (this replica) first."""
    from raycluster.parallel.ray_group import RayRanks

    here = ray.get_runtime_context().get_node_id()
    ranks = getattr(runner, "ranks", None)
    if isinstance(ranks, RayRanks):
        return [here] + [n["node_id"] for n in ranks.nodes()]
    return [here] * world           # thread ranks, or a single engine


@serve.deployment(max_ongoing_requests=16, health_check_period_s=5, health_check_timeout_s=30)
class EngineInstance:
    def __init__(self, role: str, config_json: str) -> None:
        from raycluster.engine.engine import LLMEngine
        from raycluster.kv_transfer import make_connector
        from raycluster.model.loader import load_config
        from raycluster.model.registry import resolve_model_path
        from raycluster.parallel.factory import build_runner, model_source

        cfg = ClusterConfig.model_validate_json(config_json)
        pool = next(p for p in cfg.pools if p.role == role)
        ecfg = cfg.engine_config(pool)
        torch.set_num_threads(cfg.threads_per_instance)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        path = resolve_model_path(ecfg.model, ecfg.hf_overrides)
        ecfg = ecfg.for_model(load_config(path).dtype)      # dtype 'auto': the checkpoint's
        # The full model, or for a TP / SPP pool the checkpoint each rank reads its own part from.
        model = model_source(ecfg, str(path))
        # A KVP / SPP / TP pool: this replica leads the group; its other ranks are actors (or threads).
        runner = build_runner(ecfg, model, ecfg.torch_dtype(), model_path=str(path), num_cpus=pool.num_cpus,
                              num_gpus=pool.num_gpus)
        self.engine = LLMEngine.from_runner(ecfg, runner, str(path))
        replica = serve.get_replica_context().replica_id.unique_id
        self.instance_id = f"{role}-{replica}"
        connector = None
        # An encoder keeps no KV (each prompt pools in one step): nothing ever moves between its instances.
        if role in ("prefill-short", "prefill-long", "decode") and not self.engine.model.config.is_encoder:
            opts = {}
            if cfg.connector == "torch_dist":   # pairs are built per (prefill, decode) on demand
                opts["host"] = ray.util.get_node_ip_address() if cfg.connector_host == "node" \
                    else cfg.connector_host
            connector = make_connector(cfg.connector, self.engine.runner.port.tensor, self.instance_id,
                                       lease_s=cfg.kv_lease_s, **opts)
        router = self._router = ray.get_actor(cfg.router_name, namespace=cfg.namespace)
        self._drain_s = cfg.drain_s
        self.worker = InstanceWorker(
            self.engine, role, self.instance_id,
            # A slow router is waited for on the same call: calling again would lose a poll's reply
            # or deliver a report twice (raycluster.cluster.router_calls).
            poll_fn=lambda iid, stats, timeout: await_router(router.poll.remote(iid, stats, timeout), iid),
            push_fn=lambda report: await_router(router.push.remote(report), self.instance_id),
            connector=connector, transfer_timeout_s=cfg.transfer_timeout_s,
            on_transfer_failure=cfg.on_transfer_failure,
            # The pressure controller may move it to another pool: it then schedules as that pool's engines.
            role_configs=cfg.role_engine_configs(), nodes=rank_nodes(self.engine.runner, ecfg.parallel_world),
            # Serve's replica logger: lines reach the replica's log file, the dashboard and the driver.
            stat_logger=StatLogger(self.instance_id, cfg.log_stats_interval_s, logging.getLogger("ray.serve").info)
            if cfg.log_stats_interval_s > 0 else None,
            # The gateway's image handles, fetched on the poll thread (Ray's object store).
            fetch_images=ray.get).start()

    def check_health(self) -> None:
        if self.worker.fatal is not None:
            raise RuntimeError(f"{self.instance_id}: stopped serving: {self.worker.fatal}")
        if not all(t.is_alive() for t in self.worker._threads):
            raise RuntimeError(f"{self.instance_id}: worker thread died")
        ranks = self.engine.runner.ranks
        if ranks is not None and not ranks.alive():   # Serve replaces the replica and its group
            raise RuntimeError(f"{self.instance_id}: a rank of its {self.engine.runner.layout} group is gone")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (used by an autoscaled pool's policy,
        raycluster.cluster.autoscale): this instance's requests and prefill tokens and its pool's
        router queue in both units, as the router counts them. A router that does not answer
        (restarting) fails this sample: Serve logs it and the policy averages over the samples
        it has."""
        ref = self._router.autoscale_stats.remote(self.instance_id, self.worker.role)
        return await asyncio.wait_for(ref, timeout=5.0)

    def instance_id_(self) -> str:
        return self.instance_id

    def kv_state(self) -> dict:
        """For tests and `status`: KV bookkeeping of this instance, checked."""
        kv = self.engine.kv
        kv.check()
        conn = self.worker.connector
        return {"instance_id": self.instance_id, "free": kv.num_free_blocks, "total": kv.num_blocks,
                "unfinished": self.engine.has_unfinished(), "parked": len(self.engine.scheduler.parked),
                "kv_pulls": dict(conn.pull_counts) if conn is not None else {}}

    def __del__(self) -> None:
        # Serve stops a replica on scale-down, redeploy or shutdown. First drain: the router
        # sends no new work and the running requests finish here (up to drain_s) instead of
        # being recomputed elsewhere. Then stop stepping and let the router re-queue whatever
        # is left now rather than after missed heartbeats.
        worker = getattr(self, "worker", None)
        if worker is not None:
            if self._drain_s > 0:
                try:
                    if ray.get(self._router.drain_instance.remote(self.instance_id), timeout=5):
                        worker.drain(self._drain_s)
                except Exception:    # router gone (cluster shutting down): nothing to finish for
                    pass
            worker.stop(timeout=1.0)
            try:
                self.engine.close()      # a KVP / SPP / TP group's ranks
            except Exception:            # a rank already gone: its collective timed out
                pass
            try:
                ray.get(self._router.remove_instance.remote(self.instance_id), timeout=5)
            except Exception:       # router gone (cluster shutting down): nothing to tell
                pass
