"""Llama 4's image encoder (transformers 5.24's `Llama4ForConditionalGeneration`: its
`get_image_features` and `multi_modal_projector` as its forward applies them; Llama 4 Scout /
Maverick): the tower of raycluster.model.llama4_vision and the projector, in the common form the
engine calls (raycluster.model.llava), plus the layout of an image's span in the prompt.

The chat template writes one "<|image|>" per image (processor_config.json's `image_token`: the
placeholder, `placeholder_token_id`); Llama4Processor expands it to the image's span, which starts
with "<|image_start|>" and ends with "<|image_end|>" (both in the span): with one tile,
<|image_start|> <|image|> <|patch|> x T <|image_end|>; with rows x columns tiles, for each row each
tile's <|patch|> x T with <|tile_x_separator|> between tiles and <|tile_y_separator|> after the
row, then <|image|> <|patch|> x T for the global tile and <|image_end|> (T = tokens per tile; the
span holds its own "<|image|>", so a server expands each placeholder once, without rescanning).
`tokens_for((height, width))` is the span's length, `span_ids(size)` its ids, `feature_runs(size)`
the [start, end) runs (one per tile, row-major, the global tile's last) that the features fill: the
<|patch|> positions, where transformers' masked_scatter puts the projected features in order
(`image_token_id` is config.json's `image_token_index`: the <|patch|> token; `span_tokens` has all
six ids). `encode_images([(pixels, (height, width)), ...])` gives per image ONE [tokens_for(size),
text hidden] tensor in the encoder's dtype: the features at the runs, zero rows elsewhere (the
engine keeps those tokens' embeddings). The text model attends causally (`bidirectional` False:
Llama4TextModel's masks are causal, chunked on its RoPE layers, with no image exception). Pixels are
the processor's (raycluster.model.llama4_processor): [tiles, 3, S, S], all images' tiles through
the tower in one batch.

`Llama4ImageEncoder(config, text_hidden=None, span_tokens=None, placeholder_token_id=None,
max_patches=16, resize_to_max_canvas=False)` validates config.json (errors: ValueError naming the
field): `vision_config` (raycluster.model.llama4_vision), `image_token_index` (200092, which must be
the tokenizer's <|patch|>), the text config's `hidden_size`; the tiling fields are the processor's.
Llama4Config has no ids for <|image|> or the separators: Llama4Processor writes those literal tokens,
so `for_model_dir(path)` finds all six in tokenizer.json (raycluster.model.llama4_processor's
`span_tokens_of`) and takes the tiling from preprocessor_config.json (its grid must equal the
tower's: tile = vision_config.image_size, the same tokens per tile); it builds the encoder with no
weights read (under torch.device("meta") it answers the prompt-side calls). `from_checkpoint(path,
dtype, device)` also reads the tower under the released `vision_model.` (which transformers 5.24
also saves) or `model.vision_model.`, the projector under `multi_modal_projector.` or
`model.multi_modal_projector.`, from model.safetensors or its shards
(raycluster.model.checkpoint_files).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from raycluster.model.checkpoint_files import (check_projection, copy_whole, read_prefixed, stored_prefixes,
                                               tower_and_projector)
from raycluster.model.llama4_processor import Llama4Grid, Llama4ImageProcessor, SpanTokens, span_tokens_of
from raycluster.model.llama4_vision import Llama4VisionModel, Llama4VisionSpec
from raycluster.model.llava_tower import check_items, read_config, shape_reason
from raycluster.model.multimodal_config import text_config_of

ARCHITECTURE = "Llama4ForConditionalGeneration"
_TOWER_PREFIXES = ("vision_model.", "model.vision_model.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_TOWER_KEY, _PROJECTOR_KEY = "patch_embedding.linear.weight", "linear_1.weight"
_DEFAULT_IMAGE_TOKEN = 200092       # Llama4Config's image_token_index: "<|patch|>"
# Llama4ImageProcessor's tiling defaults (a checkpoint without preprocessor_config.json).
_DEFAULT_MAX_PATCHES, _DEFAULT_MAX_CANVAS = 16, False


class Llama4Projector(nn.Module):
    """Llama4MultiModalProjector: one linear to the text hidden size, no bias."""

    def __init__(self, vision_output_dim: int, text_hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(vision_output_dim, text_hidden, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_1(features)


class Llama4ImageEncoder(nn.Module):
    """The tower, projector and prompt span of Llama 4's images (module docstring)."""

    ARCHITECTURE = ARCHITECTURE
    bidirectional = False       # the text model attends an image's tokens causally

    def __init__(self, config: dict, text_hidden: int | None = None, span_tokens: SpanTokens | None = None,
                 placeholder_token_id: int | None = None, max_patches: int = _DEFAULT_MAX_PATCHES,
                 resize_to_max_canvas: bool = _DEFAULT_MAX_CANVAS):
        super().__init__()
        spec = Llama4VisionSpec.from_config(config.get("vision_config"))
        _, text = text_config_of(ARCHITECTURE, config, ValueError)
        if text_hidden is None:
            text_hidden = text.get("hidden_size")
            if not isinstance(text_hidden, int) or isinstance(text_hidden, bool) or text_hidden <= 0:
                raise ValueError(f"config field 'text_config.hidden_size' = {text_hidden!r}: expected a positive int")
        name = "image_token_index" if config.get("image_token_index") is not None else "image_token_id"
        image_token = config.get(name, _DEFAULT_IMAGE_TOKEN)
        if not isinstance(image_token, int) or isinstance(image_token, bool) or image_token < 0:
            raise ValueError(f"config field {name!r} = {image_token!r}: expected an int >= 0")
        if span_tokens is None:
            raise ValueError("Llama 4's image span token ids are not given (Llama4ImageEncoder.for_model_dir finds "
                             "them in the checkpoint's tokenizer)")
        if span_tokens.patch != image_token:
            raise ValueError(f"config field {name!r} = {image_token} is not the tokenizer's '<|patch|>' "
                             f"({span_tokens.patch}), where Llama4Processor puts the image features")
        self.vision_model = Llama4VisionModel(spec)
        self.multi_modal_projector = Llama4Projector(spec.vision_output_dim, text_hidden)
        self.grid = Llama4Grid(spec.image_size, max_patches, resize_to_max_canvas, spec.tokens_per_tile)
        self.span_tokens: SpanTokens = span_tokens
        self.image_token_id: int = image_token
        self.placeholder_token_id: int = span_tokens.image if placeholder_token_id is None else placeholder_token_id
        self.image_start_token_id, self.image_end_token_id = span_tokens.image_start, span_tokens.image_end
        self.tile_x_separator_token_id = span_tokens.tile_x_separator
        self.tile_y_separator_token_id = span_tokens.tile_y_separator
        self.text_hidden_size: int = text_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The image's span length, its start / end / separators / <|image|> included."""
        return self.grid.tokens_for(image_size)

    def span_ids(self, image_size: tuple[int, int]) -> list[int]:
        """The span's token ids in order, as Llama4Processor expands the template's "<|image|>"."""
        return self.grid.span_ids(image_size, self.span_tokens)

    def feature_runs(self, image_size: tuple[int, int]) -> list[tuple[int, int]]:
        """[start, end) of each tile's <|patch|> run within the span (relative to its start)."""
        return self.grid.feature_runs(image_size)

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are what the processor makes of an image of `image_size`, else why not."""
        try:
            tiles = self.grid.tiles_for(image_size)
        except ValueError as e:         # an image of no pixel: the reason, as for pixels that do not fit
            return str(e)
        s = self.vision_model.spec
        return shape_reason(pixel_values, (tiles, s.num_channels, s.image_size, s.image_size), image_size)

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's [tokens_for(size), text hidden] span (module docstring), all images' tiles
        through the tower at once; ValueError naming the first image whose pixels do not fit its size."""
        check_items(self, items)
        if not items:
            return []
        tiles = torch.cat([torch.as_tensor(p).to(self.device, self.dtype) for p, _ in items])
        features = self.multi_modal_projector(self.vision_model(tiles))        # [tiles, T, text hidden]
        out = []
        for feats, (_, size) in zip(features.split([len(p) for p, _ in items]), items):
            span = feats.new_zeros(self.tokens_for(size), self.text_hidden_size)
            for (a, b), tile in zip(self.feature_runs(size), feats):       # the other rows stay zero
                span[a:b] = tile
            out.append(span)
        return out

    @classmethod
    def stores_tower(cls, path: str | os.PathLike) -> bool:
        """Whether the checkpoint's files hold the Llama 4 tower (else it is served on its text)."""
        return tensor_prefixes(os.fspath(path))[0] is not None

    @classmethod
    def for_model_dir(cls, model_dir: str | os.PathLike, text_hidden: int | None = None) -> "Llama4ImageEncoder":
        """The encoder of a checkpoint directory's config.json, tokenizer and processor files
        (parameters uninitialized; build it under torch.device("meta") for the prompt-side calls).
        ValueError where the processor's tiles or tokens per tile are not the tower's, and for
        processor files the processor refuses."""
        path = os.fspath(model_dir)
        config = read_config(path)
        tokens, placeholder = span_tokens_of(path)
        processor = Llama4ImageProcessor.from_model_dir(path)
        tiling = (_DEFAULT_MAX_PATCHES, _DEFAULT_MAX_CANVAS) if processor is None else (
            processor.grid.max_patches, processor.grid.resize_to_max_canvas)
        encoder = cls(config, text_hidden, tokens, placeholder, *tiling)
        if processor is not None and processor.grid != encoder.grid:
            got, want = processor.grid, encoder.grid
            if got.tile_size != want.tile_size:
                raise ValueError(f"{path}: preprocessor_config.json's size {got.tile_size} is not config.json's "
                                 f"vision_config.image_size {want.tile_size} (Llama 4's tile)")
            raise ValueError(f"{path}: processor_config.json's patch_size and pixel_shuffle_ratio give "
                             f"{got.tokens_per_tile} tokens a tile, config.json's vision_config {want.tokens_per_tile}")
        return encoder

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Llama4ImageEncoder":
        path = os.fspath(model_dir)
        tower_prefix, projector_prefix = tower_and_projector(tensor_prefixes(path), path, "Llama 4 vision tower")
        with torch.device("meta"):
            encoder = cls.for_model_dir(path)
        projector = read_prefixed(path, projector_prefix)
        _check_projection(projector.get("linear_1.weight"), encoder)
        encoder.to_empty(device=device).to(dtype)
        loaded = {"vision_model." + k: v for k, v in read_prefixed(path, tower_prefix).items()}
        loaded.update({"multi_modal_projector." + k: v for k, v in projector.items()})
        copy_whole(dict(encoder.named_parameters()), loaded, path, "Llama 4 vision tower / projector", dtype)
        return encoder.eval()


def _check_projection(weight: torch.Tensor | None, encoder: Llama4ImageEncoder) -> None:
    """The stored linear_1 [text hidden, tower width] against the config (copy_whole names a missing one)."""
    if weight is not None:
        check_projection("multi_modal_projector.linear_1.weight", list(weight.shape), encoder.vision_model.spec.vision_output_dim,
                         encoder.text_hidden_size, "vision_config.vision_output_dim")


def tensor_prefixes(path: str) -> tuple[str | None, str | None]:
    """(tower prefix, projector prefix) of the stored names (None: not stored, or no readable weights)."""
    return stored_prefixes(path, (_TOWER_PREFIXES, _TOWER_KEY), (_PROJECTOR_PREFIXES, _PROJECTOR_KEY))
