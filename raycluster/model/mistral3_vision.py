"""Mistral 3's image encoder (transformers 5.24's `Mistral3Model.get_image_features`: Mistral Small
3.1 / 3.2, Ministral 3): the Pixtral tower (raycluster.model.pixtral_vision) and Mistral 3's
projector, in the common form the engine calls (raycluster.model.llava), plus the layout of an
image's span in the prompt.

An image takes ONE contiguous span of prompt tokens: for each row of merged patches, `[IMG]` once
per column then `[IMG_BREAK]`, the last row's break replaced by `[IMG_END]` (PixtralProcessor's
expansion of the text's "[IMG]"). `tokens_for((height, width))` is that span's length (breaks and
end included), `span_ids(size)` its token ids, `feature_runs(size)` the [start, end) runs of the
span (one per row) that hold image features, and `encode_images([(pixels, (height, width)), ...])`
gives per image ONE [tokens_for(size), text hidden] tensor in the encoder's dtype: the projector's
features in order at the runs (where transformers scatters them into the [IMG] positions), zero
rows at the break / end positions (the engine leaves those their token embeddings). The text
model attends causally (`bidirectional` False). (height, width) is the image's own size;
raycluster.model.pixtral_processor's `PixtralGrid` gives its resized size and grid.

`Mistral3ImageEncoder(config, text_hidden=None, break_token_id=None, end_token_id=None,
max_size=None)` validates config.json (errors: ValueError naming the field): `vision_config` (a
Pixtral tower), `spatial_merge_size` (2), `vision_feature_layer` (one int: the hidden state
transformers selects; a list is refused, Mistral 3's projector norms one layer's width),
`projector_hidden_act` (gelu), `multimodal_projector_bias` (false), `image_token_index` (10), the
text config's `hidden_size` and `rms_norm_eps` (the projector's norm; MistralConfig's default 1e-6,
Ministral3Config's 1e-5). Mistral3Config has no break / end token ids: PixtralProcessor takes them
from the tokenizer (`convert_tokens_to_ids` of its `image_break_token` / `image_end_token`,
"[IMG_BREAK]" / "[IMG_END]" unless processor_config.json names others), and so does
`token_ids_of(model_dir)` here (reading tokenizer.json); config.json's `image_break_token_id` /
`image_end_token_id`, where a config sets them, come first. `max_size` is the resize bound
(the processor's, from preprocessor_config.json's `size`; vision_config.image_size, which releases
set equal, when not given).
`for_model_dir(path)` builds the encoder from a checkpoint directory's files (no weights read: on
the meta device it only answers the prompt-side calls); `from_checkpoint(path, dtype, device)` also
reads the tower under the released `vision_tower.` or transformers 5's `model.vision_tower.`, the
projector under `multi_modal_projector.` or `model.multi_modal_projector.` (the text beside them
under `language_model.` / `model.language_model.`), from model.safetensors or its shards
(raycluster.model.checkpoint_files).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.checkpoint_files import (CheckpointError, check_projection, copy_whole, read_prefixed,
                                               stored_prefixes)
from raycluster.model.clip_vision import activation, hidden_state_index
from raycluster.model.llava_tower import check_items, read_config, shape_reason
from raycluster.model.multimodal_config import text_config_of
from raycluster.model.pixtral_processor import PixtralGrid, PixtralImageProcessor, processor_fields
from raycluster.model.pixtral_vision import PixtralVisionModel, PixtralVisionSpec, RMSNorm

ARCHITECTURE = "Mistral3ForConditionalGeneration"
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_TOWER_KEY, _PROJECTOR_KEY = "patch_conv.weight", "patch_merger.merging_layer.weight"
# Mistral3Config's default image token; the text models' default RMSNorm epsilons.
_DEFAULT_IMAGE_TOKEN = 10
_TEXT_EPS = {"Ministral3ForCausalLM": 1e-5}
_DEFAULT_TEXT_EPS = 1e-6


def _int_field(config: dict, name: str, default=None, minimum: int = 0) -> int:
    """config.json's `name` (`default` when unset or null); ValueError naming the field."""
    value = config.get(name) if config.get(name) is not None else default
    if value is None:
        raise ValueError(f"config field {name!r} is not set, nor given (Mistral3ImageEncoder.for_model_dir finds "
                         "the break / end token ids in the checkpoint's tokenizer)")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"config field {name!r} = {value!r}: expected an int >= {minimum}")
    return value


class PatchMerger(nn.Module):
    """Mistral3PatchMerger: each image's merge x merge blocks of patches, concatenated (F.unfold's
    order) and projected back to the tower's width; the blocks leave row-major."""

    def __init__(self, hidden: int, merge: int):
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        d, m = features.shape[-1], self.merge
        blocks = []
        for tokens, (h, w) in zip(features.split([h * w for h, w in grids]), grids):
            grid = tokens.view(h, w, d).permute(2, 0, 1).unsqueeze(0)
            blocks.append(F.unfold(grid, kernel_size=m, stride=m).view(d * m * m, -1).t())
        return self.merging_layer(torch.cat(blocks))


class Mistral3Projector(nn.Module):
    """Mistral3MultiModalProjector: RMSNorm, patch merger, linear_1 -> act -> linear_2."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, eps: float, act, bias: bool):
        super().__init__()
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = act
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(features), grids))))


class Mistral3ImageEncoder(nn.Module):
    """The tower, projector and prompt span of Mistral 3's images (module docstring)."""

    ARCHITECTURE = ARCHITECTURE
    bidirectional = False       # the text model attends an image's tokens causally

    def __init__(self, config: dict, text_hidden: int | None = None, break_token_id: int | None = None,
                 end_token_id: int | None = None, max_size: tuple[int, int] | None = None):
        super().__init__()
        spec = PixtralVisionSpec.from_config(config.get("vision_config"))
        _, text = text_config_of(ARCHITECTURE, config, ValueError)
        if text_hidden is None:
            text_hidden = text.get("hidden_size")
            if not isinstance(text_hidden, int) or isinstance(text_hidden, bool) or text_hidden <= 0:
                raise ValueError(f"config field 'text_config.hidden_size' = {text_hidden!r}: expected a positive int")
        eps = text.get("rms_norm_eps")
        eps = _TEXT_EPS.get(text["architectures"][0], _DEFAULT_TEXT_EPS) if eps is None else eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise ValueError(f"config field 'text_config.rms_norm_eps' = {eps!r}: expected a positive number")
        merge = _int_field(config, "spatial_merge_size", 2, minimum=1)
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ValueError(f"config field 'vision_feature_layer' = {layer!r}: only one layer (an int) is "
                             "supported (Mistral 3's projector norms a single layer's width)")
        try:
            self.depth: int = hidden_state_index(layer, spec.num_hidden_layers)
        except ValueError as e:
            raise ValueError(f"config field 'vision_feature_layer' = {layer}: {e}") from None
        act = activation(config.get("projector_hidden_act") or "gelu", "projector_hidden_act")
        bias = config.get("multimodal_projector_bias", False)
        if not isinstance(bias, bool):
            raise ValueError(f"config field 'multimodal_projector_bias' = {bias!r}: expected true or false")
        self.vision_tower = PixtralVisionModel(spec)
        self.multi_modal_projector = Mistral3Projector(spec.hidden_size, text_hidden, merge, float(eps), act, bias)
        name = "image_token_index" if config.get("image_token_index") is not None else "image_token_id"
        self.image_token_id: int = _int_field(config, name, _DEFAULT_IMAGE_TOKEN)
        self.image_break_token_id: int = _int_field(config, "image_break_token_id", break_token_id)
        self.image_end_token_id: int = _int_field(config, "image_end_token_id", end_token_id)
        max_height, max_width = max_size or (spec.image_size, spec.image_size)
        self.grid = PixtralGrid(max_height, max_width, spec.patch_size * merge)
        self.text_hidden_size: int = text_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """The image's span length: rows x (columns + 1), its breaks and end included."""
        return self.grid.tokens_for(image_size)

    def span_ids(self, image_size: tuple[int, int]) -> list[int]:
        """The span's token ids in order, as PixtralProcessor expands the text's "[IMG]"."""
        rows, columns = self.grid.grid_for(image_size)
        ids = ([self.image_token_id] * columns + [self.image_break_token_id]) * rows
        ids[-1] = self.image_end_token_id
        return ids

    def feature_runs(self, image_size: tuple[int, int]) -> list[tuple[int, int]]:
        """[start, end) of each row's image tokens within the span (relative to its start)."""
        rows, columns = self.grid.grid_for(image_size)
        return [(r * (columns + 1), r * (columns + 1) + columns) for r in range(rows)]

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are what the processor makes of an image of `image_size`, else why not."""
        try:
            height, width = self.grid.resized(image_size)
        except ValueError as e:         # too thin an image: the reason, as for pixels that do not fit
            return str(e)
        return shape_reason(pixel_values, (self.vision_tower.spec.num_channels, height, width), image_size)

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's [tokens_for(size), text hidden] span (module docstring), all images through
        the tower at once; ValueError naming the first image whose pixels do not fit its size."""
        check_items(self, items)
        if not items:
            return []
        images = [torch.as_tensor(p).to(self.device, self.dtype) for p, _ in items]
        patches = self.vision_tower(images, self.depth)
        features = self.multi_modal_projector(patches, [self.vision_tower.grid_of(p) for p in images])
        grids = [self.grid.grid_for(size) for _, size in items]
        out = []
        for tokens, (rows, columns) in zip(features.split([r * c for r, c in grids]), grids):
            span = tokens.new_zeros(rows, columns + 1, self.text_hidden_size)
            span[:, :columns] = tokens.view(rows, columns, -1)      # each row's break / end stays zero
            out.append(span.view(rows * (columns + 1), -1))
        return out

    @classmethod
    def stores_tower(cls, path: str | os.PathLike) -> bool:
        """Whether the checkpoint's files hold the Pixtral tower (else it is served on its text)."""
        return tensor_prefixes(os.fspath(path))[0] is not None

    @classmethod
    def for_model_dir(cls, model_dir: str | os.PathLike, text_hidden: int | None = None) -> "Mistral3ImageEncoder":
        """The encoder of a checkpoint directory's config.json, tokenizer and processor files
        (parameters uninitialized; build it under torch.device("meta") for the prompt-side calls):
        its resize bound the processor's (raycluster.model.pixtral_processor, whose grid it then
        equals), config.json's vision_config.image_size without a preprocessor_config.json.
        ValueError where the processor's merged patch (processor_config.json) is not the tower's,
        and for a preprocessor_config.json the processor refuses."""
        path = os.fspath(model_dir)
        config = read_config(path)
        break_id, end_id = token_ids_of(path, config)
        processor = PixtralImageProcessor.from_model_dir(path)
        bound = None if processor is None else (processor.grid.max_height, processor.grid.max_width)
        encoder = cls(config, text_hidden, break_id, end_id, bound)
        if processor is not None and processor.grid != encoder.grid:
            fields = processor_fields(path)
            raise ValueError(f"{path}: processor_config.json's patch_size {fields['patch_size']} x "
                             f"spatial_merge_size {fields['spatial_merge_size']} is not config.json's "
                             f"{encoder.grid.unit}-pixel merged patch (vision_config.patch_size x spatial_merge_size)")
        return encoder

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Mistral3ImageEncoder":
        path = os.fspath(model_dir)
        tower_prefix, projector_prefix = tensor_prefixes(path)
        if tower_prefix is None or projector_prefix is None:
            missing = "Pixtral vision tower" if tower_prefix is None else "multi_modal_projector"
            raise CheckpointError(f"{path!r}: the checkpoint stores no {missing} tensors")
        with torch.device("meta"):
            encoder = cls.for_model_dir(path)
        projector = read_prefixed(path, projector_prefix)
        _check_projection(projector.get("linear_1.weight"), encoder)
        encoder.to_empty(device=device).to(dtype)
        loaded = {"vision_tower." + k: v for k, v in read_prefixed(path, tower_prefix).items()}
        loaded.update({"multi_modal_projector." + k: v for k, v in projector.items()})
        copy_whole(dict(encoder.named_parameters()), loaded, path, "Pixtral vision tower / Mistral 3 projector", dtype)
        return encoder.eval()


def token_ids_of(model_dir: str | os.PathLike, config: dict) -> tuple[int | None, int | None]:
    """(image_break_token_id, image_end_token_id) as PixtralProcessor finds them (module
    docstring): None for those config.json sets itself; ValueError naming the token or file
    otherwise, and naming `image_token_index` when the tokenizer's image token is another id."""
    path = os.fspath(model_dir)
    wanted = [name for name in ("image_break_token_id", "image_end_token_id") if config.get(name) is None]
    if not wanted:
        return None, None
    tokens = processor_fields(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise ValueError(f"{path}: no tokenizer.json to find the image break / end tokens in (config.json sets "
                         "no image_break_token_id / image_end_token_id)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(file)
    ids = {}
    for field in ("image_token", "image_break_token", "image_end_token"):
        ids[field] = tokenizer.token_to_id(tokens[field])
        if ids[field] is None and field != "image_token":
            raise ValueError(f"{file}: the tokenizer has no {tokens[field]!r} token (processor_config.json's "
                             f"{field}) for the image break / end")
    image = config.get("image_token_index", config.get("image_token_id", _DEFAULT_IMAGE_TOKEN))
    if ids["image_token"] is not None and ids["image_token"] != image:
        raise ValueError(f"config field 'image_token_index' = {image!r} is not the tokenizer's "
                         f"{tokens['image_token']!r} ({ids['image_token']}), which the processor puts in the prompt")
    return ids["image_break_token"], ids["image_end_token"]


def _check_projection(weight: torch.Tensor | None, encoder: Mistral3ImageEncoder) -> None:
    """The stored linear_1 [text hidden, tower width] against the config (copy_whole names a missing one)."""
    if weight is not None:
        check_projection("multi_modal_projector.linear_1.weight", list(weight.shape), encoder.vision_tower.spec.hidden_size,
                         encoder.text_hidden_size, "vision_config.hidden_size")


def tensor_prefixes(path: str) -> tuple[str | None, str | None]:
    """(tower prefix, projector prefix) of the stored names (None: not stored, or no readable weights)."""
    return stored_prefixes(path, (_TOWER_PREFIXES, _TOWER_KEY), (_PROJECTOR_PREFIXES, _PROJECTOR_KEY))
