"""OpenAI-compatible HTTP schemas (pydantic) and the error shape.

Requests enter as JSON and are validated here; `to_sampling()` turns them into the engine's
`SamplingParams`. Extra fields beyond OpenAI's (`ttft_slo_ms`, `tpot_slo_ms`, `priority`,
`tenant`, `app_id`, vLLM's `ignore_eos` and `min_tokens`) are optional. Unknown fields are
ignored, as OpenAI clients send many we do not use; but OpenAI options that would change the
output and are not implemented (`best_of`, `suffix`, and `echo` on chat; vLLM's `use_beam_search`,
`length_penalty`, `spaces_between_special_tokens`) are refused with a 400 naming the
field unless they hold their neutral value, rather than silently ignored. vLLM's
`stop_token_ids`, `include_stop_str_in_output`, `allowed_token_ids`, `skip_special_tokens`,
`bad_words` (tokenized by the app) and `truncate_prompt_tokens` (keep the last k prompt tokens)
are served. `echo` on
completions returns the prompt before the completion, and with `logprobs` the prompt tokens'
log-probabilities too (the first token's is null). vLLM's `prompt_logprobs` (an int k in [0, 20],
both endpoints) returns vLLM's `prompt_logprobs` list: per prompt token, the first null, a dict
from token id to {logprob, rank, decoded_token} holding the prompt token with its rank in the
vocabulary and the top k; in each choice on completions (there also with echo + logprobs, as
vLLM), once per response on chat; refused with `stream` unless 0, as vLLM. `presence_penalty` /
`frequency_penalty` / `logit_bias` (OpenAI's) and `repetition_penalty` (vLLM's) are served, and
`logprobs`: an int (top alternatives) on completions, a bool with `top_logprobs` on chat. Chat
`content` may be a string or a list of text parts. Structured outputs: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (raycluster.server.structured turns them into the regex or
grammar the engine enforces).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from raycluster.model.generation_config import SAMPLING_KEYS
from raycluster.request import MAX_LOGPROBS, SamplingParams
from raycluster.server.tools import ToolCall, ToolChoice, ToolDef


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: usage so far in every chunk too


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema})")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json / regex / choice / json_object / grammar."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None         # a context-free grammar: Lark, or llama.cpp's GBNF
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False


class _GenerationFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, description="completions: default 16; chat: default the rest of the "
                                      "context (as vLLM); at most the context minus the prompt; >= 1")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's: drop tokens less likely than "
                         "min_p times the likeliest one")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: each prompt token's log-probability, rank and this many alternatives. After
    # `stream`, so that its validator sees it.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="vLLM's: no EOS, stop_token_ids or stop strings "
                            "before this many tokens")
    n: int = Field(1, ge=1, le=16, description="choices: each one its own request")
    # Scheduling hints (all optional).
    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)
    priority: int = Field(0, description="with the cluster's `priority` policy, lower is served first (vLLM's "
                          "convention; ties by arrival); the other policies ignore it")
    tenant: str | None = None
    app_id: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's extra sampling parameters.
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep only the last k prompt tokens")
    bad_words: list[str] | None = None
    # OpenAI's and vLLM's options not implemented: accepted only at their neutral values.
    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = None
    spaces_between_special_tokens: Any = None
    length_penalty: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        if v and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("biases must be in [-100, 100]")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v, info: ValidationInfo):
        # vLLM's rule: a stream's chunks have no place for them (0 asks for nothing to show).
        if v and info.data.get("stream"):
            raise ValueError("not available with stream: true")
        return v

    @field_validator("suffix")
    @classmethod
    def _absent(cls, v):
        if v not in (None, False, 0, {}, "", []):
            raise ValueError("not supported by this server (leave it out)")
        return v

    @field_validator("best_of")
    @classmethod
    def _one(cls, v):
        if v not in (None, 1):
            raise ValueError("not supported by this server (only 1)")
        return v

    @field_validator("use_beam_search")
    @classmethod
    def _off(cls, v):
        if v not in (None, False):
            raise ValueError("not supported by this server (leave it out)")
        return v

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaced(cls, v):
        if v not in (None, True):
            raise ValueError("not supported by this server (only true)")
        return v

    @field_validator("length_penalty")
    @classmethod
    def _unit(cls, v):
        if v not in (None, 1, 1.0):
            raise ValueError("not supported by this server (beam search only; only 1.0)")
        return v

    def to_sampling(self, default_max_tokens: int = 16, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the model's default sampling parameters (raycluster.model.generation_config)
        for the fields this request left out."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        knobs = {k: getattr(self, k) for k in SAMPLING_KEYS}
        knobs.update({k: v for k, v in (defaults or {}).items() if k in knobs and k not in self.model_fields_set})
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=float(knobs["temperature"]), top_p=float(knobs["top_p"]), top_k=int(knobs["top_k"]),
            min_p=float(knobs["min_p"]), seed=self.seed,
            stop=stop, ignore_eos=self.ignore_eos, logprobs=self.num_logprobs(),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=float(knobs["repetition_penalty"]), logit_bias=dict(self.logit_bias or {}),
            min_tokens=self.min_tokens, prompt_logprobs=self.num_prompt_logprobs(),
            stop_token_ids=list(self.stop_token_ids or []), allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)

    def num_logprobs(self) -> int | None:
        return None

    def shown_prompt_logprobs(self) -> int | None:
        """Alternatives per entry of the response's `prompt_logprobs`; None: it is null. A stream
        carries none (vLLM's chunks have no such field)."""
        return None if self.stream else self.prompt_logprobs

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes; None: none computed (they cost the
        request its prefix-cache hits)."""
        return self.shown_prompt_logprobs()


MAX_CHOICES = 256      # prompts x n per request: each is a backend request (the router's default queue bound)


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    echo: bool = Field(False, strict=True, description="return the prompt before the completion (and its "
                       "tokens' logprobs with `logprobs`)")
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's special tokens (e.g. BOS) "
                                     "around a text prompt")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def shown_prompt_logprobs(self) -> int | None:
        k = super().shown_prompt_logprobs()
        # vLLM's: echo with logprobs computes the prompt's, and a choice returns what was computed.
        return self.logprobs if k is None and self.echo and not self.stream else k

    def num_prompt_logprobs(self) -> int | None:
        k = self.shown_prompt_logprobs()
        if self.echo and self.logprobs is not None:     # the echoed prompt's entries need as many
            k = max(k or 0, self.logprobs)
        return k

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, v, info: ValidationInfo):
        batch = len(v) if isinstance(v, list) and v and not isinstance(v[0], int) else 1
        n = info.data.get("n", 1)
        if batch * n > MAX_CHOICES:
            raise ValueError(f"{batch} prompts x n={n} is {batch * n} choices; at most {MAX_CHOICES} per request")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(..., max_length=64 * 2 ** 20)     # a data: URL holds the image itself
    detail: Literal["auto", "low", "high"] | None = None    # OpenAI's; one resolution here


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(BaseModel):
    """vLLM's video part; its URL a frame list, data:video/jpeg;base64,<frame>,<frame>,...
    (raycluster.server.videos)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["video_url"]
    video_url: ImageURL


class ImageEmbedsPart(BaseModel):
    """vLLM's precomputed image embeddings: base64 of a torch.save'd float tensor [tokens, hidden]
    (raycluster.server.embeds; served with --enable-mm-embeds)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_embeds"]
    image_embeds: str | dict = Field(..., description="base64 of torch.save(tensor)")
    uuid: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[Annotated[TextPart | ImagePart | VideoPart | ImageEmbedsPart,
                                  Field(discriminator="type")]] | None = None
    tool_calls: list[ToolCall] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, v):
        if isinstance(v, list):
            kinds = {p.get("type") for p in v if isinstance(p, dict)} - {"text", "image_url", "video_url",
                                                                          "image_embeds"}
            if kinds:
                raise ValueError(f"only text, image_url, video_url and image_embeds content parts are supported, "
                                 f"got {sorted(map(str, kinds))}")
        return v

    @model_validator(mode="after")
    def _images_from_users(self) -> "ChatMessage":
        if self.media() and self.role != "user":
            raise ValueError(f"image_url, video_url and image_embeds parts belong in user messages, not "
                             f"{self.role!r} ones")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImageURL]:
        return [url for kind, url in self.media() if kind == "image"]

    def media(self) -> list[tuple[str, ImageURL | str | dict]]:
        """The message's images, videos and image embeddings in order: ("image" | "video", URL),
        ("image_embeds", the part's payload) each."""
        if isinstance(self.content, (str, type(None))):
            return []
        kinds = {ImagePart: ("image", "image_url"), VideoPart: ("video", "video_url"),
                 ImageEmbedsPart: ("image_embeds", "image_embeds")}
        return [(kinds[type(p)][0], getattr(p, kinds[type(p)][1])) for p in self.content if type(p) in kinds]


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None            # not OpenAI's on chat (vLLM's echoes the last message): refused
    # vLLM's: open a new assistant turn (default), or continue the last message as it is.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: special tokens on top of what the chat template writes (which places BOS itself).
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None     # vLLM's: more variables for the template
    # OpenAI's: how hard a reasoning model thinks; the chat template reads it (gpt-oss's does).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_new_turn(cls, v, info: ValidationInfo):
        return continue_needs_no_new_turn(v, info)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return cls._absent(v)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def continue_needs_no_new_turn(v: bool, info: ValidationInfo) -> bool:
    if v and info.data.get("add_generation_prompt", True):
        raise ValueError("needs add_generation_prompt: false (a new turn cannot continue the last message)")
    return v


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a completion prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # As on the endpoint the input is for: on for a prompt, off for messages (the template's).
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_new_turn(cls, v, info: ValidationInfo):
        return continue_needs_no_new_turn(v, info)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def now_s() -> int:
    return int(time.time())


def error_body(message: str, param: str | None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def overloaded_response(e: "OverloadedError") -> JSONResponse:
    """429 / 503 in OpenAI's error shape, with Retry-After."""
    return JSONResponse(error_body(str(e), None, "overloaded_error", e.code), status_code=e.status,
                        headers={"Retry-After": str(max(1, round(e.retry_after_s)))})


class OverloadedError(Exception):
    """The service cannot take the request now: 429 (queue full) or 503 (no capacity at all)."""

    def __init__(self, message: str, retry_after_s: float = 1.0, status: int = 429) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.code = "queue_full" if status == 429 else "unavailable"
