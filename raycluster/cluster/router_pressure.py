"""PLA-Serve's instance-pressure controller run against the router's state: every control period
it reads each prefill instance's signals, asks `sched.pressure.decide` for a move, and applies it
with `RouterCore.move_instance`. The real cluster's router actor and the simulator both drive
this same object (`PressureLoop.step(core, now)`), so a simulated move is the move the cluster
would make.

Signals per prefill instance (`pressure_signals`), all from what the router already holds:
  q  requests waiting there (its reported waiting + handed out but not yet seen) plus its share
     of its pool's router queue;
  e  the share of the requests whose work is there that have waited past their TTFT SLO with
     no first token;
  u  its engine's busy fraction since the previous tick (`InstanceStats.busy_s`, cumulative).
With `balance_decode` (`decode_signals`, per decode instance): q counts handoffs waiting there and
its share of the router's decode queue, e the share of its requests whose pace since their first
token is behind their TPOT SLO (the router's default when they carry none), u as above. A tick
then makes at most one move: of the two candidates (between the prefill pools, `decide`; between
the prefill side and the decode pool, `sched.pressure.pd_direction`), the one whose pools'
pressures are further apart, relative to the larger of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raycluster.sched.pressure import (DECODE, LONG, PREFILL, SHORT, InstanceSignals, PoolSignals, PressureConfig,
                                       decide, instance_pressure, pd_direction, pool_pressure)

POOL_OF = {"prefill-short": SHORT, "prefill-long": LONG}
ROLE_OF = {SHORT: "prefill-short", LONG: "prefill-long"}


def pressure_signals(core, now: float) -> PoolSignals:
    """The current signals of every prefill instance; updates each one's busy mark."""
    def late(st) -> bool:               # no first token yet, past its TTFT SLO
        r = st.req
        return r.first_token_time is None and r.slo.ttft_s is not None and now - r.arrival_time > r.slo.ttft_s

    sig = PoolSignals()
    for role in POOL_OF:
        insts = [i for i in core.instances.values() if i.role == role]
        share = len(core.policies[role]) / max(1, len(insts))
        (sig.short if role == "prefill-short" else sig.long).extend(
            _instance_signals(core, inst, share, now, late) for inst in insts)
    return sig


def decode_signals(core, now: float) -> list[InstanceSignals]:
    """The current signals of every decode instance; updates each one's busy mark."""
    default_tpot = core.cfg.slo.tpot_ms / 1e3

    def behind(st) -> bool:             # its pace since the first token is slower than its TPOT SLO
        n, t1 = len(st.delivered), st.req.first_token_time
        return t1 is not None and n >= 2 and (now - t1) / (n - 1) > (st.req.slo.tpot_s or default_tpot)

    insts = [i for i in core.instances.values() if i.role == "decode"]
    share = (len(core.policies["decode"]) + len(core.front["decode"])) / max(1, len(insts))
    return [_instance_signals(core, inst, share, now, behind) for inst in insts]


def _instance_signals(core, inst, share: float, now: float, misses) -> InstanceSignals:
    """q (work waiting there, plus its share of the router's queue), e (the share of its requests
    for which `misses(state)` holds) and u of one instance."""
    s = inst.stats
    q = s.waiting + len(inst.transit) + len(inst.outbox.work) + share
    missed = sum(1 for rid in inst.running if (st := core.requests.get(rid)) is not None and misses(st))
    return InstanceSignals(inst.instance_id, float(q), missed / max(1, len(inst.running)), _utilization(inst, now))


def _utilization(inst, now: float) -> float:
    """Busy fraction of the engine since the previous tick; moves the mark to now."""
    util = 0.0
    if inst.busy_mark is not None and now > inst.busy_mark[0]:
        util = min(1.0, max(0.0, (inst.stats.busy_s - inst.busy_mark[1]) / (now - inst.busy_mark[0])))
    inst.busy_mark = (now, inst.stats.busy_s)
    return util


@dataclass
class PressureLoop:
    """The controller's state between ticks: its config, the time of its last move and a log."""
    cfg: PressureConfig
    last_move: float | None = None
    moves: list[dict] = field(default_factory=list)     # {"t", "instance", "from", "to"}

    def step(self, core, now: float) -> list[dict]:
        """One control tick: at most one move, applied to `core`; returns the moves made."""
        sig = pressure_signals(core, now)
        if not (sig.short and sig.long):
            return []
        pla = [(mv.instance_id, ROLE_OF[mv.src], ROLE_OF[mv.dst]) for mv in decide(sig, now, self.last_move, self.cfg)]
        moves = pla
        if self.cfg.balance_decode:
            dec = decode_signals(core, now)
            pd = self._pd_move(dec, sig, now)
            if pd and (not pla or self._gap(sig.short + sig.long, dec) > self._gap(sig.short, sig.long)):
                moves = pd
        made = []
        for iid, src, dst in moves:
            core.move_instance(iid, dst)
            self.last_move = now
            made.append({"t": now, "instance": iid, "from": src, "to": dst})
        self.moves.extend(made)
        del self.moves[:-64]                                  # the recent ones are what status shows
        return made

    def _gap(self, a: list[InstanceSignals], b: list[InstanceSignals]) -> float:
        """How far apart two pools' pressures are, relative to the larger one (as `decide`'s band)."""
        pa, pb = pool_pressure(a, self.cfg), pool_pressure(b, self.cfg)
        return abs(pa - pb) / max(abs(pa), abs(pb), self.cfg.floor)

    def _pd_move(self, dec: list[InstanceSignals], sig: PoolSignals, now: float) -> list[tuple[str, str, str]]:
        """One move between the prefill side and the decode pool, if `pd_direction` asks for it:
        the donor is the least-pressured instance that may leave its pool; an instance joining
        the prefill side goes to the more pressured prefill pool."""
        if not dec:
            return []
        direction = pd_direction(sig.short + sig.long, dec, now, self.last_move, self.cfg)
        key = lambda s: (instance_pressure(s, self.cfg), s.instance_id)  # noqa: E731
        pools = {SHORT: sig.short, LONG: sig.long}
        if direction == DECODE:
            cands = [(s, ROLE_OF[p]) for p, members in pools.items() if len(members) > self.cfg.min_per_pool
                     for s in members]
            if not cands:
                return []
            donor, src = min(cands, key=lambda c: key(c[0]))
            return [(donor.instance_id, src, "decode")]
        if direction == PREFILL:
            hot = max(pools, key=lambda p: (pool_pressure(pools[p], self.cfg), p == SHORT))
            return [(min(dec, key=key).instance_id, "decode", ROLE_OF[hot])]
        return []
