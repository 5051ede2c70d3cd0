"""Images in the simulator: requests that carry pictures, and the encoder time of the steps that
encode them.

The load is the load generator's (`--images K --distinct-images N`, loadgen.images): K pictures per
request, drawn from a pool of N by a hash of the request id (`image_indices`, the rule
`loadgen run` sends by), laid before the prompt's text as LLaVA's template lays a turn out. Each
picture takes the spec's vision tower's `tokens` placeholders (a fixed-size tower: the picture's
size does not change them). A simulated request carries them as the engine's `ImageInput`s (digest:
the picture's pool index), so the engine's own scheduler rules (the encoder budget, skipping what
the encoder cache holds), prefix cache (blocks keyed on the digests) and encoder cache
(raycluster.engine.image_inputs.encode_images over `CountingEncoder`, which stands in for the
tower) decide what a step encodes; `VisionCost` (raycluster.sched.vision_cost) how long that takes,
added to the step's time. In place of pixels an `ImageInput` holds its token count.
"""

from __future__ import annotations

import torch

from loadgen.images import ImageLoad, image_indices
from raycluster.engine.image_inputs import EncoderCache, drop_passed_images, encode_images
from raycluster.request import ImageInput, Request
from raycluster.sched.vision_cost import VisionCost, VisionShape

IMAGE_TOKEN = 2          # the placeholders' token id (the simulator's prompts hold PROMPT_TOKEN = 1)


class CountingEncoder:
    """The image encoder as `encode_images` calls it: counts the images it is asked to encode
    and gives each a zero-width row per token (what the encoder cache sizes entries by)."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode_images(self, items: list[tuple[int, tuple[int, int]]]) -> list[torch.Tensor]:
        self.encoded += len(items)
        return [torch.empty((tokens, 0)) for tokens, _ in items]


def request_images(request_id: str, load: ImageLoad, shape: VisionShape) -> tuple[list[int], list[ImageInput]]:
    """(placeholder token ids, `ImageInput`s) of a request's pictures, laid from prompt position 0."""
    images = [ImageInput(offset=j * shape.tokens, length=shape.tokens, pixel_values=shape.tokens,
                         digest=b"sim-image:%d" % i, size=(load.height, load.width))
              for j, i in enumerate(image_indices(request_id, load.per_request, load.distinct))]
    return [IMAGE_TOKEN] * (shape.tokens * len(images)), images


class StepImages:
    """One instance's encoder: what its steps encode (the engine's own code and caches) and the
    time that takes."""

    def __init__(self, cost: VisionCost, encoder_cache_tokens: int) -> None:
        self.cost = cost
        self.encoder = CountingEncoder()
        self.cache = EncoderCache(encoder_cache_tokens) if encoder_cache_tokens > 0 else None

    def step_time(self, prefills: list[tuple[Request, int]]) -> float:
        """Encode what the step's prefill chunks reach (marking it on the requests, as the engine
        does before its forward pass) and return the seconds that costs."""
        if not any(req.sampling.images for req, _ in prefills):
            return 0.0
        before = self.encoder.encoded
        encode_images(self.encoder, prefills, self.cache)
        drop_passed_images(prefills)
        return self.cost.time(self.encoder.encoded - before)
