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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raycluster.sched.pressure import LONG, SHORT, InstanceSignals, PoolSignals, PressureConfig, decide

POOL_OF = {"prefill-short": SHORT, "prefill-long": LONG}
ROLE_OF = {SHORT: "prefill-short", LONG: "prefill-long"}


def pressure_signals(core, now: float) -> PoolSignals:
    """The current signals of every prefill instance; updates each one's busy mark."""
    sig = PoolSignals()
    members = {role: [i for i in core.instances.values() if i.role == role] for role in POOL_OF}
    for role, insts in members.items():
        share = len(core.policies[role]) / max(1, len(insts))
        for inst in insts:
            s = inst.stats
            q = s.waiting + len(inst.transit) + len(inst.outbox.work) + share
            late = 0
            for rid in inst.running:
                st = core.requests.get(rid)
                r = st.req if st is not None else None
                if (r is not None and r.first_token_time is None and r.slo.ttft_s is not None
                        and now - r.arrival_time > r.slo.ttft_s):
                    late += 1
            e = late / max(1, len(inst.running))
            util = 0.0
            if inst.busy_mark is not None and now > inst.busy_mark[0]:
                util = min(1.0, max(0.0, (s.busy_s - inst.busy_mark[1]) / (now - inst.busy_mark[0])))
            inst.busy_mark = (now, s.busy_s)
            (sig.short if role == "prefill-short" else sig.long).append(
                InstanceSignals(inst.instance_id, float(q), e, util))
    return sig


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
        made = []
        for mv in decide(sig, now, self.last_move, self.cfg):
            core.move_instance(mv.instance_id, ROLE_OF[mv.dst])
            self.last_move = now
            made.append({"t": now, "instance": mv.instance_id, "from": ROLE_OF[mv.src], "to": ROLE_OF[mv.dst]})
        self.moves.extend(made)
        del self.moves[:-64]                                  # the recent ones are what status shows
        return made
