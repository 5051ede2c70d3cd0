"""Chat requests' precomputed image embeddings (vLLM's `image_embeds` parts, served with
`--enable-mm-embeds`): base64 of a `torch.save`d float tensor [tokens, hidden] (or [1, tokens,
hidden]), what the checkpoint's image encoder would give for one image.

`decode_embeds(payload)` reads one with `torch.load(weights_only=True)` (plain tensors only, no
code runs), bounded in bytes; the engine then checks its width against the encoder's and splices
it over the image's placeholders without running the encoder (raycluster.engine.image_inputs).
Qwen-VL's form, a mapping of `image_embeds` and `image_grid_thw`, is refused: its rotary layout
would need the grid carried beside the embeddings.
"""

from __future__ import annotations

import base64
import binascii
import io

import torch

MAX_EMBEDS_BYTES = 64 * 2 ** 20          # one image's encoded embeddings


def decode_embeds(payload) -> torch.Tensor:
    """The float32 [tokens, hidden] tensor `payload` holds; ValueError saying what is wrong."""
    if isinstance(payload, dict):
        raise ValueError("the {image_embeds, image_grid_thw} form (Qwen-VL's) is not served here; give the "
                         "embeddings tensor itself, base64 of torch.save(tensor)")
    if not isinstance(payload, str) or len(payload) * 3 // 4 > MAX_EMBEDS_BYTES:
        raise ValueError(f"expected base64 of torch.save(tensor) of at most {MAX_EMBEDS_BYTES} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the payload is not base64") from None
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:        # torch raises pickle / zip / runtime errors for what is not a saved tensor
        raise ValueError(f"not a torch.save'd tensor: {e}") from None
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"expected a float tensor, got {type(tensor).__name__}"
                         + (f" of {tensor.dtype}" if isinstance(tensor, torch.Tensor) else ""))
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] < 1:
        raise ValueError(f"expected a tensor [tokens, hidden], got shape {tuple(tensor.shape)}")
    if not torch.isfinite(tensor).all():
        raise ValueError("the embeddings hold NaN or infinite values")
    return tensor.float().contiguous()
