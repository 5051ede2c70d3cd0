"""Request, sampling and SLO types shared by the engine, the schedulers, the router and the simulator.

A `Request` enters the engine through `Engine.add_request`, is owned by the scheduler while it
runs (its `num_computed_tokens` and `output_token_ids` advance every step), and leaves as a
`RequestOutput`. Plain dataclasses only: they travel between actors.
"""

from __future__ import annotations

import enum
from typing import Any
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"            # queued, no KV allocated (or freed by preemption)
    RUNNING = "running"            # has KV blocks; prefilling or decoding
    FINISHED_STOPPED = "stop"      # EOS or stop string
    FINISHED_LENGTH = "length"     # max_tokens or context limit
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILLED = "prefilled"    # P/D: first token made, KV parked for the decode side

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_PREFILLED)


MAX_LOGPROBS = 20         # top alternatives a request may ask for per token (OpenAI's limit)


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt: its preprocessed pixels and the run of placeholder tokens (the image
    token id, repeated) whose embeddings the image encoder's output replaces."""
    offset: int                 # prompt position of its first placeholder token
    length: int                 # placeholder tokens: what the encoder makes of an image of `size`
    # float32 tensor, as the checkpoint's image processor made it; in a cluster, from the gateway
    # to the instance, a handle to it in Ray's object store (raycluster.cluster: `share_images`)
    pixel_values: Any
    digest: bytes               # hash of pixels and size: prefix-cache keys of blocks it starts in include it
    size: tuple[int, int] = (0, 0)     # the image's (height, width) before processing (LLaVA-NeXT's tiling)
    # `pixel_values` are the image's embeddings [length, width] as the encoder would give them
    # (a client's image_embeds part, vLLM's --enable-mm-embeds): no encoder runs for it.
    embeds: bool = False


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (raw logits, before penalties, temperature,
    top-k and top-p), given the tokens before it: a sampled token's or a prompt token's."""
    logprob: float
    # The `logprobs` (or `prompt_logprobs`) most likely tokens with theirs, best first.
    top: list[tuple[int, float]]
    # 1 + the number of vocabulary tokens with a strictly higher log-probability (vLLM's `rank`).
    rank: int


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 disables top-k
    min_p: float = 0.0              # vLLM's: drop tokens less likely than min_p x the likeliest one
    seed: int | None = None         # token k drawn with (seed, k): same tokens whatever the batch or instance
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # report each token's log-probability and this many top ones
    # OpenAI's: subtract presence * [token seen in the output] + frequency * its count there.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM's: a token seen in the prompt or output has its logit divided by this (if > 0,
    # else multiplied).
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)    # OpenAI's: added to these logits
    min_tokens: int = 0             # vLLM's: EOS and stop_token_ids cannot be sampled before this many
    # vLLM's: report each prompt token's log-probability (given the tokens before it) and this
    # many top ones. Every prompt position is computed then: no prefix-cache hit for the request.
    prompt_logprobs: int | None = None
    # A structured output: the whole output must match this regular expression (the gateway
    # builds it from a JSON schema, a choice list or json_object; raycluster.engine.guided) or
    # be a sentence of this grammar (Lark or GBNF text). At most one of the two.
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # vLLM's: only these token ids may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: a stop string that ends the output is kept at its end (the text stream's business).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True    # vLLM's: leave special tokens out of the output text
    # vLLM's bad_words as token sequences (the gateway tokenizes the words): a sequence's last
    # token is banned wherever the output ends with the rest of it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The LoRA adapter the request runs with (the API's `model` names it; None: the base weights).
    # Here, not on the request, so it travels wherever the sampling parameters do (P/D, resumes).
    lora_adapter: str | None = None
    # A pooling request (the API's /v1/embeddings, /score, /rerank): it ends with its prompt, its
    # output the prompt's final hidden states pooled as the engine's model says (Request.pooling);
    # it samples no token (max_tokens is ignored).
    embed: bool = False
    # A cross-encoder's sentence pair (pooling requests): the prompt position where the second
    # text starts, whose tokens a BERT-style encoder reads as token type 1 (0: one text). Sent as
    # one number, as vLLM compresses token_type_ids, since the types are 0...0 1...1.
    pair_start: int = 0
    # A pooling request's token-level output (vLLM's token_embed / token_classify): every prompt
    # position's final hidden state (through a classifier's head), not one pooled vector.
    pool_tokens: bool = False
    # The prompt's images (image-text checkpoints with a vision tower). Here, not on the request,
    # for the same reason as lora_adapter: a P/D decode side that recomputes needs them too.
    images: list[ImageInput] = field(default_factory=list)

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def validate(self) -> None:
        """Raise ValueError naming the field a user got wrong."""
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.pool_tokens and not self.embed:
            raise ValueError("pool_tokens is for pooling requests (embed) only")
        if self.pair_start and (self.pair_start < 0 or not self.embed):
            raise ValueError(f"pair_start must be a position (>= 0) of a pooling request's prompt, got {self.pair_start}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not seq for seq in self.bad_words_token_ids):
            raise ValueError("bad_words must not hold an empty word")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must hold at least one token id")
        if self.guided_regex is not None and self.guided_grammar is not None:
            raise ValueError("guided_grammar: set at most one of guided_regex and guided_grammar")


@dataclass
class SLO:
    """Latency targets of one request, in seconds. None: the deployment default applies."""
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    slo: SLO = field(default_factory=SLO)
    priority: int = 0               # lower goes first under the `priority` policy (vLLM's); others ignore it
    tenant: str = "default"
    app_id: str | None = None
    expected_output_tokens: int | None = None   # a predictor's or the client's estimate
    eos_token_ids: tuple[int, ...] = ()
    prefill_only: bool = False      # P/D: stop after the first token and park the KV for handoff

    # Mutable state advanced by the scheduler/engine.
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0    # tokens whose KV is in the cache
    num_preemptions: int = 0
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
    first_scheduled_time: float | None = None   # when a step first ran part of its prompt
    first_token_time: float | None = None
    finish_time: float | None = None
    # With sampling.prompt_logprobs: entry i for prompt token i + 1, filled as chunks compute
    # (a recompute after preemption overwrites the same entries).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Speculative decoding: draft tokens proposed after the last sampled one, for the next step.
    spec_token_ids: list[int] = field(default_factory=list)
    # With sampling.embed: how its prompt's final hidden states are pooled ("last" | "mean" |
    # "cls", the engine's model's: raycluster.model.pooling), the state carried between chunks,
    # and the raw pooled vector, set when its prompt is computed.
    pooling: str | None = None
    pool_state: Any = None
    embedding: list[float] | list[list[float]] | None = None
    # Image-encoder outputs [length, H] by index into sampling.images, kept from the step that
    # first needs an image until its prefill passes it (raycluster.engine.image_inputs).
    image_embeds: dict[int, Any] = field(default_factory=dict)
    # On a Qwen-VL model, its images' M-RoPE layout (raycluster.model.mrope.MRopeLayout): the
    # rotary positions of its prompt and of the tokens after it. None: positions are indices.
    mrope: Any = None
    # Per image, the [start, end) runs of its span its features fill (Mistral 3: the rows between
    # its break tokens; raycluster.engine.image_inputs). Empty: each image's whole span.
    image_runs: list[list[tuple[int, int]]] = field(default_factory=list)
    # Prompt spans [start, end) whose tokens attend each other both ways (on Gemma 3 its images):
    # the scheduler never ends a prefill chunk inside one, so each is computed in one step.
    bidirectional_spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything that needs KV eventually."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens without KV. A decode step has exactly one (the last sampled token);
        a prefill (or a recompute after preemption) has more, or has produced no token yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return not self.output_token_ids or self.num_uncomputed_tokens > 1
