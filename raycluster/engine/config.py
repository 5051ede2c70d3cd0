"""User-facing engine configuration (pydantic: validated once, errors name the field)."""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The fields that say how an engine schedules, as opposed to what it runs (model, KV pool, block
# size, parallelism, device): what an instance adopts when the pressure controller moves it to
# another pool (`EngineConfig.with_scheduling_of`). `predictor` says where a batch-time predictor
# comes from, should the new policy / packer / selector need one the engine did not.
SCHEDULING_FIELDS = ("policy", "packer", "decode_selector", "chunk_size", "long_threshold", "min_chunk",
                     "ttft_ms", "tpot_ms", "ttft_scale", "max_num_batched_tokens", "max_num_seqs", "max_num_encoder_tokens",
                     "predictor")


# Speculative methods whose head runs on the target's own hidden states, its KV an extra layer of
# the engine's (raycluster.engine.eagle): EAGLE-1 / EAGLE-3 heads and the checkpoint's MTP layer.
HEAD_METHODS = ("eagle", "eagle3", "mtp")

class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field("tiny", description="'tiny' (the embedded checkpoint) or a checkpoint directory")
    hf_overrides: dict[str, Any] = Field(
        default_factory=dict, description="vLLM's --hf-overrides: config.json fields to change (a JSON object), "
        "e.g. '{\"max_position_embeddings\": 4096}'; with 'architectures': ['...ForSequenceClassification'] and "
        "'classifier_from_token' (and 'method' from_2_way_softmax or no_post_processing, or "
        "'is_original_qwen3_reranker': true) a causal LM serves as a classifier scoring with rows of its "
        "output head (Qwen3-Reranker)")
    dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$",
                       description="weights and KV; 'auto' (vLLM's default): the checkpoint's own (float32 when it "
                       "names none; a float16 checkpoint runs in bfloat16 off CUDA)")
    device: str = "cpu"
    quant_kernels: Literal["auto", "quantized", "dense"] = Field(
        "auto", description="a quantized checkpoint's linear layers (compressed-tensors, GPTQ, AWQ, FP8): 'quantized' "
        "keeps int4 / per-channel int8 weights packed and runs torch's weight-only int kernels; 'dense' dequantizes "
        "every weight into dtype at load (a dense model's memory and speed); 'auto' (default) quantized for "
        "bfloat16 / float16, dense for float32, whose activations the CPU int kernels run slowly. FP8 weights and "
        "layouts the kernels do not take are always dequantized")
    pooling_type: Literal["auto", "last", "mean", "cls"] = Field(
        "auto", description="how /v1/embeddings pools a prompt's final hidden states: the last token, the mean "
        "over the prompt or the first (CLS) token; 'auto' (default): the checkpoint's sentence-transformers "
        "Pooling module, else the last token (vLLM's default for a decoder)")
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_tokens: int = Field(262144, ge=16, description="KV capacity in tokens (rounded down to blocks)")
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    max_num_encoder_tokens: int | None = Field(
        None, ge=1, description="vLLM's max_num_encoder_input_tokens: the image tokens one step may encode (a prefill "
        "chunk stops before an image that would pass it); default max_num_batched_tokens")
    encoder_cache_tokens: int = Field(
        4096, ge=0, description="image encoder outputs kept across requests, in image tokens (the least recently used "
        "go first): the same image in another prompt is not encoded again (vLLM's encoder cache); 0: none")
    max_model_len: int | None = Field(None, ge=2, description="default: the model's context length")
    chunk_size: int | None = Field(512, ge=1, description="prefill chunk size; None: unchunked prefill")
    policy: str = Field("lars", description="priority policy by name (raycluster.sched.registry)")
    packer: str = Field("medha", pattern="^(medha|token|awd)$",
                        description="medha: time-budget chunks from the predictor; token: fixed chunk_size; "
                                    "awd: PLA-Serve adaptive wait-depth batches of short prefills")
    decode_selector: str = Field("all", pattern="^(all|kairos)$",
                                 description="all: continuous batching; kairos: slack-guided decode batching")
    predictor: str = Field("auto", description="'auto' (cached profile or profile at start), 'none', or a JSON file")
    ttft_ms: float = Field(2000.0, gt=0, description="default TTFT SLO for requests that carry none")
    tpot_ms: float = Field(100.0, gt=0, description="default TPOT SLO; also the medha packer's step budget")
    ttft_scale: float = Field(5.0, gt=0, description="deadline = max(ttft_ms, ttft_scale x isolated prefill time)")
    long_threshold: int = Field(2048, ge=1, description="prompt tokens from which a prefill counts as long")
    min_chunk: int = Field(256, ge=1, description="medha: prefill tokens a step runs even when decodes alone "
                                                 "fill the time budget (keeps prefills moving on slow hardware)")
    enable_prefix_caching: bool = Field(
        False, description="keep full KV blocks findable by their tokens after use, so a prompt that "
                           "starts like an earlier one prefills only the rest")
    disable_hybrid_kv_cache_manager: bool = Field(
        False, description="a model mixing sliding-window and full-attention layers keeps one block table "
                           "for all its layers (every block kept), instead of one per layer group with the "
                           "sliding groups giving back blocks that fall out of their window (vLLM's flag)")
    speculative_method: Literal["none", "ngram", "draft_model", "eagle", "eagle3", "mtp"] = Field(
        "none", description="speculative decoding (vLLM's speculative_config method): 'ngram' drafts the next "
        "tokens by prompt lookup (the tokens that followed the latest earlier occurrence of the context's last "
        "n-gram), 'draft_model' by a smaller model's greedy continuation (speculative_model), 'eagle' / "
        "'eagle3' by an EAGLE-1 / EAGLE-3 head on the target's own hidden states (speculative_model: the "
        "head's directory; single-process engines and tp / kvp groups, where it runs on the leader), 'mtp' "
        "(vLLM's deepseek_mtp) by the checkpoint's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5; "
        "where EAGLE runs); the target verifies them in one step; greedy output is unchanged, sampled output "
        "keeps its distribution")
    speculative_model: str | None = Field(
        None, description="draft_model: the draft checkpoint ('tiny' or a directory), sharing the target's "
                          "vocabulary; it runs on the engine's leader with its own KV cache. eagle / eagle3: the "
                          "EAGLE head's directory (its KV is an extra layer of the engine's own)")
    speculative_kv_tokens: int | None = Field(
        None, ge=16, description="draft_model: the draft model's KV capacity in tokens (default kv_cache_tokens)")
    num_speculative_tokens: int = Field(5, ge=1, le=32, description="speculative decoding: draft tokens per step at most")
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="ngram drafts: the longest n-gram matched")
    prompt_lookup_min: int = Field(1, ge=1, le=64, description="ngram drafts: the shortest n-gram matched")
    lora_modules: list[str] = Field(
        default_factory=list, description="LoRA adapters to serve beside the base weights, vLLM's "
        "--lora-modules: name=path entries (a PEFT directory each); a request whose `model` is a name runs "
        "with that adapter. On a KVP / SPP / TP group each rank holds its shard of each adapter")
    seed: int = 0
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    kvp: int = Field(1, ge=1, le=64, description="KV-cache parallel ranks (Medha KVP): each rank holds the "
                     "weights (with tp > 1: a TP group of that many ranks, its heads' share each) and kv_cache_tokens "
                     "of KV; a request's KV is spread over them as kvp_layout says. With spp > 1: each stage is a KVP "
                     "group of this many ranks over its layers (kvp x spp, kvp x spp x tp ranks in all)")
    kvp_layout: Literal["striped", "progressive"] = Field(
        "striped", description="where a request's KV goes over the KVP ranks: 'striped' (block i on rank i % kvp, "
        "every request over every rank) or 'progressive' (Medha's progressive scaling: contiguous ranges of "
        "kvp_tokens_per_rank tokens from the start rank kvp_start picks, so a short request lives on one "
        "rank and a long one onboards the next rank as its context grows; a full rank passes blocks on to the "
        "next with room). Works with prefix caching (a cached prefix fixes the start rank), TP and SPP")
    kvp_start: Literal["first_fit", "least_loaded"] = Field(
        "first_fit", description="kvp_layout 'progressive': the rank a new request starts on. 'first_fit': the "
        "lowest rank with a whole range (kvp_tokens_per_rank) free, else the one with the most free KV, so short "
        "requests stay on rank 0 while it has room and their steps run on it alone; 'least_loaded': the rank with "
        "the most free KV, which balances KV over the ranks but makes most steps whole-group steps. Ignored "
        "when striped (a config dumped and rebuilt, as a group's Ray ranks do, carries it either way)")
    kvp_tokens_per_rank: int | None = Field(
        None, ge=1, description="kvp_layout 'progressive': tokens of one request a KVP rank holds before the next "
        "rank takes over; a multiple of block_size, at most one rank's pool (kv_cache_tokens). Default: "
        "kv_cache_tokens / kvp in whole blocks, so a request as long as one rank's pool spreads over every rank")
    spp: int = Field(1, ge=1, le=64, description="stream pipeline stages (Medha SPP): layers split over the "
                     "stages, prefill micro-chunks stream through them; at most the model's layer count")
    spp_micro_tokens: int = Field(512, ge=1, description="SPP: prefill tokens per micro-chunk in the pipeline")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel ranks (Megatron, vLLM's tensor_parallel_size): "
                    "attention heads and the MLP split over them, one all-reduce after o_proj and after "
                    "down_proj per layer; each rank holds kv_cache_tokens of KV for its KV heads (one head, "
                    "replicated on tp / KV heads ranks, when tp is a multiple of the KV heads). With spp > 1 "
                    "(or kvp > 1): each stage (each KVP rank, of each stage) is a TP group of this many ranks "
                    "(spp x tp, kvp x tp, kvp x spp x tp ranks in all)")
    enable_expert_parallel: bool = Field(
        False, description="vLLM's --enable-expert-parallel: a mixture-of-experts model's tp ranks each hold a "
        "whole share of the experts (num_experts / tp of them, the rows routed to them run there) instead of a "
        "slice of every expert; the same one all-reduce per layer. Needs tp > 1 and tp dividing the experts; "
        "no effect on a dense model")
    group_launch: Literal["threads", "ray"] = Field(
        "threads", description="where the ranks of a KVP / SPP / TP group run: threads of this process, or Ray actors")
    group_host: str = Field("127.0.0.1", description="address the group's store and gloo sockets bind to: "
                            "loopback for a group on one node, 'node' for each rank's Ray node address (a "
                            "group that may span nodes)")
    group_timeout_s: float = Field(120.0, gt=0, description="a collective waiting longer fails the step")

    @field_validator("hf_overrides", mode="before")
    @classmethod
    def _overrides_json(cls, v):
        if isinstance(v, str):          # the command line's JSON text
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON object: {e}") from None
        if not isinstance(v, dict):
            raise ValueError(f"must be a JSON object of config.json fields, got {v!r}")
        return v

    @model_validator(mode="after")
    def _lora(self) -> "EngineConfig":
        if self.lora_modules:
            from raycluster.model.lora import parse_modules
            parse_modules(self.lora_modules)
        return self

    @model_validator(mode="after")
    def _expert_parallel(self) -> "EngineConfig":
        if self.enable_expert_parallel and self.tp == 1:
            raise ValueError("enable_expert_parallel: the experts are shared out over the tp ranks; set tp > 1")
        return self

    @model_validator(mode="after")
    def _draft_model(self) -> "EngineConfig":
        method = self.speculative_method
        if method in ("draft_model", "eagle", "eagle3") and not self.speculative_model:
            raise ValueError(f"speculative_model: speculative_method {method!r} needs "
                             f"{'a draft checkpoint' if method == 'draft_model' else 'an EAGLE head'}")
        if self.speculative_model and method not in ("draft_model", "eagle", "eagle3"):
            raise ValueError(f"speculative_model: a draft model or EAGLE head is only for speculative_method "
                             f"'draft_model', 'eagle' or 'eagle3' (speculative_method is {method!r}"
                             + ("; 'mtp' reads the model's own checkpoint)" if method == "mtp" else ")"))
        if method in HEAD_METHODS and self.spp > 1:
            raise ValueError(f"speculative_method: {method!r} runs on a single-process engine or a tp / kvp "
                             f"group's leader; spp groups draft with 'ngram' or 'draft_model'")
        if self.speculative_kv_tokens is not None and method != "draft_model":
            raise ValueError("speculative_kv_tokens: only a draft model has a KV cache of its own")
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> "EngineConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min: {self.prompt_lookup_min} is more than prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        return self

    @model_validator(mode="after")
    def _kvp_range(self) -> "EngineConfig":
        n, bs = self.kvp_tokens_per_rank, self.block_size
        if n is None:
            return self
        if self.kvp_layout != "progressive":
            raise ValueError(f"kvp_tokens_per_rank: {n} is only for kvp_layout 'progressive' (kvp_layout is "
                             f"{self.kvp_layout!r})")
        if n % bs:
            raise ValueError(f"kvp_tokens_per_rank: {n} is not a multiple of block_size {bs}")
        pool = self.kv_cache_tokens // bs * bs
        if n > pool:
            raise ValueError(f"kvp_tokens_per_rank: {n} is more than one rank's KV pool (kv_cache_tokens: {pool})")
        return self

    def kvp_progressive_tokens(self) -> int | None:
        """Tokens of one request per KVP rank under the progressive layout (`kvp_tokens_per_rank`,
        default one rank's pool / kvp in whole blocks, at least one block); None when striped."""
        if self.kvp_layout != "progressive":
            return None
        if self.kvp_tokens_per_rank is not None:
            return self.kvp_tokens_per_rank
        bs = self.block_size
        return max(1, self.kv_cache_tokens // bs // self.kvp) * bs

    def for_model(self, model_dtype: str | None) -> "EngineConfig":
        """This config with dtype 'auto' made concrete for a checkpoint whose config.json names
        `model_dtype` (`ModelConfig.dtype`); other dtypes are kept."""
        if self.dtype != "auto":
            return self
        dtype = model_dtype if model_dtype in ("float32", "bfloat16", "float16") else "float32"
        if dtype == "float16" and not self.device.startswith("cuda"):
            dtype = "bfloat16"          # CPU kernels are bf16's, as vLLM's CPU backend
        return self.model_copy(update={"dtype": dtype})

    def for_encoder(self) -> "EngineConfig":
        """This config as a BERT-style encoder runs it: each prompt whole in one step (its
        attention is bidirectional: a chunk would miss the tokens after it; vLLM turns chunked
        prefill off for encoders), and no prefix cache (an encoder keeps no KV)."""
        return self.model_copy(update={"packer": "token", "chunk_size": None, "enable_prefix_caching": False})

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype: 'auto' is made concrete against the checkpoint first (EngineConfig.for_model)")
        return getattr(torch, self.dtype)

    def with_scheduling_of(self, pool: "EngineConfig") -> "EngineConfig":
        """This config with `pool`'s scheduling fields (`SCHEDULING_FIELDS`): what an instance of
        this config runs after a move to `pool`. Everything else stays this instance's own: its
        model, KV pool size, block size, parallelism and device are what it was started with, so
        a target pool that differs in those gets an instance with its scheduling and our
        hardware. (max_num_batched_tokens / max_num_seqs are scheduler limits only: no buffer
        is sized by them.)"""
        return self.model_copy(update={f: getattr(pool, f) for f in SCHEDULING_FIELDS})

    def scheduling_label(self) -> str:
        """'policy/packer/decode_selector', as instance stats and `raycluster status` show it."""
        return f"{self.policy}/{self.packer}/{self.decode_selector}"

    @property
    def parallel_world(self) -> int:
        """Ranks of the engine's group (1: one process)."""
        return self.kvp * self.spp * self.tp
