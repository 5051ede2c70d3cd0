"""A prompt's images inside the engine: checked on arrival, encoded when a prefill chunk first
reaches them, and spliced into the step's input embeddings.

A request's images arrive on `SamplingParams.images` (`ImageInput`s: pixels plus the run of
placeholder tokens they replace, which the gateway laid out). `check_images` refuses what the
engine cannot serve. Before a step runs, `encode_images` runs the image encoder once over every
image a prefill chunk of the step overlaps and has no embeddings for yet, keeping the output on
the request (`Request.image_embeds`) so later chunks of the same prompt slice it instead of
encoding again (vLLM's encoder cache, per request). `image_rows` gives the step plan the
(row, embeddings) pieces that replace the placeholder tokens' embeddings, and
`drop_passed_images` frees an image's embeddings once the prefill is past it. A preempted
request recomputes: its images are encoded again, unless the engine's `EncoderCache` (by the
images' digests, across requests) still holds them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from raycluster.engine.outputs import InvalidRequestError
from raycluster.model.mrope import MRopeLayout
from raycluster.request import ImageInput, Request, SamplingParams


def check_images(ids: list[int], sp: SamplingParams, encoder) -> None:
    """Raise InvalidRequestError unless the prompt's images fit `encoder` (None: this engine takes
    no images) and lie on runs of its image token."""
    if not sp.images:
        return
    if encoder is None:
        raise InvalidRequestError("messages", "this model takes no images (it has no vision tower to encode them)")
    end = 0
    for k, image in enumerate(sp.images):
        if not isinstance(image.pixel_values, torch.Tensor):
            raise InvalidRequestError("messages", f"image {k}'s pixels are not a tensor")
        if image.embeds:
            _check_embeds(k, image, encoder, ids)
            end = image.offset + image.length
            continue
        if len(image.size) == 3 and not getattr(encoder, "takes_video", False):
            raise InvalidRequestError("messages", "this model takes no videos (video_url parts need Qwen2-VL, "
                                      "Qwen2.5-VL or LLaVA-OneVision)")
        why = encoder.check_pixels(image.pixel_values, image.size)
        if why is not None:
            raise InvalidRequestError("messages", f"image {k}: {why}")
        n = encoder.tokens_for(image.size)
        if image.length != n:
            raise InvalidRequestError("messages", f"image {k} holds {image.length} placeholder tokens, "
                                      f"the encoder makes {n}")
        if image.offset < end or image.offset + image.length > len(ids):
            raise InvalidRequestError("messages", f"image {k} at {image.offset} overlaps another or leaves the prompt")
        if ids[image.offset:image.offset + image.length] != span_ids(encoder, image.size):
            raise InvalidRequestError("messages", f"image {k}'s positions do not hold its placeholder tokens")
        end = image.offset + image.length
    marks = {"image": encoder.image_token_id, "video": getattr(encoder, "video_token_id", None)}
    for kind, token in marks.items():
        if token is not None and ids.count(token) != sum(placeholders(encoder, im).count(token) for im in sp.images):
            raise InvalidRequestError("messages", f"the prompt holds {kind} tokens that no {kind} fills")


def _check_embeds(k: int, image: ImageInput, encoder, ids: list[int]) -> None:
    """InvalidRequestError unless image `k`'s given embeddings can stand for an encoder output here."""
    if not getattr(encoder, "takes_embeds", False):
        raise InvalidRequestError("messages", "image embeddings are served on LLaVA, LLaVA-NeXT, LLaVA-OneVision, "
                                  "Gemma 3, Qwen2-VL and Qwen2.5-VL here (this model lays an image out by its size, "
                                  "or adds more than the embeddings)")
    if getattr(encoder, "grid_for", None) is not None:
        # Qwen-VL: the grid given with the embeddings (as the size whose grid it is) lays out the
        # rotary positions; it must be one the processor makes.
        if tuple(image.size) == (0, 0):
            raise InvalidRequestError("messages", f"image {k}: Qwen-VL's embeddings come with their image_grid_thw")
        why = encoder.grid.check(image.size)
        if why is not None or encoder.grid.resized(tuple(image.size)) != tuple(image.size):
            raise InvalidRequestError("messages", f"image {k}: its image_grid_thw is not a grid this model's "
                                      "processor makes (multiples of the merge size within its pixel limits)")
        rows = encoder.tokens_for(image.size)
    else:
        # A fixed count (LLaVA-1.5's, Gemma 3's) is the count; tiled layouts' counts vary by image.
        rows = getattr(encoder, "tokens_per_image", None) or image.length
    want = (rows, encoder.text_hidden_size)
    if tuple(image.pixel_values.shape) != want or image.length != rows or not image.pixel_values.is_floating_point():
        raise InvalidRequestError("messages", f"image {k}'s embeddings are {tuple(image.pixel_values.shape)}; "
                                  f"this model's are [{rows if rows != image.length else 'tokens'}, "
                                  f"{encoder.text_hidden_size}] floats")
    if image.offset < 0 or image.offset + image.length > len(ids) or \
            ids[image.offset:image.offset + image.length] != placeholders(encoder, image):
        raise InvalidRequestError("messages", f"image {k}'s positions do not hold its placeholder tokens")


def placeholders(encoder, image: ImageInput) -> list[int]:
    """The prompt tokens an image takes: its span (`span_ids`), or for given embeddings the image
    token once per row."""
    return [encoder.image_token_id] * image.length if image.embeds else span_ids(encoder, image.size)


def check_request_images(ids: list[int], sp: SamplingParams, encoder, encoder_budget: int | None) -> None:
    """`check_images`, then `check_encoder_budget` under a budget (None: unbounded)."""
    check_images(ids, sp, encoder)
    if sp.images and encoder_budget is not None:
        check_encoder_budget(sp, encoder_budget)


def request_image_fields(sp: SamplingParams, encoder, runner, mrope: bool, max_chunk: int) -> dict:
    """The Request fields a prompt's images set: on a model with multimodal RoPE (`mrope`: Qwen-VL)
    its positions' layout (raycluster.model.mrope), its bidirectional spans, each image's
    feature runs."""
    if not sp.images:
        return {"mrope": None, "bidirectional_spans": (), "image_runs": []}
    layout = MRopeLayout([(im.offset, im.length, encoder.grid_for(im.size)) for im in sp.images],
                         tuple(encoder.time_step_for(im.size) for im in sp.images)) if mrope else None
    return {"mrope": layout, "bidirectional_spans": bidirectional_spans(sp, encoder, runner, max_chunk),
            "image_runs": feature_runs(encoder, sp)}


def check_encoder_budget(sp: SamplingParams, budget: int) -> None:
    """InvalidRequestError for an image longer than a step may encode (it would never be scheduled)."""
    for k, image in enumerate(sp.images):
        if image.length > budget and not image.embeds:
            raise InvalidRequestError("messages", f"image {k} holds {image.length} tokens, more than a step may encode "
                                      f"({budget}: max_num_encoder_tokens)")


def span_ids(encoder, size: tuple[int, int]) -> list[int]:
    """The prompt tokens of an image of `size`: the image token, repeated, or (Mistral 3) rows of
    it between break tokens (the encoder's `span_ids`)."""
    spans = getattr(encoder, "span_ids", None)
    return spans(size) if spans is not None else [encoder.image_token_id] * encoder.tokens_for(size)


def feature_runs(encoder, sp: SamplingParams) -> list[list[tuple[int, int]]]:
    """Per image, the [start, end) runs of its span its features fill (Request.image_runs): the
    whole span, or (Mistral 3, the encoder's `feature_runs`) the rows between break tokens."""
    runs = getattr(encoder, "feature_runs", None)
    return [[(0, im.length)] if runs is None else list(runs(im.size)) for im in sp.images]


def bidirectional_spans(sp: SamplingParams, encoder, runner, max_chunk: int) -> tuple[tuple[int, int], ...]:
    """The prompt spans of `sp`'s images when `encoder`'s model attends inside an image both ways
    (Gemma 3: Request.bidirectional_spans), else (); InvalidRequestError where `runner` cannot
    run them or an image is longer than a step may hold (it is computed in one step)."""
    if not sp.images or encoder is None or not encoder.bidirectional:
        return ()
    if not runner.runs_bidirectional_spans:
        raise InvalidRequestError("messages", f"this model's images attend both ways inside an image, which a "
                                  f"{runner.layout} group does not run (serve it on one process, or a tp or spp group)")
    for k, image in enumerate(sp.images):
        if image.length > max_chunk:
            raise InvalidRequestError("messages", f"image {k} holds {image.length} tokens, more than a step's "
                                      f"{max_chunk} (max_num_batched_tokens); each image is computed in one step")
    return tuple((image.offset, image.offset + image.length) for image in sp.images)


def _overlapping(req: Request, start: int, n: int):
    """(index, image) of the request's images with a placeholder in prompt positions [start, start + n)."""
    for k, image in enumerate(req.sampling.images):
        if image.offset < start + n and start < image.offset + image.length:
            yield k, image


class EncoderCache:
    """The image encoder's outputs of recent images by digest (pixels and size), least recently
    used first out, at most `capacity` image tokens: the same image in another prompt (another
    system prompt, another user's question) is not encoded again (vLLM's encoder cache). The
    prefix cache already covers the same image after the same tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = 0
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        """Whether the cache holds the image (no lookup counted, no recency changed): the
        scheduler's question, the step's encode_images then takes it."""
        return digest in self._entries

    def get(self, digest: bytes) -> torch.Tensor | None:
        e = self._entries.get(digest)
        if e is None:
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return e

    def put(self, digest: bytes, e: torch.Tensor) -> None:
        if digest in self._entries or e.shape[0] > self.capacity:
            return
        self._entries[digest] = e
        self.tokens += e.shape[0]
        while self.tokens > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.shape[0]


def encode_images(encoder, prefills: list[tuple[Request, int]], cache: EncoderCache | None = None) -> None:
    """Encode, in one batch, every image the step's prefill chunks reach that has no
    embeddings on its request yet and none in `cache`."""
    todo: list[tuple[Request, int, ImageInput]] = [
        (req, k, image) for req, n in prefills if req.sampling.images
        for k, image in _overlapping(req, req.num_computed_tokens, n) if k not in req.image_embeds]
    for req, k, image in todo:          # given embeddings stand for the encoder's output
        if image.embeds:
            req.image_embeds[k] = image.pixel_values.to(encoder.device, encoder.dtype)
    todo = [(req, k, image) for req, k, image in todo if k not in req.image_embeds]
    if cache is not None:
        for req, k, image in todo:
            e = cache.get(image.digest)
            if e is not None:
                req.image_embeds[k] = e
        todo = [(req, k, image) for req, k, image in todo if k not in req.image_embeds]
    if not todo:
        return
    embeds = encoder.encode_images([(image.pixel_values, image.size) for _, _, image in todo])
    for (req, k, image), e in zip(todo, embeds):
        req.image_embeds[k] = e
        if cache is not None:
            cache.put(image.digest, e)


def image_rows(req: Request, start: int, n: int, first_row: int) -> list[tuple[int, torch.Tensor]]:
    """The pieces of `req`'s image embeddings that a chunk of prompt positions [start, start + n),
    laid out from step row `first_row`, puts in place of its placeholder tokens' embeddings."""
    out = []
    for k, image in _overlapping(req, start, n):
        for a, b in req.image_runs[k] if req.image_runs else [(0, image.length)]:
            lo, hi = max(start, image.offset + a), min(start + n, image.offset + b)
            if lo < hi:
                out.append((first_row + lo - start, req.image_embeds[k][lo - image.offset:hi - image.offset]))
    return out


def drop_passed_images(prefills: list[tuple[Request, int]]) -> None:
    """Free the embeddings of images that end within the chunks just run (before the requests'
    computed counts advance past them)."""
    for req, n in prefills:
        for k, image in enumerate(req.sampling.images):
            if k in req.image_embeds and image.offset + image.length <= req.num_computed_tokens + n:
                del req.image_embeds[k]

