"""Gemma 3's image encoder (transformers 5.24's `Gemma3Model.get_image_features`): the SigLIP tower
(raycluster.model.siglip_vision) and Gemma 3's multimodal projector, in the common form the engine
calls (raycluster.model.llava): `image_token_id`, `tokens_for((height, width))`,
`check_pixels(pixels, (height, width))`, `encode_images([(pixels, (height, width)), ...])`.

`Gemma3ImageEncoder(config, text_hidden=None)` validates config.json (errors: ValueError naming the
field): `vision_config` (a SigLIP tower), `mm_tokens_per_image` (a square number whose side
divides the tower's patch grid: the projector average-pools the patches to it), the token ids
(`image_token_index` / `image_token_id`, `boi_token_index`, `eoi_token_index`, with
Gemma3Config's defaults) and the text hidden size (`text_config.hidden_size`, Gemma3TextConfig's
default when left out). Every image is one image_size square (the processor resized it:
raycluster.model.gemma3_processor) and takes `tokens_per_image` placeholder tokens; in the prompt
those sit between `boi_token_id` and `eoi_token_id` (Gemma3Processor expands the text's
"<start_of_image>" to "\\n\\n<start_of_image>" + tokens_per_image x "<image_soft_token>" +
"<end_of_image>\\n\\n").

Pixels enter `encode_images` as [3, image_size, image_size] per image; all images of a call go
through the tower at once, then the projector: the patch grid average-pooled to
tokens_per_image, Gemma's RMSNorm (x / rms * (1 + weight), in float32, eps the tower's
layer_norm_eps) and a matmul by `mm_input_projection_weight` [vision hidden, text hidden]. Each
image leaves as [tokens_per_image, text hidden] in the encoder's dtype, for the text model's
image-token positions (in place of their embeddings, unscaled).

`from_checkpoint(model_dir, dtype, device)` reads config.json and the tensors from
model.safetensors or its shards (raycluster.model.checkpoint_files): the tower under the released
files' `vision_tower.vision_model.` (the text beside it under `language_model.`), transformers 5's
`model.vision_tower.vision_model.`, or the bare `vision_tower.` / `model.vision_tower.` a
transformers 5 save may write; the projector under `multi_modal_projector.` or
`model.multi_modal_projector.`.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.checkpoint_files import (check_projection, copy_whole, read_prefixed, stored_prefixes,
                                               tower_and_projector)
from raycluster.model.llama import GemmaRMSNorm
from raycluster.model.llava_tower import check_items, read_config, shape_reason
from raycluster.model.multimodal_config import text_config_of
from raycluster.model.siglip_vision import SiglipVisionModel, SiglipVisionSpec

ARCHITECTURE = "Gemma3ForConditionalGeneration"
# Where checkpoints keep the tower and projector: `vision_tower.vision_model.` is tried before the
# bare `vision_tower.` (whose names would otherwise start with `vision_model.`).
_TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                   "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_PROJECTION = "mm_input_projection_weight"
# Stored tower tensors Gemma 3 never uses: old saves' position ids buffer, a pooling head.
_UNUSED = ("embeddings.position_ids", "head.")
# Gemma3Config's defaults for the released token ids.
_DEFAULT_IDS = {"image_token_index": 262_144, "boi_token_index": 255_999, "eoi_token_index": 256_000}


def _token_id(config: dict, names: tuple[str, ...]) -> int:
    """The first of `names` config.json sets (Gemma3Config's default otherwise); ValueError naming it."""
    name = next((n for n in names if config.get(n) is not None), names[0])
    value = config.get(name, _DEFAULT_IDS[names[0]])
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config field {name!r} = {value!r}: expected a token id")
    return value


class Gemma3Projector(nn.Module):
    """Gemma3MultiModalProjector: [N, patches, vision hidden] -> [N, tokens, text hidden]."""

    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_side: int, eps: float):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3ImageEncoder(nn.Module):
    """The tower, projector and prompt facts of Gemma 3's images (module docstring)."""

    # Gemma 3's text model attends an image's tokens to each other both ways (transformers'
    # token_type_ids mask): the engine computes each image in one step (Request.bidirectional_spans).
    bidirectional = True
    takes_embeds = True         # a client's embeddings [256, text hidden] may stand for an image's output

    ARCHITECTURE = ARCHITECTURE

    def __init__(self, config: dict, text_hidden: int | None = None):
        super().__init__()
        spec = SiglipVisionSpec.from_config(config.get("vision_config"))
        if text_hidden is None:
            _, text = text_config_of(ARCHITECTURE, config, ValueError)
            text_hidden = text.get("hidden_size")
            if not isinstance(text_hidden, int) or isinstance(text_hidden, bool) or text_hidden <= 0:
                raise ValueError(f"config field 'text_config.hidden_size' = {text_hidden!r}: expected a positive int")
        tokens = config.get("mm_tokens_per_image", 256)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            raise ValueError(f"config field 'mm_tokens_per_image' = {tokens!r}: expected a positive int")
        side = math.isqrt(tokens)
        if side * side != tokens or spec.patches_per_side % side:
            raise ValueError(f"config field 'mm_tokens_per_image' = {tokens}: must be a square number whose side "
                             f"divides the tower's {spec.patches_per_side}x{spec.patches_per_side} patches "
                             f"(vision_config.image_size {spec.image_size} / patch_size {spec.patch_size})")
        self.vision_tower = SiglipVisionModel(spec)
        self.multi_modal_projector = Gemma3Projector(spec.hidden_size, text_hidden, spec.patches_per_side, side,
                                                     spec.layer_norm_eps)
        self.image_token_id: int = _token_id(config, ("image_token_index", "image_token_id"))
        self.boi_token_id: int = _token_id(config, ("boi_token_index", "boi_token_id"))
        self.eoi_token_id: int = _token_id(config, ("eoi_token_index", "eoi_token_id"))
        self.tokens_per_image: int = tokens
        self.image_size: int = spec.image_size
        self.text_hidden_size: int = text_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_input_projection_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.mm_input_projection_weight.device

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """tokens_per_image, whatever the image's size (it was resized to one square)."""
        return self.tokens_per_image

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are one tower-sized square, else why not."""
        return shape_reason(pixel_values, (self.vision_tower.spec.num_channels, self.image_size, self.image_size),
                            image_size)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, image_size, image_size] pixels -> [N, tokens_per_image, text hidden] features."""
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(self.device, self.dtype)))

    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's [tokens_per_image, text hidden] features, all encoded in one batch;
        ValueError naming the first image whose pixels do not fit."""
        check_items(self, items)
        if not items:
            return []
        return list(self.encode(torch.stack([torch.as_tensor(p) for p, _ in items])).unbind(0))

    @classmethod
    def stores_tower(cls, path: str | os.PathLike) -> bool:
        """Whether the checkpoint's files hold the SigLIP tower (else it is served on its text)."""
        return tensor_prefixes(os.fspath(path))[0] is not None

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Gemma3ImageEncoder":
        path = os.fspath(model_dir)
        config = read_config(path)
        tower_prefix, projector_prefix = tower_and_projector(tensor_prefixes(path), path, "SigLIP vision tower")
        with torch.device("meta"):
            encoder = cls(config)
        projector = read_prefixed(path, projector_prefix)
        _check_projection(projector.get(_PROJECTION), encoder)
        encoder.to_empty(device=device).to(dtype)
        loaded = {"vision_tower.vision_model." + k: v for k, v in read_prefixed(path, tower_prefix).items()
                  if not k.startswith(_UNUSED)}
        loaded.update({"multi_modal_projector." + k: v for k, v in projector.items()})
        copy_whole(dict(encoder.named_parameters()), loaded, path, "Gemma 3 vision tower / projector", dtype)
        return encoder.eval()


def _check_projection(weight: torch.Tensor | None, encoder: Gemma3ImageEncoder) -> None:
    """The stored projection [tower width, text hidden] against the config (copy_whole names a missing one)."""
    if weight is not None:
        check_projection(f"multi_modal_projector.{_PROJECTION}", list(weight.shape), encoder.vision_tower.spec.hidden_size,
                         encoder.text_hidden_size, "vision_config.hidden_size", text_first=False)


def tensor_prefixes(path: str) -> tuple[str | None, str | None]:
    """(tower prefix, projector prefix) of the stored names (None: not stored, or no readable weights)."""
    return stored_prefixes(path, (_TOWER_PREFIXES, "embeddings.patch_embedding.weight"),
                           (_PROJECTOR_PREFIXES, _PROJECTION))
