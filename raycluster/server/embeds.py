"""Chat requests' precomputed image embeddings (vLLM's `image_embeds` parts, served with
`--enable-mm-embeds`): base64 of a `torch.save`d float tensor [tokens, hidden] (or [1, tokens,
hidden]), what the checkpoint's image encoder would give for one image; on Qwen-VL, vLLM's
mapping of that (`image_embeds`) and the image's patch grid (`image_grid_thw`, base64 of
torch.save of [t, h, w]), which lays out its rotary positions.

`decode_embeds(payload)` reads them with `torch.load(weights_only=True)` (plain tensors only, no
code runs), bounded in bytes; the engine then checks the width against the encoder's and splices
the rows over the image's placeholders without running the encoder (raycluster.engine.image_inputs).
"""

from __future__ import annotations

import base64
import binascii
import io

import torch

MAX_EMBEDS_BYTES = 64 * 2 ** 20          # one image's encoded embeddings


def decode_embeds(payload) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """(the float32 [tokens, hidden] embeddings, the (t, h, w) patch grid given with them or None)
    of a part's payload; ValueError saying what is wrong."""
    if isinstance(payload, dict):
        extra = sorted(set(payload) - {"image_embeds", "image_grid_thw"})
        if extra or "image_embeds" not in payload or "image_grid_thw" not in payload:
            raise ValueError(f"the mapping form holds image_embeds and image_grid_thw (Qwen-VL's), got "
                             f"{sorted(payload)}")
        grid = _load(payload["image_grid_thw"], "image_grid_thw")
        if grid.is_floating_point() or grid.numel() != 3 or (grid <= 0).any():
            raise ValueError(f"image_grid_thw must be 3 positive ints [t, h, w], got {grid.tolist()}")
        return _embeddings(payload["image_embeds"]), tuple(int(v) for v in grid.flatten())
    return _embeddings(payload), None


def _load(payload, what: str) -> torch.Tensor:
    if not isinstance(payload, str) or len(payload) * 3 // 4 > MAX_EMBEDS_BYTES:
        raise ValueError(f"{what}: expected base64 of torch.save(tensor) of at most {MAX_EMBEDS_BYTES} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: the payload is not base64") from None
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:        # torch raises pickle / zip / runtime errors for what is not a saved tensor
        raise ValueError(f"{what}: not a torch.save'd tensor: {e}") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(tensor).__name__}")
    return tensor


def _embeddings(payload) -> torch.Tensor:
    tensor = _load(payload, "image_embeds")
    if not tensor.is_floating_point():
        raise ValueError(f"image_embeds: expected a float tensor, got one of {tensor.dtype}")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] < 1:
        raise ValueError(f"image_embeds: expected a tensor [tokens, hidden], got shape {tuple(tensor.shape)}")
    if not torch.isfinite(tensor).all():
        raise ValueError("image_embeds: the embeddings hold NaN or infinite values")
    return tensor.float().contiguous()
