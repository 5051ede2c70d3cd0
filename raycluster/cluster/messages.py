"""Messages between the cluster's actors: gateway <-> router <-> engine instances.

Plain dataclasses of ints, strings, lists, dicts, `KVHandle`s and `SamplingParams` (no behaviour
beyond its validation), so they pickle cheaply through Ray calls. Times that cross processes are
wall-clock `time.time()` seconds.

Flow (one request):
  gateway --submit(RequestMeta)--> router            (admission answer: SubmitReply)
  instance --poll(InstanceStats)--> router           (long-poll; PollReply: work, aborts, releases)
  instance --push(StepReport)--> router              (one call per engine step, all its requests)
  gateway --pull(gateway_id)--> router               (long-poll; GatewayReply: token events)
Router restarts: the router actor restarts on failure with no state. Each reply carries its
`router_id`; a gateway that sees a new one resubmits its unfinished requests (under new ids, with
the tokens the client already has), and each instance learns a new `epoch` on registering, drops
whatever it held, and stamps its reports with the epoch so the router ignores older ones.
Prefill/decode: a prefill instance reports `PrefillDone` (first token + KV handle); the router
hands a `WorkItem(mode="decode", kv=handle)` to a decode instance; once that instance reports
the request admitted, the router puts the id in the prefill instance's `releases`.

Instance conventions the router relies on:
- a work item's `output_token_ids` are tokens already delivered; the instance reports only
  tokens after them;
- a prefill instance reports `PrefillDone(first_token, kv)`; if the first token ends the request
  (EOS, max_tokens reached) it reports a finished `TokenEvent([first])` instead;
- work is applied between engine steps, so stats two steps after a hand-out include it
  (`InstanceStats.steps`); an instance that reports `work_seen` (items applied, ever; optional
  attribute) gets exact accounting instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raycluster.kv_handle import KVHandle
from raycluster.request import SamplingParams

ROLES = ("mixed", "prefill-short", "prefill-long", "decode")


@dataclass
class RequestMeta:
    """What the gateway knows about a request, tokenized once."""
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    # Every sampling option, as the gateway validated it. The meta owns this object: the gateway
    # puts its own copy here, and nothing writes to it afterwards (the router's policy `Request`
    # and the engine's `Request` read it, in-process or as Ray's unpickled copy).
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0
    tenant: str = "default"
    app_id: str | None = None
    arrival_time: float = 0.0          # time.time() at the gateway
    # Resubmitted after a router restart: tokens the client already has (the request resumes
    # after them) and no admission bound (it was admitted once).
    output_token_ids: list[int] = field(default_factory=list)
    resumed: bool = False


@dataclass
class SubmitReply:
    accepted: bool
    retry_after_s: float = 0.0
    reason: str = ""
    queue_depth: int = 0
    router_id: str = ""
    invalid_field: str | None = None   # refused as the client's error in this field (not for load)


@dataclass
class WorkItem:
    """Router -> instance. `output_token_ids` holds tokens already delivered (decode after a
    handoff starts from the first token; a resumed request carries everything so far)."""
    meta: RequestMeta
    mode: str = "full"                 # full | prefill | decode
    output_token_ids: list[int] = field(default_factory=list)
    kv: KVHandle | None = None
    # When the router delivered the first token (its clock: epoch seconds in the cluster, like
    # meta.arrival_time): a decode instance paces a handed-off request's TPOT budget from the
    # client's first token, not from when the KV landed (Kairos Eq. 2).
    first_token_time: float | None = None


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None   # stop | length | abort | error
    error: str | None = None
    logprobs: list | None = None       # one TokenLogprob per token, if the request asked
    num_cached_tokens: int = 0         # prompt tokens served from the instance's prefix cache
    prompt_logprobs: list | None = None    # per prompt token (the first None), with the first token, if asked
    prefill_s: float | None = None     # with the first token: first scheduled to first token on its instance
    embedding: list[float] | list[list[float]] | None = None   # a pooling request's vector (sampling.embed), when it finishes


@dataclass
class PrefillDone:
    request_id: str
    first_token: int
    kv: KVHandle | None                # None: the instance could not offer its KV (recompute)
    logprobs: list | None = None       # the first token's, if the request asked
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    prompt_logprobs: list | None = None    # per prompt token (the first None), if the request asked
    prefill_s: float | None = None     # first scheduled to first token on the prefill instance


@dataclass
class InstanceStats:
    instance_id: str
    role: str
    waiting: int = 0
    running: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    block_size: int = 16
    step_time_ema_s: float = 0.0
    steps: int = 0
    queued_tokens: int = 0             # prefill tokens not yet computed
    busy_s: float = 0.0                # engine step time so far (the controller's utilization)
    connector: dict = field(default_factory=dict)     # this instance's connector descriptor
    work_seen: int | None = None       # work items applied so far (lets the router count in-transit work)
    layout: str = "single"             # "single", or a group such as "kvp2" / "spp2" / "tp2" / "spp2xtp2" / "kvp2xtp2"
    scheduling: str = ""               # its engine's "policy/packer/decode_selector" (changes on a move)
    nodes: list[str] = field(default_factory=list)    # the Ray node id of each rank (the leader first)
    prefix_caching: bool = False       # the engine keeps prompt prefixes (the router then places by them)
    prefix_query_tokens: int = 0       # known tokens of requests looked up in the prefix cache, so far
    prefix_hit_tokens: int = 0         # of those, found cached
    kv_pulls_ok: int = 0               # P/D handoffs whose KV this instance pulled, so far
    kv_pulls_failed: int = 0           # of handoffs, pulls that failed (the prefill was recomputed)
    kv_pull_blocks: int = 0            # blocks the successful pulls moved
    kv_pull_s: float = 0.0             # wall time of the successful pulls
    preemptions: int = 0               # requests preempted (by recompute), so far
    encoder_cache_queries: int = 0     # images looked up in its encoder cache, so far (raycluster.engine.image_inputs)
    encoder_cache_hits: int = 0        # of those, found (not encoded again)
    kv_groups: int = 1                 # block tables per request: a hybrid cache's layer groups (1: one table)
    kv_released_blocks: int = 0        # blocks given back as they left a sliding window, so far
    spec_draft_tokens: int = 0         # speculative decoding: draft tokens run, so far
    spec_accepted_tokens: int = 0      # of those, accepted
    spec_drafts: int = 0               # verified runs of drafts
    spec_accepted_per_pos: list[int] = field(default_factory=list)   # runs whose draft j + 1 was kept
    lora_adapters: list[str] = field(default_factory=list)   # LoRA adapters its engine serves
    lora_failed: dict[str, str] = field(default_factory=dict)   # adapters of the table it could not load: error
    lora_version: int = -1             # the version of the router's adapter table it applied (-1: none)


@dataclass
class StepReport:
    """Instance -> router, once per engine step (several steps may be merged into one call)."""
    stats: InstanceStats
    events: list[TokenEvent] = field(default_factory=list)
    prefilled: list[PrefillDone] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)       # decode-side handoffs now running
    prefill_samples: list[tuple[int, int, float]] = field(default_factory=list)  # (tokens, history, s)
    epoch: str | None = None           # the registration it was made under (None: not tracked)


@dataclass
class PollReply:
    work: list[WorkItem] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)       # parked KV to free (decode side has it)
    role: str | None = None                                  # a new role when the controller moved us
    shutdown: bool = False
    # This instance's registration with the router: a new value means the router does not know
    # the work the instance holds (it restarted, or reaped the instance and re-queued it).
    epoch: str | None = None
    # The LoRA adapters (name -> path) to serve from now on, applied before the reply's work
    # (router_lora.py); None: no change.
    lora: dict[str, str] | None = None
    lora_version: int = 0


@dataclass
class GatewayReply:
    events: list[TokenEvent] = field(default_factory=list)
    queue_depth: int = 0
    max_queue: int = 0
    router_id: str = ""
