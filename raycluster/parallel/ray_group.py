"""Ranks 1..world-1 of a parallel group (any `factory.group_kind`) as Ray actors (the leader is the engine's process).

Placement: when the leader runs in a placement group of at least `world` bundles (a Serve
replica given `placement_group_bundles`, one bundle per rank; the replica itself holds bundle
0), rank r is placed in bundle r, so the group's strategy decides whether it may span nodes
(STRICT_PACK: one node; PACK / SPREAD / STRICT_SPREAD: several). Otherwise every rank is
placed on the leader's node. A rank binds its gloo sockets to the group's host when that is
loopback (one node), and to its own node's address otherwise.

Each `GroupRank` actor loads its weights itself from `model_path`:
a rank of a `SHARDED_KINDS` group reads only its part (raycluster.parallel.shard.load_shard, when it
joins the group and knows its rank), a KVP rank the full model. It joins the group's store at the `GroupAddress` the leader chose, and runs `serve_rank` in one long
actor call until the leader posts None. `RayRanks.join` waits for those calls, then kills the actors.
"""

from __future__ import annotations

import os

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raycluster.engine.config import EngineConfig
from raycluster.parallel.group import Collective, GroupAddress, is_loopback, serve_rank
from raycluster.parallel.shard import Checkpoint


@ray.remote
class GroupRank:
    def __init__(self, model_path: str, config_json: str, threads: int) -> None:
        from raycluster.model.loader import load_config, load_model
        from raycluster.parallel.factory import SHARDED_KINDS, group_kind

        torch.set_num_threads(threads)
        self.config = EngineConfig.model_validate_json(config_json)
        if self.config.hf_overrides and not os.path.isdir(model_path):
            # The leader's derived directory is in its node's cache: derive this node's own.
            from raycluster.model.registry import resolve_model_path
            model_path = resolve_model_path(self.config.model, self.config.hf_overrides)
        self.dtype = self.config.torch_dtype()
        if group_kind(self.config) in SHARDED_KINDS:
            # read at `serve`, by rank
            self.model = Checkpoint(model_path, load_config(model_path), self.config.quant_kernels)
        else:
            self.model, _ = load_model(model_path, dtype=self.dtype, device=self.config.device,
                                       quant_kernels=self.config.quant_kernels)

    def node(self) -> dict:
        """Where this rank runs: its Ray node's id and address."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def serve(self, kind: str, addr: GroupAddress, rank: int) -> int:
        from raycluster.parallel.factory import group_worker

        bind = addr.host if is_loopback(addr.host) else ray.util.get_node_ip_address()
        coll = Collective(addr, rank, self.config.device, bind_host=bind)
        return serve_rank(coll, group_worker(kind, self.model, coll, self.config, self.dtype))


def rank_placement(rank: int, world: int):
    """Rank `rank`'s scheduling strategy: its bundle of the leader's placement group when that
    has one per rank, else the leader's node. (A group whose placement may span nodes must meet
    on routable addresses: ClusterConfig refuses a loopback group_host for one.)"""
    pg = ray.util.get_current_placement_group()
    if pg is not None and len(pg.bundle_specs) >= world:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank,
                                                placement_group_capture_child_tasks=True)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class RayRanks:
    def __init__(self, addr: GroupAddress, kind: str, config: EngineConfig, model_path: str | None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        if model_path is None:
            raise ValueError("group_launch 'ray' needs the checkpoint path for the ranks to load")
        threads = config.num_threads or torch.get_num_threads()
        self.actors = [GroupRank.options(num_cpus=num_cpus, num_gpus=num_gpus,
                                         scheduling_strategy=rank_placement(r, addr.world)).remote(
            model_path, config.model_dump_json(), threads) for r in range(1, addr.world)]
        # Asked before `serve`, which holds each actor (its calls run in order) until the group ends.
        self._nodes = [a.node.remote() for a in self.actors]
        self.calls = [a.serve.remote(kind, addr, r) for r, a in enumerate(self.actors, start=1)]

    def nodes(self, timeout: float = 30.0) -> list[dict]:
        """Where ranks 1..world-1 run (`GroupRank.node`), in rank order."""
        return ray.get(self._nodes, timeout=timeout)

    def alive(self) -> bool:
        """False once any rank's serve loop has ended (a killed actor, a failed collective)."""
        done, _ = ray.wait(self.calls, num_returns=1, timeout=0)
        return not done

    def join(self, timeout: float) -> None:
        try:
            ray.get(self.calls, timeout=timeout)
        finally:
            for a in self.actors:
                ray.kill(a)
