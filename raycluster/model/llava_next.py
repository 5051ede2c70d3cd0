"""LLaVA-NeXT's image side (transformers 5.24's `LlavaNextModel.get_image_features` with its
`pack_image_features`): an image's squares (the base, then its tiles; raycluster.model.anyres)
through the CLIP tower and projector (raycluster.model.llava_tower) to [squares, side * side, text
hidden]; then the base square's features, followed by the tiles' features laid on one grid, cropped
back to the image's aspect ratio and each row ended by the learned `image_newline`.

Pixels and each image's original (height, width) enter `encode_images([(pixels [1 + tiles, 3, S,
S], (height, width)), ...])`; every image's squares run through the tower in one batch, and each
image's features leave as [tokens_for((height, width)), text hidden] in the encoder's dtype, the
text model putting them, in order, at its `image_token_id` placeholders. Weights as LLaVA's
(raycluster.model.llava_tower), plus `image_newline` (released files) or `model.image_newline`
(transformers 5's layout). Only the "default" feature strategy (CLS dropped) is served:
transformers' packing reshapes each tile's features as a square grid, which "full"'s CLS breaks.
"""

from __future__ import annotations

import torch
from torch import nn

from raycluster.model.anyres import AnyresGrid, check_image_size
from raycluster.model.llava_tower import ClipProjectorEncoder, check_items, pack_each, shape_reason

ARCHITECTURE = "LlavaNextForConditionalGeneration"


class LlavaNextImageEncoder(ClipProjectorEncoder):
    """The tower, projector and anyres packing (module docstring)."""

    EXTRA_TENSORS = {"image_newline": ("image_newline", "model.image_newline")}

    def __init__(self, config: dict, text_hidden: int):
        super().__init__(config, text_hidden)
        if self.select_strategy != "default":
            raise ValueError(f"config field 'vision_feature_select_strategy' = {self.select_strategy!r}: LLaVA-NeXT "
                             "packs only the 'default' strategy's features (transformers' too)")
        self.grid = AnyresGrid.from_config(config)
        self.image_newline = nn.Parameter(torch.empty(text_hidden))

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The features an image of (height, width) becomes."""
        return self.grid.tokens_for(image_size)

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are what the processor makes of an image of `image_size`, else why not."""
        reason = check_image_size(image_size)
        if reason is not None:
            return reason
        t = self.vision_tower
        return shape_reason(pixel_values, (self.grid.num_tiles(tuple(image_size)) + 1, t.num_channels, t.image_size,
                                           t.image_size), image_size)

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's features [tokens_for(size), text hidden] (module docstring); ValueError for
        pixels that do not fit their size."""
        check_items(self, items)
        if not items:
            return []
        return pack_each(self.tile_features(torch.cat([torch.as_tensor(p) for p, _ in items])), items, self._pack)

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's square features [1 + tiles, side * side, hidden] -> its packed features."""
        rows, cols = self.grid.grid_shape(image_size)
        side, hidden = self.grid.side, features.shape[-1]
        # Tile (r, c)'s feature (i, j) lands at grid row r * side + i, column c * side + j.
        grid = features[1:].view(rows, cols, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, cols * side, hidden)
        row_slice, col_slice = self.grid.kept(image_size)
        grid = grid[row_slice, col_slice]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, hidden)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])
