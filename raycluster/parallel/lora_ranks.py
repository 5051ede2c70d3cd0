"""LoRA adapters on a KVP / SPP / TP group: each rank holds its own shard of every adapter.

The engine's `LoRASet` on the leader keeps the names (what requests may use, what is being
unloaded, the prefix-cache roots); whenever it gains an adapter or finally drops one it calls
the runner's `change_lora`, which posts a `LoRAChange` down the group's plan chain (before any
step that uses it) and applies it to the leader's own rank. Each rank (`RankAdapters`) reads the
PEFT directory itself and keeps its part (`shard.shard_adapter`: B by its output rows on the
column-parallel projections, A by its input columns on the row-parallel ones, only its layers on
an SPP stage), and builds each step's `StepLoRA` from the plan's `lora_runs`, rows as its model
sees them (an SPP micro-batch's own rows: `spp.split_plan` cuts the runs with the tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from raycluster.model.config import ModelConfig
from raycluster.model.lora import LoRASet, StackedStepLoRA, StepLoRA, load_adapter
from raycluster.parallel.plan import StepPlan
from raycluster.parallel.shard import shard_adapter

log = logging.getLogger(__name__)


@dataclass
class LoRAChange:
    """Leader -> ranks, on the plan chain: serve the adapter at `path` as `name`, or with `path`
    None drop it."""
    name: str
    path: str | None


class RankAdapters:
    """One rank's shards of the group's adapters. `config`: the whole model's; `lane` / `tp`:
    its place in its TP group (lane 0 of 1 without TP); `layers`: an SPP stage's layer range."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, lane: int = 0, tp: int = 1,
                 layers: range | None = None) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.lane, self.tp, self.layers = lane, tp, layers
        self.set = LoRASet()

    def apply(self, msg: LoRAChange) -> None:
        """Load or drop one adapter. The leader read the same directory before posting this, so
        a failure here is this node's (the path missing on it): logged, and a step using the
        adapter then fails (`for_step`) rather than run without it."""
        self.set.adapters.pop(msg.name, None)
        if msg.path is None:
            return
        try:
            full = load_adapter(msg.path, self.config, msg.name, self.dtype)
        except Exception:
            log.exception("LoRA adapter %r: rank (lane %d) could not load %s", msg.name, self.lane, msg.path)
            return
        part = shard_adapter(full, self.lane, self.tp, self.config.num_key_value_heads, self.layers)
        part.weights = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in part.weights.items()}
        self.set.add(part)

    def for_step(self, plan: StepPlan) -> StepLoRA | StackedStepLoRA | None:
        if not plan.lora_runs:
            return None
        missing = {name for name, _, _ in plan.lora_runs} - self.set.adapters.keys()
        if missing:
            raise RuntimeError(f"LoRA adapters {sorted(missing)} are not loaded on this rank (lane {self.lane})")
        return self.set.for_step(plan.lora_runs, plan.num_tokens, self.device)
