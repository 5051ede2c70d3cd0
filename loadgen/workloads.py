"""Workloads: seeded generators of requests, shared by the load generator and the simulator.

Owns `WorkloadRequest` (one call to send: arrival, prompt length and segments, output length,
SLOs, tenant, application and DAG dependencies), `Workload` (an ordered, iterable list of them
plus the parameters that made it) and `make_workload(name, ...)`, the one entry point. Data
enters as a workload name (or a JSONL trace path) and seeded options; it leaves as a Workload
whose requests are sorted by arrival and whose dependencies always point to earlier requests.

Workloads:
- `chat`: single chat turns; lengths from `PROFILES` (lognormals fitted to published means).
- `long-mix`: `chat` plus a fraction of long prompts (Medha's mix; class "long").
- `multiturn`: sessions; turn k+1 re-sends turn k's prompt and reply plus a new message, and is
  sent `think_s` after turn k finishes (`depends_on`).
- `apps`: Justitia-style applications (DAGs of calls sharing an app_id), see apps.py.
- `tenants`: `chat` from several tenants, each its own arrival process and rate.
For session/application workloads `qps` is the rate of sessions/applications, and
`num_requests` counts calls (the last application is cut, keeping a dependency-closed prefix).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator

import numpy as np

from loadgen import arrivals
from loadgen.words import segment_ids, segment_text

WORKLOADS = ("chat", "long-mix", "multiturn", "apps", "tenants")


@dataclass(frozen=True)
class LengthDist:
    """Lognormal with a given mean and log-space sigma, rounded to ints and clipped to [lo, hi].

    mu = ln(mean) - sigma^2 / 2 makes the (unclipped) mean equal `mean`; median = exp(mu).
    """
    mean: float
    sigma: float
    lo: int = 1
    hi: int = 2047

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma ** 2 / 2

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, size)
        return np.clip(np.rint(x), self.lo, self.hi).astype(int)


@dataclass(frozen=True)
class Profile:
    prompt: LengthDist
    output: LengthDist
    source: str


# Published means; the sigmas are our choice (heavy right tails as in both papers' histograms).
PROFILES: dict[str, Profile] = {
    # ShareGPT: mean input 161.31 tokens, mean output 337.99 tokens (Kwon et al., "Efficient
    # Memory Management for LLM Serving with PagedAttention", SOSP'23, Fig. 11 / Sec. 6.1).
    # sigma 1.0 / 0.8 -> medians 98 / 245 tokens.
    "sharegpt": Profile(LengthDist(161.31, 1.0, 4, 2047), LengthDist(337.99, 0.8, 1, 2048),
                        "ShareGPT means from the vLLM paper (SOSP'23): in 161.31, out 337.99"),
    # LMSYS-Chat-1M: 69.5 tokens per prompt, 214.5 per response, 2.0 turns per conversation on
    # average (Zheng et al., "LMSYS-Chat-1M", ICLR'24, Table 1). sigma 1.0 / 0.9 -> medians 42 / 143.
    "lmsys": Profile(LengthDist(69.5, 1.0, 4, 2047), LengthDist(214.5, 0.9, 1, 2048),
                     "LMSYS-Chat-1M means (ICLR'24 Table 1): in 69.5, out 214.5"),
}


@dataclass
class WorkloadRequest:
    request_id: str
    arrival_s: float                 # offset from run start; for dependents: their app's arrival
    prompt_tokens: int
    output_tokens: int               # sent as max_tokens with ignore_eos
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    tenant: str = "default"
    app_id: str | None = None        # application / session id; None for lone requests
    app_type: str | None = None
    klass: str = "short"             # "short" | "long"
    priority: int = 0
    depends_on: tuple[str, ...] = ()  # request ids that must finish before this one is sent
    think_s: float = 0.0             # delay after the dependencies finish
    segments: tuple[tuple[int, int], ...] = ()  # (seed, n_tokens) pieces of the prompt
    prompt: str | list[int] | None = None       # explicit prompt (traces); overrides segments

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if self.prompt is not None:
            raise ValueError(f"{self.request_id}: prompt is token ids; use prompt_token_ids()")
        return "".join(segment_text(s, n) for s, n in self.segments)

    def prompt_token_ids(self, id_range: tuple[int, int] = (100, 1000)) -> list[int]:
        if isinstance(self.prompt, list):
            return list(self.prompt)
        if isinstance(self.prompt, str):
            raise ValueError(f"{self.request_id}: prompt is text; use prompt_text()")
        return [i for s, n in self.segments for i in segment_ids(s, n, id_range)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["depends_on"] = list(self.depends_on)
        d["segments"] = [list(s) for s in self.segments]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "WorkloadRequest":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown workload request fields {sorted(unknown)}")
        d = dict(d)
        d["depends_on"] = tuple(d.get("depends_on") or ())
        d["segments"] = tuple(tuple(int(v) for v in s) for s in d.get("segments") or ())
        if "prompt_tokens" not in d:
            p = d.get("prompt")
            d["prompt_tokens"] = len(p) if isinstance(p, list) else sum(n for _, n in d["segments"]) or (
                len(p.split()) if isinstance(p, str) else 0)
        return cls(**d)


@dataclass
class Workload:
    name: str
    params: dict
    requests: list[WorkloadRequest] = field(default_factory=list)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class SLOSpec:
    """How SLOs are assigned: fixed for short requests; long ones get max(ttft, ms/token * len)."""
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    long_ttft_ms_per_token: float = 1.0

    def ttft_for(self, prompt_tokens: int, klass: str) -> float:
        if klass == "long":
            return max(self.ttft_ms, self.long_ttft_ms_per_token * prompt_tokens)
        return self.ttft_ms


def parse_range(text: str) -> tuple[int, int]:
    """'2048:8192' -> (2048, 8192); also accepts 'k'/'m' suffixes ('128k:1m')."""
    def num(s: str) -> int:
        s = s.strip().lower()
        mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
        return int(float(s[:-1] if mult > 1 else s) * mult)
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(f"expected MIN:MAX, got {text!r}")
    a, b = num(lo), num(hi)
    if not 0 < a <= b:
        raise ValueError(f"need 0 < MIN <= MAX, got {text!r}")
    return a, b


def parse_tenants(text: str) -> dict[str, float]:
    """'A:4,B:2,C:1' -> {'A': 4/7, 'B': 2/7, 'C': 1/7} (shares of the total qps)."""
    pairs = [p.split(":") for p in text.split(",") if p.strip()]
    w = {k.strip(): float(v) for k, v in pairs}
    if not w or any(v <= 0 for v in w.values()):
        raise ValueError(f"tenants need positive weights, got {text!r}")
    tot = sum(w.values())
    return {k: v / tot for k, v in w.items()}


class _Builder:
    """Shared state of one generation: rng, id counter, SLO spec, class threshold."""

    def __init__(self, seed: int, slo: SLOSpec, long_threshold: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.slo = slo
        self.long_threshold = long_threshold
        self.n = 0

    def seg(self, n_tokens: int) -> tuple[int, int]:
        return (int(self.rng.integers(0, 2**31 - 1)), int(n_tokens))

    def req(self, arrival: float, segments: list[tuple[int, int]], output: int, *,
            klass: str | None = None, **kw) -> WorkloadRequest:
        prompt_tokens = sum(n for _, n in segments)
        klass = klass or ("long" if prompt_tokens >= self.long_threshold else "short")
        rid = f"r{self.n:06d}"
        self.n += 1
        return WorkloadRequest(rid, float(arrival), prompt_tokens, int(output),
                               self.slo.ttft_for(prompt_tokens, klass), self.slo.tpot_ms,
                               klass=klass, segments=tuple(segments), **kw)


def _chat(b: _Builder, times: np.ndarray, prof: Profile, tenant: str = "default") -> list[WorkloadRequest]:
    p = prof.prompt.sample(b.rng, len(times))
    o = prof.output.sample(b.rng, len(times))
    return [b.req(t, [b.seg(pi)], oi, tenant=tenant) for t, pi, oi in zip(times, p, o)]


def _long_mix(b: _Builder, times: np.ndarray, prof: Profile, frac: float,
              long_tokens: tuple[int, int]) -> list[WorkloadRequest]:
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"long fraction must be in [0, 1], got {frac}")
    is_long = b.rng.random(len(times)) < frac
    p = prof.prompt.sample(b.rng, len(times))
    o = prof.output.sample(b.rng, len(times))
    lp = b.rng.integers(long_tokens[0], long_tokens[1] + 1, len(times))  # uniform in [MIN, MAX]
    return [b.req(t, [b.seg(lpi if lg else pi)], oi, klass="long" if lg else "short")
            for t, lg, pi, lpi, oi in zip(times, is_long, p, lp, o)]


def _multiturn(b: _Builder, times: np.ndarray, prof: Profile, turns_mean: float,
               max_turns: int, think_mean_s: float, max_context: int) -> list[WorkloadRequest]:
    out: list[WorkloadRequest] = []
    for si, t in enumerate(times):
        turns = min(int(b.rng.geometric(1.0 / turns_mean)), max_turns)
        history: list[tuple[int, int]] = []
        prev: WorkloadRequest | None = None
        for k in range(turns):
            msg = int(prof.prompt.sample(b.rng, 1)[0])
            reply = int(prof.output.sample(b.rng, 1)[0])
            segs = history + [b.seg(msg)]
            if prev is not None and sum(n for _, n in segs) + reply > max_context:
                break
            r = b.req(t, segs, reply, app_id=f"s{si:05d}", app_type="session",
                      depends_on=(prev.request_id,) if prev else (),
                      think_s=float(b.rng.exponential(think_mean_s)) if prev else 0.0)
            out.append(r)
            # The next turn re-sends this prompt and a stand-in for the reply of the same length.
            history = segs + [b.seg(reply)]
            prev = r
    return out


def _cut(reqs: list[WorkloadRequest], n: int | None) -> list[WorkloadRequest]:
    """First n requests in generation order; drops any whose dependencies were cut."""
    if n is None:
        return reqs
    kept, ids = [], set()
    for r in reqs[:n]:
        if all(d in ids for d in r.depends_on):
            kept.append(r)
            ids.add(r.request_id)
    return kept


def make_workload(name: str, *, seed: int = 0, qps: float = 1.0, num_requests: int | None = None,
                  duration: float | None = None, arrival: str = "poisson", cv: float = 1.0,
                  profile: str = "sharegpt", long_fraction: float = 0.05,
                  long_tokens: tuple[int, int] = (2048, 8192), max_output_tokens: int | None = None,
                  ttft_slo_ms: float = 2000.0, tpot_slo_ms: float = 100.0,
                  long_ttft_ms_per_token: float = 1.0, tenants: dict[str, float] | str | None = None,
                  turns_mean: float = 4.0, max_turns: int = 8, think_mean_s: float = 1.0,
                  max_context: int = 8192, app_mix: dict[str, float] | None = None) -> Workload:
    """Build a workload by name (see WORKLOADS) or load a JSONL trace (a path ending .jsonl).

    For a trace, `arrival="trace"` (or the default "poisson" with qps<=0) keeps its arrival
    times; any other arrival kind re-times its applications at `qps`. num_requests/duration cut it.
    """
    params = dict(name=name, seed=seed, qps=qps, num_requests=num_requests, duration=duration,
                  arrival=arrival, cv=cv, profile=profile, long_fraction=long_fraction,
                  long_tokens=list(long_tokens), max_output_tokens=max_output_tokens,
                  ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
                  long_ttft_ms_per_token=long_ttft_ms_per_token)
    if name.endswith(".jsonl") or Path(name).is_file():
        from loadgen.trace import load_trace
        return load_trace(name, seed=seed, qps=qps, arrival=arrival, cv=cv,
                          num_requests=num_requests, duration=duration)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS} or a .jsonl trace")
    if profile not in PROFILES:
        raise ValueError(f"unknown length profile {profile!r}; choose one of {tuple(PROFILES)}")
    if num_requests is None and duration is None:
        raise ValueError("give num_requests or duration")
    prof = PROFILES[profile]
    if max_output_tokens is not None:
        prof = Profile(prof.prompt, LengthDist(prof.output.mean, prof.output.sigma, 1, max_output_tokens),
                       prof.source)
    slo = SLOSpec(ttft_slo_ms, tpot_slo_ms, long_ttft_ms_per_token)
    b = _Builder(seed, slo, long_tokens[0])
    times = lambda rate, rng=b.rng: arrivals.arrival_times(  # noqa: E731
        arrival, rng, rate, n=num_requests, duration=duration, cv=cv)

    if name == "chat":
        reqs = _chat(b, times(qps), prof)
    elif name == "long-mix":
        reqs = _long_mix(b, times(qps), prof, long_fraction, long_tokens)
    elif name == "multiturn":
        params.update(turns_mean=turns_mean, max_turns=max_turns, think_mean_s=think_mean_s,
                      max_context=max_context)
        reqs = _multiturn(b, times(qps), prof, turns_mean, max_turns, think_mean_s, max_context)
    elif name == "apps":
        from loadgen.apps import DEFAULT_MIX, make_apps
        mix = app_mix or DEFAULT_MIX
        params.update(app_mix=mix)
        reqs = make_apps(b, times(qps), prof, mix)
    else:  # tenants
        shares = parse_tenants(tenants) if isinstance(tenants, str) else (tenants or parse_tenants("A:4,B:2,C:1"))
        params.update(tenants=shares)
        reqs = []
        for i, (tenant, share) in enumerate(shares.items()):
            rng = np.random.default_rng([seed, i + 1])  # each tenant its own stream
            reqs += _chat(b, times(qps * share, rng), prof, tenant=tenant)
    # Stable sort by arrival keeps dependents after their dependencies (same arrival, later id).
    reqs.sort(key=lambda r: r.arrival_s)
    reqs = _cut(reqs, num_requests)
    return Workload(name, params, reqs)
