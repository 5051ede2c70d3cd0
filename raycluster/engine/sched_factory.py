"""Builds an engine's scheduler from its config: policy by name, packer, decode selector and the
batch-time predictor they share (profiled once per machine, or loaded from a file).

`build_scheduling` makes the pieces; `build_scheduler` wraps them in a `Scheduler` at start, and
when the instance moves to another pool `RetiredScheduling.switch` hands `Scheduler.reconfigure`
a set built the same way, or the set it used when it last served a pool scheduled like that."""

from __future__ import annotations

from dataclasses import dataclass

from raycluster.engine.config import EngineConfig
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import Scheduler, SchedulerConfig
from raycluster.sched.awd_packer import AWDPacker
from raycluster.sched.base import AllDecodes, Clock, DecodeSelector, Packer, Policy, PolicyContext, SLOConfig
from raycluster.sched.kairos_decode import KairosDecodeSelector, StepTimeLUT
from raycluster.sched.medha_packer import MedhaPacker
from raycluster.sched.predictor import LinearBatchPredictor
from raycluster.sched.registry import make_policy
from raycluster.sched.token_packer import TokenBudgetPacker


def needs_predictor(config: EngineConfig) -> bool:
    return config.packer == "medha" or config.decode_selector == "kairos" or config.policy != "fcfs"


@dataclass
class SchedulingParts:
    """What a config's scheduling fields turn into: limits, policy, packer, decode selector."""
    config: SchedulerConfig
    policy: Policy
    packer: Packer
    decode_selector: DecodeSelector


def build_scheduling(config: EngineConfig, clock: Clock, max_model_len: int,
                     predictor: LinearBatchPredictor | None) -> SchedulingParts:
    slo = SLOConfig(ttft_ms=config.ttft_ms, tpot_ms=config.tpot_ms, ttft_scale=config.ttft_scale)
    ctx = PolicyContext(clock=clock, predictor=predictor, slo=slo, num_slots=config.max_num_seqs)
    policy = make_policy(config.policy, ctx)
    if config.packer == "medha":
        if predictor is None:
            raise ValueError("packer: 'medha' needs a batch-time predictor (predictor must not be 'none')")
        packer = MedhaPacker(predictor, clock, slo, long_threshold=config.long_threshold,
                             min_chunk=config.min_chunk)
    elif config.packer == "awd":
        packer = AWDPacker(clock, slo, chunk_size=config.chunk_size)
    else:
        packer = TokenBudgetPacker(config.chunk_size)
    if config.decode_selector == "kairos":
        if predictor is None:
            raise ValueError("decode_selector: 'kairos' needs a batch-time predictor")
        selector = KairosDecodeSelector(StepTimeLUT.from_predictor(predictor, config.max_num_seqs, max_model_len), slo)
    else:
        selector = AllDecodes()
    spec = config.num_speculative_tokens if config.speculative_method != "none" else 0
    return SchedulingParts(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_model_len, spec,
                                           config.max_num_encoder_tokens or config.max_num_batched_tokens),
                           policy, packer, selector)


def build_scheduler(config: EngineConfig, kv: KVCacheManager, clock: Clock, max_model_len: int,
                    predictor: LinearBatchPredictor | None) -> Scheduler:
    p = build_scheduling(config, clock, max_model_len, predictor)
    return Scheduler(p.config, kv, p.policy, p.packer, clock, p.decode_selector)


class RetiredScheduling:
    """The scheduling pieces an instance left behind when it moved, one set per scheduling config
    (a handful of pools), taken up again if it returns: what they learned online there (Kairos'
    step-time LUT, AWD's service-time estimates) is not lost to a move and back, as the pressure
    controller makes between the prefill pools. A kept set holds no request: `reconfigure`
    drains the policy and packer it replaces."""

    def __init__(self) -> None:
        self._sets: list[tuple[EngineConfig, SchedulingParts]] = []

    def __len__(self) -> int:
        return len(self._sets)

    def switch(self, scheduler: Scheduler, old: EngineConfig, new: EngineConfig, clock: Clock, max_model_len: int,
               predictor: LinearBatchPredictor | None) -> None:
        """`scheduler` (scheduling as `old`) schedules as `new` from now on."""
        back = next((p for c, p in self._sets if c == new), None)
        self._sets = [(c, p) for c, p in self._sets if c not in (new, old)]
        s = scheduler
        self._sets.append((old, SchedulingParts(s.config, s.policy, s.packer, s.decode_selector)))
        parts = back or build_scheduling(new, clock, max_model_len, predictor)
        s.reconfigure(parts.config, parts.policy, parts.packer, parts.decode_selector)
