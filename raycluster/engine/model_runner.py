"""Runs one scheduled step on the model in this process: owns the KV tensor, turns a
`SchedulerOutput` into the flat varlen inputs and attention metadata (raycluster.parallel.plan),
and returns the logits rows to sample from. Parallel groups (raycluster.parallel) offer the same
`execute` over several processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import get_attention_backend
from raycluster.engine.image_inputs import drop_passed_images, encode_images
from raycluster.engine.kv_manager import KVCacheManager
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.model.pooling import pool_chunk, pooled
from raycluster.parallel.kv_port import DirectPort
from raycluster.parallel.plan import StepPlan, plan_inputs, step_plan
from raycluster.request import Request


@dataclass
class StepLogits:
    logits: torch.Tensor            # [n_sampled, vocab]
    requests: list[Request]         # the request of each row
    # Requests asking for prompt log-probabilities: (request, first position, fp32 logits
    # [positions, vocab]), row i predicting prompt token first position + i + 1.
    prompt: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)
    # Decodes that ran drafts: (request, fp32 logits [1 + drafts, vocab]) (`Sampler.verify`).
    drafts: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
    # Pooling requests (sampling.embed) whose prompt this step completed: (request, its raw
    # pooled vector, fp32 [H]: raycluster.model.pooling).
    embeddings: list[tuple[Request, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    # Parallel runners say e.g. "kvp2" / "spp2" / "tp2" / "spp2xtp2" / "kvp2xtp2" / "kvp2xspp2" /
    # "kvp2xspp2xtp2" (the profile cache keys on it).
    layout = "single"
    # Whether a step's prefills may hold bidirectional spans (Gemma 3's images): the attention
    # runs on one process's whole chunk (a KVP or SPP group splits it).
    runs_bidirectional_spans = True
    ranks = None           # parallel runners: the group's other ranks (`alive()`, `join(timeout)`)
    keep_hidden = False    # an EAGLE proposer reads every step's hidden states (`last_hidden`)
    last_hidden = None
    aux_layers: tuple[int, ...] = ()    # an EAGLE-3 head's: `last_aux`, the residual streams entering them
    last_aux = None
    # An image-text checkpoint's image encoder (raycluster.model.llava), run on this process for
    # prompts with images (`execute_step`); None: the runner takes no images. Its recent outputs
    # by image digest (raycluster.engine.image_inputs.EncoderCache), when the engine keeps them.
    image_encoder = None
    image_cache = None

    def __init__(self, model, kv: KVCacheManager, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", extra_kv_layers: int = 0) -> None:
        """`extra_kv_layers`: KV layers after the model's own, for an EAGLE head's KV."""
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.dtype = dtype
        shape = model.kv_cache_shape(kv.num_physical_blocks, kv.block_size)
        shape = (kv.kv_slots(shape[0]), *shape[1:])     # a hybrid cache's slots (raycluster.engine.kv_groups)
        self.kv_cache = torch.zeros((shape[0] + extra_kv_layers, *shape[1:]), dtype=dtype, device=self.device)
        # The EAGLE head's layers: a view of the tensor's last ones, so they move with the blocks.
        self.head_kv_cache = self.kv_cache[shape[0]:] if extra_kv_layers else None
        self.port = DirectPort(self.kv_cache)      # what a KV connector wraps: this tensor itself
        # Its own attention backend unless the model was built with one: the torch backend's
        # scratch buffers must not be shared by engines stepping in threads of one process.
        self.backend = model.backend or get_attention_backend(
            self.device, torch_only=model.config.torch_attention_only)
        self.lora = None            # the engine's LoRASet when it serves adapters

    def kv_bytes_per_token(self) -> int:
        per_block = self.kv_cache[:, 0].numel() * self.kv_cache.element_size()
        return per_block // self.kv.block_size

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; returns the final hidden states of `plan.sample_rows` [n, H]."""
        input_ids, positions, meta = plan_inputs(plan, self.kv.block_size, self.device, self.kv.groups)
        lora = self.lora.for_step(plan.lora_runs, plan.num_tokens, self.device) if plan.lora_runs else None
        hidden, self.last_aux = forward_keeping(self.model, input_ids, positions, self.kv_cache, meta, self.backend,
                                                lora, self.aux_layers, plan.image_rows)
        if self.keep_hidden:
            self.last_hidden = hidden
        return hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=hidden.device))

    def execute(self, out: SchedulerOutput) -> StepLogits:
        return execute_step(self, out)

    def close(self) -> None:
        pass


def forward_keeping(model, input_ids, positions, kv_cache, meta, backend, lora, aux_layers: tuple[int, ...],
                    image_rows=()):
    """(final hidden states, the residual streams entering `aux_layers` or None): one forward of
    `model` (a full model or a rank's shard), as an EAGLE head's runner keeps them. `image_rows`
    (the plan's) go to the model only when there are some: only models that take images accept them."""
    more = {"image_rows": image_rows} if image_rows else {}
    if aux_layers:
        return model(input_ids, positions, kv_cache, meta, backend=backend, lora=lora, aux_layers=aux_layers, **more)
    return model(input_ids, positions, kv_cache, meta, backend=backend, lora=lora, **more), None


def plan_logits(runner, plan) -> torch.Tensor:
    """The logits [n, vocab] of plan.sample_rows, in the model's dtype: `runner.run_plan`'s own
    when the runner computes them (`returns_logits`: groups with vocab-parallel TP lanes, which
    gather them from the lanes), else the output head on the final hidden rows it returns."""
    out = runner.run_plan(plan)
    if getattr(runner, "returns_logits", False):
        return out
    return runner.model.compute_logits(out)


def execute_step(runner, out: SchedulerOutput) -> StepLogits:
    """What every runner's `execute` does: plan the step, run it, and turn the sampled rows into
    fp32 logits (`plan_logits`: the leader's output head, or the group's vocab-parallel lanes).
    Pooling requests' prefill rows are pooled on the way (`pool_prefills`)."""
    encoder = runner.image_encoder
    if encoder is not None:
        encode_images(encoder, out.prefills, runner.image_cache)
    plan, reqs, prompt, drafts = step_plan(out, runner.kv.block_tables, runner.kv.extra_group_tables)
    if plan.image_rows:
        drop_passed_images(out.prefills)
    pooling = any(req.pooling is not None for req, _ in out.prefills)
    # Pooling reads the step's final hidden states, kept as for an EAGLE head (every runner but
    # SPP's keeps them whole on the leader; the engine refuses pooling requests on the others).
    if pooling:
        kept, runner.keep_hidden = runner.keep_hidden, True
    try:
        if not plan.sample_rows:
            runner.run_plan(plan)
            logits = torch.empty((0, 0))
        else:
            logits = plan_logits(runner, plan).float()
    finally:
        if pooling:
            runner.keep_hidden = kept
    embeddings = pool_prefills(out.prefills, runner.last_hidden) if pooling else []
    if not plan.sample_rows or not prompt and not drafts:
        return StepLogits(logits=logits, requests=reqs, embeddings=embeddings)
    # Prompt and draft rows (at most a step's tokens of them) are split off the sampled ones.
    sampled = [i for i, r in enumerate(reqs) if r is not None]
    return StepLogits(logits=logits[sampled], requests=[reqs[i] for i in sampled],
                      prompt=[(p.request, p.first_position, logits[p.first_row:p.first_row + p.count])
                              for p in prompt],
                      drafts=[(d.request, logits[d.first_row:d.first_row + d.count]) for d in drafts],
                      embeddings=embeddings)


def pool_prefills(prefills: list[tuple[Request, int]], hidden: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
    """Fold each pooling request's chunk of `hidden` into its state (prefill rows come first in
    a step, in `out.prefills` order: raycluster.parallel.plan); the requests whose prompt this
    chunk completed, with their raw pooled vectors."""
    done = []
    first = 0
    for req, n in prefills:
        if req.pooling is not None:
            start = req.num_computed_tokens
            req.pool_state = pool_chunk(req.pool_state, req.pooling, hidden[first:first + n], start)
            if start + n == req.num_prompt_tokens:
                done.append((req, pooled(req.pool_state, req.pooling, req.num_prompt_tokens)))
                req.pool_state = None
        first += n
    return done
