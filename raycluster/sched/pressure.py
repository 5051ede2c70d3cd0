"""PLA-Serve's instance-pressure controller (Alg. 2) as a pure decision function.

Owns: whether one prefill instance should move between the SHORT and LONG pools. Data enters
as `PoolSignals` (per-instance queue backlog q, SLA deviation e, utilization u for each pool),
the current time and the time of the last move; it leaves as a list of `Move`s (empty, or one).
The actor that collects signals every control period and actually re-roles instances, and
that remembers `last_move_time`, is someone else's; this function holds no state.

Per instance:  psi_k = alpha * q_k + beta * e_k - gamma * u_k     (the seed's weights and signs)
Per pool:      P = A({psi_k})                                     (robust aggregate, P90 default)
Move one instance SHORT <- LONG when P_s > P_l + tau * max(|P_s|, |P_l|, floor), and the
reverse symmetrically; never within `cooldown_s` of the last move and never below `min_per_pool`
instances in the donor pool (so a pool is never emptied when min_per_pool >= 1).
The seed writes the hysteresis as P_s > (1 + tau) P_l; the symmetric additive band above is as
strict or stricter for positive pressures and stays one-sided when pressures are <= 0 (the
-gamma*u term can make them negative, where the multiplicative test lets both directions fire).
Added here (`predictive`, on by default): a move is skipped when, projecting each pool's load
as conserved (pressure ~ load / instances), the reverse move would fire right after it; with
discrete instances a narrow tau band alone can flip one instance back and forth forever.
The donor instance is the least-pressured one of the donor pool: it has the least work to hand
off and its departure raises the donor pool's pressure the least.

Beyond the seed (`balance_decode`, off by default): the same rule between the prefill side (both
prefill pools' instances together) and the decode pool, whose instances' signals are handoffs
waiting, the share of their requests behind their TPOT SLO, and utilization. `pd_direction` says
which side should gain an instance; the caller picks the donor and the receiving prefill pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

SHORT = "short"
LONG = "long"
PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class InstanceSignals:
    instance_id: str
    queue: float            # q: backlog (queued requests or tokens, normalized as the caller likes)
    sla_deviation: float    # e: e.g. share of recent requests over their deadline, or mean lateness
    utilization: float      # u: GPU busy fraction in [0, 1]


@dataclass
class PoolSignals:
    short: list[InstanceSignals] = field(default_factory=list)
    long: list[InstanceSignals] = field(default_factory=list)


@dataclass(frozen=True)
class Move:
    instance_id: str
    src: str                # SHORT or LONG
    dst: str


def p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile."""
    v = sorted(values)
    return v[max(0, math.ceil(0.9 * len(v)) - 1)]


@dataclass(frozen=True)
class PressureConfig:
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.5
    tau: float = 0.2                    # hysteresis: relative pressure gap needed to act
    floor: float = 1e-3                 # keeps the gap meaningful when pressures are ~0
    cooldown_s: float = 30.0
    min_per_pool: int = 1
    aggregate: Callable[[Sequence[float]], float] = p90
    predictive: bool = True             # skip moves the projected state would immediately undo
    balance_decode: bool = False        # also move instances between the prefill side and decode


def instance_pressure(s: InstanceSignals, cfg: PressureConfig) -> float:
    return cfg.alpha * s.queue + cfg.beta * s.sla_deviation - cfg.gamma * s.utilization


def pool_pressure(pool: Sequence[InstanceSignals], cfg: PressureConfig) -> float:
    return cfg.aggregate([instance_pressure(s, cfg) for s in pool]) if pool else 0.0


def decide(signals: PoolSignals, now: float, last_move_time: float | None = None,
           cfg: PressureConfig = PressureConfig()) -> list[Move]:
    """At most one move per call; the caller sets last_move_time = now when it applies one."""
    if cfg.min_per_pool < 1:
        raise ValueError(f"min_per_pool must be >= 1, got {cfg.min_per_pool}")
    if last_move_time is not None and now - last_move_time < cfg.cooldown_s:
        return []
    p_s = pool_pressure(signals.short, cfg)
    p_l = pool_pressure(signals.long, cfg)
    n_s, n_l = len(signals.short), len(signals.long)
    if _over(p_s, p_l, cfg) and n_l > cfg.min_per_pool and not _undone(p_s, n_s, p_l, n_l, cfg):
        donor = min(signals.long, key=lambda s: (instance_pressure(s, cfg), s.instance_id))
        return [Move(donor.instance_id, LONG, SHORT)]
    if _over(p_l, p_s, cfg) and n_s > cfg.min_per_pool and not _undone(p_l, n_l, p_s, n_s, cfg):
        donor = min(signals.short, key=lambda s: (instance_pressure(s, cfg), s.instance_id))
        return [Move(donor.instance_id, SHORT, LONG)]
    return []


def pd_direction(prefill: Sequence[InstanceSignals], decode: Sequence[InstanceSignals], now: float,
                 last_move_time: float | None = None, cfg: PressureConfig = PressureConfig()) -> str | None:
    """DECODE when the decode pool should take an instance from the prefill side, PREFILL for the
    reverse, None to stay; the same hysteresis, cooldown, floor and projection as `decide`.
    `prefill` holds both prefill pools' instances (the donor side needs more than
    `min_per_pool` in total; the caller keeps each prefill pool at its own minimum)."""
    if last_move_time is not None and now - last_move_time < cfg.cooldown_s:
        return None
    p_p, p_d = pool_pressure(prefill, cfg), pool_pressure(decode, cfg)
    n_p, n_d = len(prefill), len(decode)
    if _over(p_d, p_p, cfg) and n_p > cfg.min_per_pool and not _undone(p_d, n_d, p_p, n_p, cfg):
        return DECODE
    if _over(p_p, p_d, cfg) and n_d > cfg.min_per_pool and not _undone(p_p, n_p, p_d, n_d, cfg):
        return PREFILL
    return None


def _over(p_hot: float, p_cold: float, cfg: PressureConfig) -> bool:
    return p_hot > p_cold + cfg.tau * max(abs(p_hot), abs(p_cold), cfg.floor)


def _undone(p_hot: float, n_hot: int, p_cold: float, n_cold: int, cfg: PressureConfig) -> bool:
    """Would the reverse move fire right after this one? Projects pressures assuming each pool's
    load is conserved (pressure ~ load / instances), which only makes sense for positive values."""
    if not cfg.predictive or p_hot <= 0 or p_cold <= 0 or n_hot == 0:
        return False
    hot_after = p_hot * n_hot / (n_hot + 1)
    cold_after = p_cold * n_cold / (n_cold - 1)
    return _over(cold_after, hot_after, cfg)
