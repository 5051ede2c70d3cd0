"""What enters and leaves an engine: the request checks it shares with the gateway
(`validate_request`, raising `InvalidRequestError` naming the field a user got wrong) and the
typed results of a step (`StepResult`, one `RequestOutput` per request that produced tokens or
finished). raycluster.engine.engine re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raycluster.request import SamplingParams, TokenLogprob


class InvalidRequestError(ValueError):
    """A request a user sent that cannot run; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None     # one per new token, when the request asked
    num_cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache
    # With sampling.prompt_logprobs, on the output of a request's first token: one per prompt
    # token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prefill_s: float | None = None     # on the first token's output: first scheduled to first token
    embedding: list[float] | list[list[float]] | None = None   # a pooling request's (sampling.embed), on its last output


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    num_draft_tokens: int = 0          # speculative decoding: drafts run this step
    num_accepted_tokens: int = 0       # ... and kept
    duration_s: float = 0.0


def validate_request(ids: list[int], sp: SamplingParams, max_model_len: int, vocab_size: int,
                     kv_capacity_tokens: int | None = None) -> None:
    """Raise InvalidRequestError naming the field a user got wrong (shared with the gateway)."""
    if not ids:
        raise InvalidRequestError("prompt", "must not be empty")
    for name, ids_ in (("logit_bias", sp.logit_bias), ("stop_token_ids", sp.stop_token_ids),
                       ("allowed_token_ids", sp.allowed_token_ids or ()),
                       ("bad_words", [t for seq in sp.bad_words_token_ids for t in seq])):
        if any(not 0 <= t < vocab_size for t in ids_):
            raise InvalidRequestError(name, f"token ids must be in [0, {vocab_size})")
    if sp.embed and len(ids) > max_model_len:      # pooling generates nothing: the whole context is the prompt's
        raise InvalidRequestError("prompt", f"{len(ids)} tokens exceed the model's context of {max_model_len} tokens")
    if not sp.embed and len(ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"{len(ids)} tokens leave no room to generate within the context of {max_model_len} tokens")
    if sp.pair_start and not 0 < sp.pair_start < len(ids):
        raise InvalidRequestError("pair_start", f"{sp.pair_start} is not a position inside the {len(ids)}-token prompt")
    if kv_capacity_tokens is not None and len(ids) > kv_capacity_tokens - 1:
        raise InvalidRequestError(
            "prompt", f"{len(ids)} tokens exceed this instance's KV capacity of {kv_capacity_tokens} tokens")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab_size})")
    try:
        sp.validate()
    except ValueError as e:
        field_name, _, message = str(e).partition(" ")
        raise InvalidRequestError(field_name, message) from None
