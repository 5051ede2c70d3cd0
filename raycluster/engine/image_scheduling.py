"""The scheduler's rules for prompts with images, applied to the packer's chunks after it planned
a step (raycluster.engine.scheduler): whatever policy and packer chose the chunks, these only
shorten a chunk, lengthen one to an image's end, or send a request back to the policy to wait.

- `within_encoder_budget`: a step encodes at most `budget` image tokens (vLLM's
  max_num_encoder_input_tokens). A chunk ends before the first image it reaches that is not
  encoded yet and does not fit what is left; an image the encoder cache holds costs nothing.
- `whole_spans`: a chunk never ends inside one of its request's bidirectional spans (Gemma 3's
  images, whose tokens attend each other both ways: vLLM's disable_chunked_mm_input).
"""

from __future__ import annotations

from collections.abc import Container

from raycluster.request import Request
from raycluster.sched.base import KVAllocator, Policy


def image_rules(prefills: list[tuple[Request, int]], encoder_budget: int | None, alloc: KVAllocator,
                policy: Policy, cached: Container[bytes] = ()) -> list[tuple[Request, int]]:
    """`within_encoder_budget` (None: no budget), then `whole_spans`, each where a chunk needs it."""
    if encoder_budget is not None and any(req.sampling.images for req, _ in prefills):
        prefills = within_encoder_budget(prefills, encoder_budget, policy, cached)
    if any(req.bidirectional_spans for req, _ in prefills):
        prefills = whole_spans(prefills, alloc, policy)
    return prefills


def within_encoder_budget(prefills: list[tuple[Request, int]], budget: int, policy: Policy,
                          cached: Container[bytes] = ()) -> list[tuple[Request, int]]:
    """The chunks, each ending before the first image it reaches that is not encoded yet (on its
    request, or by digest in `cached`: the encoder cache) and would take the step past `budget`
    image tokens. A chunk left empty waits, back in `policy`."""
    kept = []
    for req, n in prefills:
        start = req.num_computed_tokens
        end = start + n
        for k, image in enumerate(req.sampling.images):
            if k in req.image_embeds or image.offset + image.length <= start or image.offset >= end:
                continue
            if image.embeds or image.digest in cached:      # nothing to encode
                continue
            if image.length > budget:
                end = max(start, image.offset)
                break
            budget -= image.length
        if end > start:
            kept.append((req, end - start))
        else:
            policy.push(req)
    return kept


def whole_spans(prefills: list[tuple[Request, int]], alloc: KVAllocator, policy: Policy) -> list[tuple[Request, int]]:
    """The chunks with none ending inside a bidirectional span of its request: such a chunk ends
    where the span begins, or, when it starts at or inside the span, runs on to the span's end
    (a step may then pass its token budget by less than one image; `alloc` reserves the KV). A
    request whose longer chunk finds no KV waits, back in `policy`."""
    kept = []
    for req, n in prefills:
        start = req.num_computed_tokens
        end = start + n
        for a, b in req.bidirectional_spans:
            if a < end < b:
                end = a if a > start else b
                break
        if end > start + n and not alloc.try_allocate(req, end - start):
            policy.push(req)
            continue
        kept.append((req, end - start))
    return kept
