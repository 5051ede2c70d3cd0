"""Ranks 1..world-1 of a parallel group (any `factory.group_kind`) as Ray actors (the leader is the engine's process).

Each `GroupRank` actor, placed on the leader's node, loads its weights itself from `model_path`:
a rank of a `SHARDED_KINDS` group reads only its part (raycluster.parallel.shard.load_shard, when it
joins the group and knows its rank), a KVP rank the full model. It joins the group's store at the `GroupAddress` the leader chose, and runs `serve_rank` in one long
actor call until the leader posts None. `RayRanks.join` waits for those calls, then kills the actors.
"""

from __future__ import annotations

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster.engine.config import EngineConfig
from raycluster.parallel.group import Collective, GroupAddress, serve_rank
from raycluster.parallel.shard import Checkpoint


@ray.remote
class GroupRank:
    def __init__(self, model_path: str, config_json: str, threads: int) -> None:
        from raycluster.model.loader import load_config, load_model
        from raycluster.parallel.factory import SHARDED_KINDS, group_kind

        torch.set_num_threads(threads)
        self.config = EngineConfig.model_validate_json(config_json)
        self.dtype = self.config.torch_dtype()
        if group_kind(self.config) in SHARDED_KINDS:
            self.model = Checkpoint(model_path, load_config(model_path))   # read at `serve`, by rank
        else:
            self.model, _ = load_model(model_path, dtype=self.dtype, device=self.config.device)

    def serve(self, kind: str, addr: GroupAddress, rank: int) -> int:
        from raycluster.parallel.factory import group_worker

        coll = Collective(addr, rank, self.config.device)
        return serve_rank(coll, group_worker(kind, self.model, coll, self.config, self.dtype))


class RayRanks:
    def __init__(self, addr: GroupAddress, kind: str, config: EngineConfig, model_path: str | None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        if model_path is None:
            raise ValueError("group_launch 'ray' needs the checkpoint path for the ranks to load")
        threads = config.num_threads or torch.get_num_threads()
        # On the leader's node: the group binds to `group_host` (loopback by default), and each
        # gloo rank binds a socket there too; a group spanning nodes is not built.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.actors = [GroupRank.options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=here).remote(
            model_path, config.model_dump_json(), threads) for _ in range(1, addr.world)]
        self.calls = [a.serve.remote(kind, addr, r) for r, a in enumerate(self.actors, start=1)]

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
