"""User-facing cluster configuration: what a Serve config YAML's `args` hold (pydantic, errors
name the field). Pools are engine deployments by role; `engine` overrides apply to every
instance, a pool's own `engine` overrides win over those."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from raycluster.engine.config import EngineConfig
from raycluster.model.registry import default_model_name
from raycluster.parallel.group import is_loopback
from raycluster.sched.pressure import PressureConfig
from raycluster.sched.registry import policy_names
from raycluster.server.reasoning import REASONING_PARSERS
from raycluster.server.tool_parsers import TOOL_PARSERS

Role = Literal["mixed", "prefill-short", "prefill-long", "decode"]


class PoolAutoscaling(BaseModel):
    """Serve autoscales the pool between `min_instances` and `max_instances` on the router's load
    signal (raycluster.cluster.autoscale): requests queued in the router for the pool plus those
    on its instances, `target_per_instance` of them per instance, and for a prefill or mixed pool
    optionally prompt tokens still to prefill, `target_tokens_per_instance` per instance (the
    larger of the two sizes wins). The pool's `instances` is the count it starts with; with
    `min_instances: 0` it may have none, and its requests wait in the router until one starts."""
    model_config = ConfigDict(extra="forbid")
    min_instances: int = Field(1, ge=0, description="0: the pool scales to zero when idle (mixed and prefill "
                               "pools); a request for it then waits in the router's queue while one starts")
    max_instances: int = Field(..., ge=1)
    target_per_instance: float | None = Field(4.0, gt=0, description="requests (queued for the pool in the "
                                              "router, or on an instance) per instance the pool is sized for; "
                                              "null: size by target_tokens_per_instance alone")
    target_tokens_per_instance: float | None = Field(
        None, gt=0, description="prefill and mixed pools: prompt tokens still to prefill (queued for the pool in "
        "the router, or handed to an instance and not computed yet) per instance the pool is sized for")
    upscale_delay_s: float = Field(5.0, ge=0, description="a larger size must be wanted this long "
                                   "(not from zero: Serve starts the first instance at once)")
    downscale_delay_s: float = Field(60.0, ge=0, description="a smaller size must be wanted this long")
    downscale_to_zero_delay_s: float | None = Field(None, ge=0, description="with min_instances 0: zero "
                                                    "instances must be wanted this long (default: downscale_delay_s)")
    metrics_interval_s: float = Field(2.0, gt=0, description="how often each replica pushes its load "
                                      "to Serve's controller (Serve's own default is 10 s); also how often "
                                      "the policy asks the router while the pool has no running instance")
    look_back_period_s: float = Field(10.0, gt=0, description="the window Serve averages the load over")

    def problems(self, where: str, instances: int, role: str = "mixed") -> list[str]:
        """What is inconsistent in these bounds for a pool of `role` starting with `instances`,
        each naming its field under `where` (e.g. "pools[1].autoscaling")."""
        out = []
        if self.max_instances < self.min_instances:
            out.append(f"{where}.max_instances: {self.max_instances} is below min_instances ({self.min_instances})")
        elif not self.min_instances <= instances <= self.max_instances:
            out.append(f"{where[:-len('.autoscaling')]}.instances: the pool starts with {instances} instance(s), "
                       f"outside its autoscaling bounds [{self.min_instances}, {self.max_instances}]")
        if self.look_back_period_s <= self.metrics_interval_s:
            out.append(f"{where}.look_back_period_s: {self.look_back_period_s} must exceed metrics_interval_s "
                       f"({self.metrics_interval_s}), the window has to hold more than one report")
        if self.target_per_instance is None and self.target_tokens_per_instance is None:
            out.append(f"{where}.target_per_instance: null needs target_tokens_per_instance, or nothing sizes the pool")
        if role == "decode" and self.target_tokens_per_instance is not None:
            out.append(f"{where}.target_tokens_per_instance: a decode pool computes no prompts (its load is the "
                       "handoffs it decodes); size it by target_per_instance")
        if role == "decode" and self.min_instances == 0:
            # With no decode instance the router has prefill instances decode themselves, so a
            # decode pool at zero would never see the queue that should scale it up.
            out.append(f"{where}.min_instances: a decode pool cannot scale to zero (the prefill pools would "
                       "decode in its place and it would never be asked for again); use 1 or more")
        if self.downscale_to_zero_delay_s is not None and self.min_instances > 0:
            out.append(f"{where}.downscale_to_zero_delay_s: only for a pool that scales to zero (min_instances 0)")
        return out

    def serve_config(self, initial: int, role: str, router_name: str, namespace: str) -> dict:
        """Serve's `autoscaling_config` for pool `role`'s deployment (it starts with `initial`):
        the policy class gets the targets, and the router to probe while the pool has no replica."""
        from raycluster.cluster.autoscale import POLICY

        kwargs = {"target_requests": self.target_per_instance, "target_tokens": self.target_tokens_per_instance,
                  "role": role, "router_name": router_name, "namespace": namespace,
                  "probe_interval_s": self.metrics_interval_s}
        # target_ongoing_requests: Serve requires one; the policy reads its own targets.
        out = {"min_replicas": self.min_instances, "max_replicas": self.max_instances,
               "initial_replicas": initial, "target_ongoing_requests": self.target_per_instance or 1.0,
               "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
               "metrics_interval_s": self.metrics_interval_s, "look_back_period_s": self.look_back_period_s,
               "policy": {"policy_function": POLICY, "policy_kwargs": kwargs}}
        if self.downscale_to_zero_delay_s is not None:
            out["downscale_to_zero_delay_s"] = self.downscale_to_zero_delay_s
        return out


class PoolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    instances: int = Field(1, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray gives each instance (and each Ray-actor rank of "
                            "its KVP / SPP / TP group); with GPUs the engine's device defaults to cuda")
    engine: dict = Field(default_factory=dict, description="EngineConfig overrides for this pool")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="for a pool whose instances lead a group of Ray-actor ranks (engine "
        "group_launch: ray): each replica reserves one placement-group bundle per rank (num_cpus, num_gpus "
        "each) with this strategy; STRICT_PACK keeps a group on one node, the others let it span nodes "
        "(Medha's SPP stages on different nodes), which needs engine group_host: node")
    autoscaling: PoolAutoscaling | None = Field(
        None, description="None: the pool keeps `instances`; set: Serve's autoscaler sizes it between "
        "min_instances and max_instances on the router's load signal, starting at `instances`")


class ControllerConfig(BaseModel):
    """PLA-Serve's instance-pressure controller (`sched.pressure.decide`), run by the router every
    `period_s`: moves one prefill instance at a time between the short and long pools, and with
    `decode` also between the prefill side and the decode pool (`sched.pressure.pd_direction`)."""
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    period_s: float = Field(5.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0)
    tau: float = Field(0.2, ge=0)
    min_per_pool: int = Field(1, ge=1)
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.5
    decode: bool = Field(False, description="also move instances between the prefill pools and the decode pool")

    def pressure(self) -> PressureConfig | None:
        """The decision function's config, None when the controller is off."""
        if not self.enabled:
            return None
        return PressureConfig(alpha=self.alpha, beta=self.beta, gamma=self.gamma, tau=self.tau,
                              cooldown_s=self.cooldown_s, min_per_pool=self.min_per_pool,
                              balance_decode=self.decode)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"
    served_model_name: list[str] | None = Field(
        None, description="names the API answers to (vLLM's --served-model-name); responses give the "
        "request's, else the first. Default: 'tiny', or the checkpoint directory's name")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto", description="vLLM's --generation-config: 'auto' applies the default sampling parameters of "
        "the checkpoint's generation_config.json to fields a request leaves out; 'vllm' uses the API's own")
    log_requests: bool = Field(False, description="vLLM's --enable-log-requests: each gateway replica logs a "
                               "line per request received (sampling parameters, not the prompt) and per choice "
                               "ended (reason, tokens, TTFT, latency); the Ray dashboard shows the replica's log")
    allow_runtime_lora_updating: bool | None = Field(
        None, description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (every instance loads or "
        "drops the adapter); default: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING in the gateway's environment")
    lora_resolver_dir: str | None = Field(
        None, description="vLLM's filesystem LoRA resolver: a request naming an unknown model is served from "
        "the adapter in this directory's subdirectory of that name, loaded on every instance first (needs "
        "runtime LoRA updating); default: VLLM_LORA_RESOLVER_CACHE_DIR in the gateway's environment")
    lora_resolver_max_loaded: int | None = Field(
        None, ge=1, description="keep at most this many adapters the resolver loaded: before one more, the one "
        "requests named least recently (as each gateway replica saw them) is unloaded; none: keep all")
    policy: str = "lars"
    connector: Literal["object_store", "nixl", "torch_dist"] = "object_store"
    connector_host: str = Field("127.0.0.1", description="address torch_dist binds its store and "
                                "gloo pairs to: loopback on one machine, 'node' for the Ray node's IP")
    on_transfer_failure: Literal["recompute", "fail"] = "recompute"
    transfer_timeout_s: float = Field(10.0, gt=0)
    kv_lease_s: float = Field(30.0, gt=0)
    max_queue: int = Field(256, ge=1, description="requests waiting in the router before 429")
    max_stored_responses: int = Field(1000, ge=0, description="Responses API: responses the router keeps for GET "
                                      "and previous_response_id (the least recently used dropped past it; lost "
                                      "when the router restarts); 0: store none")
    drain_s: float = Field(15.0, ge=0, description="an engine replica Serve stops (scale-down, redeploy) first "
                           "takes no new work and finishes its running requests for up to this long; what is "
                           "left then resumes elsewhere (0: at once)")
    deploy_grace_s: float = Field(600.0, ge=0, description="after a deploy (or redeploy), how long its pools "
                                  "count as present while their instances (re)start: a request arriving "
                                  "when none is up waits in its queue instead of a 503")
    max_local_waiting: int = Field(8, ge=1, description="requests an instance may hold that have not started; "
                                   "small keeps the global order, large ramps bursts up faster")
    initial_l_m: int = Field(2048, ge=1, description="short/long prompt boundary until refitted")
    prefix_affinity: bool = Field(True, description="with prefix-caching instances, send a prompt where its "
                                                    "prefix probably is unless that instance is busier by more")
    decode_affinity_slack: int = Field(4, ge=0, description="with prefix affinity, a handoff goes to the decode "
                                       "instance holding its prompt's prefix unless that one decodes more than "
                                       "this many sequences beyond the least loaded")
    threads_per_instance: int = Field(1, ge=1)
    log_stats_interval_s: float = Field(10.0, ge=0, description="each instance logs a line of throughput, "
                                        "requests and KV usage this often while busy (0: never, as vLLM's "
                                        "--disable-log-stats)")
    engine: dict = Field(default_factory=dict, description="EngineConfig overrides for every instance")
    pools: list[PoolSpec] = Field(default_factory=lambda: [PoolSpec(role="mixed")])
    gateway_replicas: int = Field(1, ge=1)
    tool_call_parser: str | None = Field(
        None, description="the model's own tool-call syntax, which tool_choice 'auto' needs (vLLM's "
        "--tool-call-parser); none: 'auto' is refused")
    chat_template: str | None = Field(
        None, description="vLLM's --chat-template: a Jinja chat template (its text, or a file path on every "
        "node) instead of the checkpoint's")
    reasoning_parser: str | None = Field(
        None, description="vLLM's --reasoning-parser: chat replies carry the model's thinking as "
        "reasoning_content (deepseek_r1: the template opens <think>; qwen3: the reply opens it)")
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None, description="vLLM's --limit-mm-per-prompt: the most images and videos a request may carry, "
        "{image: N, video: M} (defaults 16 and 2; 0 refuses them)")
    enable_mm_embeds: bool = Field(
        False, description="vLLM's --enable-mm-embeds: chat messages may give images as precomputed embeddings "
        "(image_embeds parts; only for trusted clients)")
    allowed_local_media_path: str | None = Field(
        None, description="vLLM's --allowed-local-media-path: file: image URLs may read files under this directory "
        "(on every gateway's node; default: refused)")
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    router_name: str = "raycluster-router"
    namespace: str = "raycluster"

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in policy_names():
            raise ValueError(f"unknown policy {v!r}; choose one of {', '.join(policy_names())}")
        return v

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _image_limit(cls, v):
        from raycluster.server.images import image_limit

        image_limit(v)          # raises naming what is wrong
        return v

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None:
            if not v or any(not isinstance(n, str) or not n.strip() for n in v):
                raise ValueError("give one or more non-empty names")
            if len(set(v)) != len(v):
                raise ValueError(f"names repeat: {v}")
        return v

    def served_names(self) -> list[str]:
        return self.served_model_name or [default_model_name(self.model)]

    def lora_modules(self) -> dict[str, str]:
        """The LoRA adapters every instance starts with, name -> path (`_topology` checks the
        pools agree)."""
        from raycluster.model.lora import parse_modules
        return parse_modules(self.engine_config(self.pools[0]).lora_modules) if self.pools else {}

    def lora_names(self) -> list[str]:
        return list(self.lora_modules())

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, v: str | None) -> str | None:
        # Inline text is compiled here; a file path may exist only on the cluster's nodes (a path
        # compiles as plain text, so it passes).
        if v is not None:
            from jinja2 import TemplateSyntaxError

            from raycluster.model.chat_template import compile_chat_template
            try:
                compile_chat_template(v)
            except TemplateSyntaxError as e:
                raise ValueError(f"does not parse as a Jinja template: {e}") from None
        return v

    @field_validator("reasoning_parser", "tool_call_parser")
    @classmethod
    def _known_parser(cls, v: str | None, info: ValidationInfo) -> str | None:
        known = {"reasoning_parser": REASONING_PARSERS, "tool_call_parser": TOOL_PARSERS}[info.field_name]
        if v is not None and v not in known:
            raise ValueError(f"unknown {info.field_name} {v!r}; choose one of {', '.join(known)}")
        return v

    @model_validator(mode="after")
    def _topology(self) -> "ClusterConfig":
        # An autoscaled pool counts even at 0 instances: it starts one for its first request.
        roles = {p.role for p in self.pools if p.instances > 0 or p.autoscaling is not None}
        prefill = roles & {"prefill-short", "prefill-long"}
        if not roles:
            raise ValueError("pools: at least one pool needs instances")
        if prefill and "decode" not in roles:
            raise ValueError("pools: prefill pools need a decode pool to hand their KV to")
        if "decode" in roles and not prefill:
            raise ValueError("pools: a decode pool needs a prefill pool in front of it")
        if self.controller.enabled and prefill != {"prefill-short", "prefill-long"}:
            raise ValueError("controller: it moves instances between the prefill-short and prefill-long "
                             "pools, so both need instances")
        adapters = self.engine_config(self.pools[0]).lora_modules
        if set(self.lora_names()) & set(self.served_names()):
            raise ValueError("engine.lora_modules: an adapter is named like the served model "
                             f"({', '.join(self.served_names())})")
        for i, p in enumerate(self.pools):
            a = p.autoscaling
            if a is not None:
                if self.controller.enabled:
                    raise ValueError(f"pools[{i}].autoscaling: the pressure controller (controller.enabled) "
                                     "moves instances between pools while Serve's autoscaler sizes each pool "
                                     "on its own load; the two would work against each other on the same "
                                     "instances, so turn one of them off")
                problems = a.problems(f"pools[{i}].autoscaling", p.instances, p.role)
                if problems:
                    raise ValueError("; ".join(problems))
            ecfg = self.engine_config(p)       # fail at deploy time, not in a replica
            if ecfg.hf_overrides != self.engine_config(self.pools[0]).hf_overrides:
                raise ValueError(f"pools[{i}].engine.hf_overrides: every pool serves the same model, so the same "
                                 "overrides (set them in the app's engine options)")
            if ecfg.lora_modules != adapters:
                raise ValueError(f"pools[{i}].engine.lora_modules: every pool serves the same LoRA adapters (a "
                                 "request may prefill on one pool and decode on another, or resume anywhere)")
            if ecfg.device.startswith("cuda") and p.num_gpus == 0:
                raise ValueError(f"pools[{i}].num_gpus: the engine runs on {ecfg.device!r}, so Ray must "
                                 "give the instance GPUs (set num_gpus, e.g. 1)")
            if p.placement_strategy != "STRICT_PACK":
                if self.placement_bundles(p) is None:
                    raise ValueError(f"pools[{i}].placement_strategy: only a pool whose instances lead a group "
                                     "of Ray-actor ranks (engine group_launch: ray, tp / spp / kvp > 1) is "
                                     "placed by bundles")
                if is_loopback(ecfg.group_host):
                    raise ValueError(f"pools[{i}].engine.group_host: {ecfg.group_host!r} is loopback, but "
                                     f"placement_strategy {p.placement_strategy} may put the group's ranks on "
                                     "other nodes; set group_host: node")
        return self

    def kv_layout_problem(self, mcfg) -> str | None:
        """Why the prefill and decode pools could not hand KV to each other for model config
        `mcfg`, or None: with a model mixing sliding and full layers, an engine lays its KV out in
        groups (the hybrid cache) or in one table by its options (raycluster.parallel.factory
        .hybrid_groups), and every pool that hands KV over or receives it must do the same."""
        from raycluster.parallel.factory import hybrid_groups

        kinds = {i: hybrid_groups(self.engine_config(p), mcfg) is not None for i, p in enumerate(self.pools)
                 if p.role != "mixed" and p in self.deployed_pools()}
        if len(set(kinds.values())) < 2:
            return None
        i, j = next(i for i, k in kinds.items() if k), next(i for i, k in kinds.items() if not k)
        return (f"pools[{j}].engine: this model mixes sliding-window and full-attention layers, and pools[{i}] "
                f"({self.pools[i].role}) keeps its KV in the hybrid cache's groups while pools[{j}] "
                f"({self.pools[j].role}) keeps one table (an EAGLE head or MTP layer, kvp, spp or "
                "disable_hybrid_kv_cache_manager turn it off), so their KV could not be handed over; give "
                "the prefill and decode pools the same of those options (e.g. disable_hybrid_kv_cache_manager: "
                "true in the app's engine options)")

    def deployed_pools(self) -> list[PoolSpec]:
        """The pools that get a Serve deployment: those with instances, and autoscaled ones
        (which may start at zero)."""
        return [p for p in self.pools if p.instances > 0 or p.autoscaling is not None]

    def standby_roles(self) -> tuple[str, ...]:
        """Roles of the pools that may scale to zero: the router holds their queue meanwhile."""
        return tuple(p.role for p in self.pools if p.autoscaling is not None and p.autoscaling.min_instances == 0)

    def placement_bundles(self, pool: PoolSpec) -> list[dict[str, float]] | None:
        """One bundle per rank for a replica that leads a group of Ray-actor ranks (the replica
        takes bundle 0, rank r bundle r), None for any other pool."""
        ecfg = self.engine_config(pool)
        if ecfg.group_launch != "ray" or ecfg.parallel_world == 1:
            return None
        bundle = {"CPU": pool.num_cpus, **({"GPU": pool.num_gpus} if pool.num_gpus else {})}
        return [dict(bundle) for _ in range(ecfg.parallel_world)]

    def role_engine_configs(self) -> dict[str, EngineConfig]:
        """Each role's engine config (its first pool's, the one a replica of that role runs): what
        an instance the pressure controller moves to that role schedules by."""
        configs: dict[str, EngineConfig] = {}
        for p in self.pools:
            configs.setdefault(p.role, self.engine_config(p))
        return configs

    def engine_config(self, pool: PoolSpec) -> EngineConfig:
        cfg = {"model": self.model, "policy": self.policy, "num_threads": self.threads_per_instance,
               **({"device": "cuda"} if pool.num_gpus > 0 else {}), **self.engine, **pool.engine}
        return EngineConfig(**cfg)
