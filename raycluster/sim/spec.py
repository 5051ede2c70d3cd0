"""Cluster spec of a simulated run (pydantic: validated once, errors name the field).

A spec says what hardware and model the step times come from, the scheduling policy, the SLO
defaults, and the pools. Example (sims/medha-16xa100.yaml):

    gpu: a100                 # a100 | h100 | h200 (RooflinePredictor) | cpu (CPU-profiled predictor)
    model: llama-3-8b         # llama-3-8b | llama-3-70b | mixtral-8x7b | qwen3-30b-a3b | a checkpoint directory (gpu: cpu)
    policy: lars
    slo: {ttft_ms: 2000, tpot_ms: 100, ttft_scale: 5}
    pools:
      - {role: mixed, instances: 1, tp: 8, spp: 2, kvp: 1}

Every other field has a default. `engine` holds EngineConfig overrides for every instance (a
pool's own `engine` wins), `router` RouterConfig overrides, `controller` turns on the PLA
pressure controller. KV capacity per instance: `kv_cache_tokens` if given, else
(GPU memory x GPUs x gpu_memory_utilization - weights) / KV bytes per token (gpu: cpu: the
engine's kv_cache_tokens).

Quantization (`quantization`: none | w4a16 | w8a16 | w8a8 | fp8, the checkpoint's weight format as
vLLM serves it) shrinks the decoder layers' weights in the roofline's step times and in the memory
model above, so a quantized model holds more KV (or fits where the bf16 one does not); w8a8 and fp8
also run its GEMMs on the GPU's int8 / fp8 tensor cores (raycluster/sched/roofline.py). gpu: cpu
takes none only: profile a quantized checkpoint by pointing `model` at it.

Serving-path overheads (all default 0, the idealised cluster): `dispatch_latency_s` (once per
request), `step_overhead_s` (per step) and `step_overhead_per_seq_s` (per request in a step); sims/local-cpu.yaml documents how they are measured on
the real local cluster (`python -m raycluster.sim.sim_to_real`).

Step-time variability (`step_noise`, off when absent: step times are then the predictor's,
deterministic): every step's predicted time (overheads included) is multiplied by a factor
drawn from the empirical distribution `quantiles` (its inverse CDF at evenly spaced
probabilities), correlated in virtual time over `corr_time_s`; seeded, so a run stays a pure
function of spec, workload and seed. `dispatch_noise` (off when absent) draws each request's
dispatch latency from an empirical distribution instead. raycluster/sim/step_noise.py draws and
fits both.

Images (`vision`: the encoder's shape; requests with `--images K`): raycluster/sim/images.py.

Speculative decoding: a pool whose `engine` turns it on (`speculative_method: ngram`, or
`draft_model` / `eagle` with any `speculative_model` name: nothing is loaded; `num_speculative_tokens` k)
drafts, and `spec_decode` (required then) says how its drafts fare: `acceptance` per draft token,
`draft_cost` per draft pass (raycluster/sim/spec_decode.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from raycluster.cluster.config import ControllerConfig
from raycluster.engine.config import EngineConfig
from raycluster.sched.registry import policy_names

Role = Literal["mixed", "prefill-short", "prefill-long", "decode"]
# raycluster.sched.roofline.QUANTIZATIONS' names (tests/unit/test_sim_quant.py keeps them equal).
Quant = Literal["none", "w4a16", "w8a16", "w8a8", "fp8"]


class SimSLO(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(100.0, gt=0)
    ttft_scale: float = Field(5.0, gt=0)


class SimPool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    instances: int = Field(1, ge=0)
    tp: int = Field(1, ge=1)
    spp: int = Field(1, ge=1)
    kvp: int = Field(1, ge=1)
    engine: dict = Field(default_factory=dict, description="EngineConfig overrides for this pool")

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.spp * self.kvp


def _inverse_cdf_error(q: list[float], positive: bool) -> str | None:
    if not all(math.isfinite(x) and (x > 0 if positive else x >= 0) for x in q):
        return f"every value must be finite and {'> 0' if positive else '>= 0'}"
    if any(b < a for a, b in zip(q, q[1:])):
        return "must be nondecreasing (an inverse CDF)"
    return None


class SimStepNoise(BaseModel):
    """Per-instance step-time multiplier m(t) = Q(Phi(z(t))): z is a stationary Ornstein-Uhlenbeck
    process in virtual time (unit variance, correlation exp(-dt / corr_time_s); corr_time_s 0: a
    fresh draw every step), Q the multiplier's inverse CDF through `quantiles`."""
    model_config = ConfigDict(extra="forbid")
    quantiles: list[float] = Field(..., min_length=2, description="the multiplier at probabilities 0, 1/(n-1), "
                                   "..., 1 (linear in between); positive, nondecreasing")
    corr_time_s: float = Field(0.0, ge=0, description="correlation time of the multiplier in virtual seconds")
    seed: int = Field(0, ge=0, description="with the instance id, seeds each instance's draws")

    @model_validator(mode="after")
    def _check(self) -> "SimStepNoise":
        if (err := _inverse_cdf_error(self.quantiles, positive=True)) is not None:
            raise ValueError(f"step_noise.quantiles: {err}")
        if not math.isfinite(self.corr_time_s):
            raise ValueError("step_noise.corr_time_s: must be finite")
        return self


class SimDispatchNoise(BaseModel):
    """Each request's dispatch latency drawn (independently, in workload order) from `quantiles`
    instead of the constant dispatch_latency_s."""
    model_config = ConfigDict(extra="forbid")
    quantiles: list[float] = Field(..., min_length=2, description="seconds at probabilities 0, 1/(n-1), ..., 1 "
                                   "(linear in between); >= 0, nondecreasing")
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "SimDispatchNoise":
        if (err := _inverse_cdf_error(self.quantiles, positive=False)) is not None:
            raise ValueError(f"dispatch_noise.quantiles: {err}")
        return self


class SimSpecDecode(BaseModel):
    """How drafts fare on the pools that draft (the simulator has no tokens to compare)."""
    model_config = ConfigDict(extra="forbid")
    acceptance: float = Field(..., ge=0, le=1, description="probability that each draft token is accepted, "
                              "independently, until the first rejection")
    draft_cost: float = Field(0.0, ge=0, description="one draft pass, as a fraction of the target's decode step "
                              "over the same requests (0: n-gram lookup)")
    seed: int = Field(0, ge=0, description="with the instance id, seeds each instance's acceptance draws")


class SimSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu: Literal["a100", "h100", "h200", "cpu"] = "a100"
    model: str = "llama-3-8b"
    policy: str = "lars"
    slo: SimSLO = Field(default_factory=SimSLO)
    pools: list[SimPool] = Field(default_factory=lambda: [SimPool(role="mixed")])
    engine: dict = Field(default_factory=dict, description="EngineConfig overrides for every instance")
    router: dict = Field(default_factory=dict, description="RouterConfig overrides (max_queue, max_local_waiting, ...)")
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    # Step-time model.
    mfu: float = Field(0.5, gt=0, le=1)
    mbu: float = Field(0.8, gt=0, le=1)
    quantization: Quant = Field("none", description="the model's weight format, as vLLM serves it (the roofline "
                                "gpus only): none: bf16 weights; w4a16: int4 weights in groups of 128 with a bf16 "
                                "scale each (GPTQ / AWQ / compressed-tensors), bf16 activations and GEMMs; w8a16: "
                                "int8 weights, per-channel scales, bf16 activations and GEMMs; w8a8: int8 weights "
                                "and activations, GEMMs on the int8 tensor cores (2x bf16 on A100 / H100 / H200); "
                                "fp8: fp8 weights and activations, GEMMs on the fp8 tensor cores (2x bf16 on H100 / "
                                "H200; A100 has none: weight-only fp8 at bf16 speed, as vLLM's Marlin fallback). "
                                "Embedding, lm_head and the KV cache stay bf16")
    step_overhead_s: float = Field(0.0, ge=0, description="added to every step (launch gaps, scheduler); gpu: cpu: "
                                   "added to the profiled predictor's overhead_s (engine work outside the model "
                                   "forward, measured on the real cluster by sim_to_real's calibration)")
    step_overhead_per_seq_s: float = Field(0.0, ge=0, description="gpu: cpu: added per request in a step (each "
                                           "decode sequence and each prefill chunk): the engine's per-request "
                                           "work outside the model forward (sampling, bookkeeping, token events)")
    dispatch_latency_s: float = Field(0.0, ge=0, description="fixed per-request latency of the serving path outside "
                                      "the engine (HTTP/SSE client, gateway, router messaging): a request reaches "
                                      "the router this long after it is sent; counts once in TTFT and E2E")
    step_noise: SimStepNoise | None = Field(None, description="step-time variability (None: deterministic steps); "
                                            "decode runs are off with it (every step draws its own factor)")
    dispatch_noise: SimDispatchNoise | None = Field(None, description="per-request dispatch latency distribution "
                                                    "(None: dispatch_latency_s for every request, which must be 0 "
                                                    "with it)")
    spec_decode: SimSpecDecode | None = Field(None, description="how drafts fare on pools whose engine drafts "
                                              "(speculative_method); required when one does")
    predictor: str | dict | None = Field(None, description="gpu: cpu: LinearBatchPredictor JSON file, inline "
                                         "coefficients, or None/'auto' to profile the model here")
    # Memory and transfers.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_tokens: int | None = Field(None, ge=16, description="per instance; overrides the memory model")
    max_model_len: int = Field(2 * 1024 * 1024, ge=2)
    transfer_bw_gbs: float | None = Field(None, gt=0, description="KV handoff GB/s per instance pair "
                                          "(default: inter-node bandwidth per GPU x GPUs of the smaller side)")
    transfer_latency_s: float = Field(1e-3, ge=0)
    coalesce_decode: bool = Field(True, description="run decode-only stretches as one event (see sim/instance.py)")
    max_run_steps: int = Field(1 << 20, ge=2, description="cap on the steps of one decode run")
    kv_bytes_per_token: float | None = Field(None, gt=0, description="gpu: cpu or custom models")
    vision: Literal["clip-vit-l-336", "siglip-so400m-896"] | None = Field(
        None, description="the image encoder before the text model (raycluster/sched/vision_cost.py: LLaVA-1.5's "
        "CLIP ViT-L/336, 576 tokens an image; Gemma 3's SigLIP-so400m/896, 256): what requests with --images "
        "cost; roofline gpus only")

    @model_validator(mode="after")
    def _check(self) -> "SimSpec":
        if self.policy not in policy_names():
            raise ValueError(f"policy: unknown {self.policy!r}; choose one of {', '.join(policy_names())}")
        if self.dispatch_noise is not None and self.dispatch_latency_s:
            raise ValueError("dispatch_noise: replaces dispatch_latency_s, which must then be 0")
        roles = {p.role for p in self.pools if p.instances > 0}
        if not roles:
            raise ValueError("pools: at least one pool needs instances")
        prefill = roles & {"prefill-short", "prefill-long"}
        if prefill and "decode" not in roles:
            raise ValueError("pools: prefill pools need a decode pool to hand their KV to")
        if "decode" in roles and not prefill:
            raise ValueError("pools: a decode pool needs a prefill pool in front of it")
        if self.gpu == "cpu" and self.quantization != "none":
            raise ValueError(f"quantization: {self.quantization!r} needs a roofline gpu (a100, h100, h200); gpu: "
                             "cpu times steps with the profile of the real engine, so profile a quantized "
                             "checkpoint by pointing model at it and leave quantization none")
        if self.gpu == "cpu" and self.vision is not None:
            raise ValueError("vision: images are timed by the roofline (gpu a100, h100 or h200); gpu: cpu has no "
                             "profile of an image encoder")
        if self.gpu != "cpu":
            from raycluster.sched.roofline import MODELS
            if self.model not in MODELS:
                raise ValueError(f"model: {self.model!r} has no analytic shape; choose one of "
                                 f"{', '.join(MODELS)} (or gpu: cpu with a checkpoint directory)")
        for p in self.pools:
            # The CPU engine (profiled for the pool's predictor) builds what EngineConfig allows:
            # every combination of kvp, spp and tp.
            ecfg = self.engine_config(p)
            if ecfg.speculative_method != "none" and self.spec_decode is None:
                raise ValueError(f"spec_decode: the {p.role} pool drafts (speculative_method "
                                 f"{ecfg.speculative_method!r}); give spec_decode.acceptance")
            if ecfg.lora_modules:
                raise ValueError(f"engine.lora_modules ({p.role} pool): the simulator does not model LoRA "
                                 "adapters; leave it empty")
        return self

    def engine_config(self, pool: SimPool) -> EngineConfig:
        cfg = {"model": self.model if self.gpu == "cpu" else "tiny", "policy": self.policy,
               "ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "ttft_scale": self.slo.ttft_scale,
               "predictor": "none", **self.engine, **pool.engine}
        return EngineConfig(**cfg)

    @property
    def num_gpus(self) -> int:
        return sum(p.instances * p.gpus_per_instance for p in self.pools)


def load_spec(path: str | Path | dict) -> SimSpec:
    if isinstance(path, dict):
        return SimSpec(**path)
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster spec is a YAML mapping")
    return SimSpec(**data)
