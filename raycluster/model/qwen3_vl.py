"""Qwen3-VL's and Qwen3-VL-MoE's image encoder (transformers 5.24's `get_image_features` of
`Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration`: the same tower), in the
common form the engine calls (raycluster.model.llava, raycluster.model.qwen_vl): `image_token_id`,
`grid` (raycluster.model.qwen_vl_processor's `QwenVLGrid`), `tokens_for((height, width))`,
`grid_for((height, width))`, `check_pixels(pixels, (height, width))`, `encode_images([(pixels,
(height, width)), ...])`, plus `deepstack_levels`.

`Qwen3VLImageEncoder(config, pixel_limits)` reads config.json (the tower from `vision_config`:
raycluster.model.qwen3_vision; the text hidden size from `text_config`) and the processor's pixel
limits (an image's token count depends on the size it is resized to). Pixels enter as the
processor's rows, [t * h * w patches, C * T * P * P] per image; every image of a call goes through
the tower at once (attention stays within each image). Each image leaves as ONE tensor
[tokens_for(size), (1 + deepstack_levels) * text hidden] in the encoder's dtype: columns
[0, H) the merger's features (what replaces the image's placeholders in the input embeddings),
then [H (1 + k), H (2 + k)) DeepStack level k, which transformers' `_deepstack_process` adds to
the hidden states after decoder layer k at the image's placeholder positions. One row per token
keeps the levels with their token through the engine's bookkeeping.

Everything but the tower is raycluster.model.qwen_vl's `QwenVLImageEncoder` (the grid, the pixel
checks, `from_checkpoint` reading the tower's tensors from under `model.visual.`, the released
files' and transformers 5's layout, or `visual.`).
"""

from __future__ import annotations

import torch
from torch import nn

from raycluster.model.qwen3_vision import Qwen3VisionSpec, Qwen3VisionTower
from raycluster.model.qwen_vl import QwenVLImageEncoder

# Architectures whose tower this is (Qwen3-VL-MoE's vision model is Qwen3-VL's, module for module).
ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")


class Qwen3VLImageEncoder(QwenVLImageEncoder):
    """Qwen-VL's encoder over Qwen3-VL's tower (module docstring)."""

    NAME = "Qwen3-VL"
    takes_video = False         # its videos interleave timestamps with the frames: not served here
    takes_embeds = False        # its outputs carry DeepStack levels beside the embeddings

    def __init__(self, config: dict, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.deepstack_levels: int = len(self.visual.spec.deepstack)

    @staticmethod
    def _tower(config: dict) -> tuple[nn.Module, Qwen3VisionSpec, str]:
        archs = config.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"config field 'architectures' = {archs!r} names no Qwen3-VL model "
                             f"({', '.join(ARCHITECTURES)})")
        spec = Qwen3VisionSpec.from_config(config.get("vision_config"))
        return Qwen3VisionTower(spec), spec, "out_hidden_size"

    def _features(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Per image token, the merger's features then each DeepStack level (module docstring)."""
        merged, levels = self.visual(pixels, grids)
        return torch.cat([merged, *levels], dim=-1)
