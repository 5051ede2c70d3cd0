"""LLaVA's image side, and which image encoder / processor a checkpoint gets (LLaVA, LLaVA-NeXT,
LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, Mistral 3, Llama 4).

LLaVA-1.5 (`LlavaForConditionalGeneration.get_image_features`): `LlavaImageEncoder` is the CLIP
tower and projector of raycluster.model.llava_tower over one square per image, every image
`tokens_per_image` features. LLaVA-NeXT (`LlavaNextForConditionalGeneration`) is
raycluster.model.llava_next's `LlavaNextImageEncoder`, its count depending on the image's size;
LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`) raycluster.model.llava_onevision's, the
same layout over a SigLIP tower with its "anyres_max" shrink (each image of a prompt tiled, as
vLLM and transformers' flat image lists do).
Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`)
are raycluster.model.qwen_vl's `QwenVLImageEncoder`, which also gives `grid_for((height, width))`,
the (t, rows, columns) of an image's tokens that their multimodal rotary positions are laid on,
and takes videos (sizes of (frames, height, width): raycluster.model.qwen_vl_video; the facts'
`prepare_video(frames)`), as LLaVA-OneVision does (raycluster.model.onevision_video: each frame
one tile, its features pooled 2 x 2, one newline after the video).
Qwen3-VL and Qwen3-VL-MoE (`Qwen3VLForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`)
are raycluster.model.qwen3_vl's `Qwen3VLImageEncoder`, the same arithmetic, whose features also
carry the DeepStack levels the text model adds after its first layers. Gemma 3
(`Gemma3ForConditionalGeneration`) is raycluster.model.gemma3_vision's `Gemma3ImageEncoder`: a
SigLIP tower, `tokens_per_image` features per image, whose tokens the text model attends to each
other both ways (its `bidirectional`). Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small
3.1 / 3.2) is raycluster.model.mistral3_vision's `Mistral3ImageEncoder`: a Pixtral tower, an image
taking rows of its token, each row ended by a break token (the last by an end token); its features
fill the rows (`feature_runs`), the facts' `spans` lay out the whole span. Llama 4
(`Llama4ForConditionalGeneration`) is raycluster.model.llama4_image's `Llama4ImageEncoder`: tiles of
the image and a global one, each tile's patch tokens between separators; the template's
"<|image|>" (the facts' `image_token_id`) becomes the span from "<|image_start|>" to
"<|image_end|>", the features filling the patch tokens (the encoder's `image_token_id`).

The encoders answer the same calls (what the engine uses): `image_token_id`,
`tokens_for((height, width))` (the image's span of prompt tokens), `check_pixels(pixels, (height, width))` (None, or why the pixels
do not fit) and `encode_images([(pixels, (height, width)), ...])` -> one [tokens_for(size), text
hidden] tensor per image, in the encoder's dtype, for the text model's image-token positions.

`image_encoder_for(model_dir, dtype, device)` builds the encoder of a checkpoint of those
architectures whose files hold the tower (None for other architectures and for one stored without
it: those are served on their text). `image_facts(model_dir)` is the gateway's side, from
config.json, preprocessor_config.json and the stored tensor names alone (no weights read): the
image token, its processor (PIL image -> (pixels, (height, width))) and the token count of an
image's size, `prepare(image)` all three at once, and (Qwen-VL; None for LLaVA) `grid_for(size)`.
`llava_image_facts(model_dir)` is LLaVA-1.5's older (image_token_id, tokens_per_image) pair (None
for LLaVA-NeXT and Qwen-VL, whose count is per image).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
from PIL import Image

from raycluster.model import gemma3_vision, llama4_image, llava_next, llava_onevision, mistral3_vision, qwen3_vl, qwen_vl
from raycluster.model.anyres import AnyresGrid, AnyresImageProcessor
from raycluster.model.gemma3_processor import Gemma3ImageProcessor
from raycluster.model.gemma3_vision import Gemma3ImageEncoder
from raycluster.model.image_processor import ImageProcessor
from raycluster.model.llama4_image import Llama4ImageEncoder
from raycluster.model.llama4_processor import Llama4Grid, Llama4ImageProcessor
from raycluster.model.llava_tower import ClipProjectorEncoder, check_items, read_config
from raycluster.model.mistral3_vision import Mistral3ImageEncoder
from raycluster.model.onevision_processor import OnevisionImageProcessor
from raycluster.model.onevision_video import OnevisionVideoGrid, OnevisionVideoProcessor
from raycluster.model.pixtral_processor import PixtralGrid, PixtralImageProcessor
from raycluster.model.qwen3_vl import Qwen3VLImageEncoder
from raycluster.model.qwen_vl import QwenVLImageEncoder
from raycluster.model.qwen_vl_processor import QwenVLGrid, QwenVLImageProcessor, pixel_limits, read_preprocessor
from raycluster.model.qwen_vl_video import QwenVLVideoGrid, QwenVLVideoProcessor, read_video_preprocessor, video_fields

ARCHITECTURE = "LlavaForConditionalGeneration"


class LlavaImageEncoder(ClipProjectorEncoder):
    """LLaVA-1.5: one image_size square per image, `tokens_per_image` features each."""

    def __init__(self, config: dict, text_hidden: int):
        super().__init__(config, text_hidden)
        self.tokens_per_image: int = self.tokens_per_tile

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, image_size, image_size] pixels -> [N, tokens_per_image, text hidden] features."""
        return self.tile_features(pixel_values)

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        """tokens_per_image, whatever the image's size (it was resized to one square)."""
        return self.tokens_per_image

    def check_pixels(self, pixel_values, image_size) -> str | None:
        want = (self.vision_tower.num_channels, self.image_size, self.image_size)
        shape = tuple(getattr(pixel_values, "shape", ()))
        return None if shape == want else f"pixels are {shape}; the encoder takes {want}"

    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int]]]) -> list[torch.Tensor]:
        """Each image's [tokens_per_image, text hidden] features, all encoded in one batch."""
        check_items(self, items)
        if not items:
            return []
        return list(self.encode(torch.stack([torch.as_tensor(p) for p, _ in items])).unbind(0))


_ENCODERS = {ARCHITECTURE: LlavaImageEncoder, llava_next.ARCHITECTURE: llava_next.LlavaNextImageEncoder,
             **{arch: QwenVLImageEncoder for arch in qwen_vl.ARCHITECTURES},
             **{arch: Qwen3VLImageEncoder for arch in qwen3_vl.ARCHITECTURES},
             gemma3_vision.ARCHITECTURE: Gemma3ImageEncoder, mistral3_vision.ARCHITECTURE: Mistral3ImageEncoder,
             llama4_image.ARCHITECTURE: Llama4ImageEncoder,
             llava_onevision.ARCHITECTURE: llava_onevision.LlavaOnevisionImageEncoder}


def _encoder_class(path: str):
    """The encoder class of a checkpoint whose files hold its vision tower, else None."""
    if not os.path.exists(os.path.join(path, "config.json")):
        return None
    archs = read_config(path).get("architectures") or []
    cls = next((_ENCODERS[a] for a in archs if a in _ENCODERS), None)
    return cls if cls is not None and cls.stores_tower(path) else None


def image_encoder_for(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                      ) -> ClipProjectorEncoder | QwenVLImageEncoder | Gemma3ImageEncoder | Mistral3ImageEncoder | \
        Llama4ImageEncoder | None:
    """The image encoder of a checkpoint (module docstring) that stores its tower, else None."""
    path = os.fspath(model_dir)
    cls = _encoder_class(path)
    return None if cls is None else cls.from_checkpoint(path, dtype, device)


@dataclasses.dataclass(frozen=True)
class FixedSizeProcessor:
    """LLaVA-1.5's processor in the common form: the one square, and the image's (height, width)."""
    steps: ImageProcessor

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        return self.steps(image), (image.height, image.width)


@dataclasses.dataclass(frozen=True)
class ImageFacts:
    """How a checkpoint takes images (module docstring). `processor` is None when the checkpoint
    has no preprocessor_config.json; `grid` (LLaVA-NeXT, Qwen-VL) makes the count depend on the size."""
    image_token_id: int
    processor: FixedSizeProcessor | AnyresImageProcessor | QwenVLImageProcessor | Gemma3ImageProcessor | \
        PixtralImageProcessor | Llama4ImageProcessor | None
    tokens_per_image: int | None = None
    grid: AnyresGrid | QwenVLGrid | PixtralGrid | Llama4Grid | None = None
    spans: Callable[[tuple[int, int]], list[int]] | None = None
    # Gemma 3's start / end of image tokens, whose text the server wraps each image's placeholders in.
    wrap_ids: tuple[int, int] | None = None
    # Qwen2-VL / Qwen2.5-VL and LLaVA-OneVision: videos, sized (frames, height, width)
    # (raycluster.model.qwen_vl_video, raycluster.model.onevision_video).
    video_token_id: int | None = None
    video_grid: QwenVLVideoGrid | OnevisionVideoGrid | None = None
    video_processor: QwenVLVideoProcessor | OnevisionVideoProcessor | None = None

    def tokens_for(self, image_size: tuple[int, int]) -> int:
        if len(image_size) == 3:
            return self.video_grid.tokens_for(image_size)
        return self.grid.tokens_for(image_size) if self.grid is not None else self.tokens_per_image

    def span_ids(self, image_size: tuple[int, int]) -> list[int]:
        """The prompt tokens an image of this size takes: its token, tokens_for(size) times, or the
        layout `spans` gives (Mistral 3's rows between break tokens)."""
        if self.spans is not None:
            return self.spans(image_size)
        return [self.image_token_id] * self.tokens_for(image_size)

    def grid_for(self, image_size: tuple[int, int]) -> tuple[int, int, int] | None:
        """Qwen-VL: the (t, rows, columns) of the image's (or video's) tokens (raycluster.model.qwen_vl); else None."""
        if len(image_size) == 3:
            return self.video_grid.grid_for(image_size) if isinstance(self.video_grid, QwenVLVideoGrid) else None
        return self.grid.grid_for(image_size) if isinstance(self.grid, QwenVLGrid) else None

    def prepare_video(self, frames: list[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int], int]:
        """(pixels, (frames, height, width), placeholder tokens) of a video's decoded frames."""
        if self.video_processor is None:
            raise ValueError("this model takes no videos" if self.video_grid is None else
                             "the checkpoint has no preprocessor_config.json to process videos with")
        pixels, size = self.video_processor(frames)
        return pixels, size, self.tokens_for(size)

    def prepare(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int], int]:
        """(pixels, (height, width), placeholder tokens) of a decoded image."""
        if self.processor is None:
            raise ValueError("the checkpoint has no preprocessor_config.json to process images with")
        pixels, size = self.processor(image)
        return pixels, size, self.tokens_for(size)


def image_facts(model_dir: str | os.PathLike) -> ImageFacts | None:
    """The facts of a checkpoint `image_encoder_for` gives an encoder, else None; the same
    ValueError for a config it cannot serve, and for a processor that does not fit the tower."""
    path = os.fspath(model_dir)
    cls = _encoder_class(path)
    if cls is None:
        return None
    config = read_config(path)
    if cls in (QwenVLImageEncoder, Qwen3VLImageEncoder):
        return _qwen_vl_facts(path, config, cls)
    if cls is Gemma3ImageEncoder:
        return _gemma3_facts(path, config)
    if cls is Mistral3ImageEncoder:
        with torch.device("meta"):
            encoder = Mistral3ImageEncoder.for_model_dir(path, text_hidden=1)
        return ImageFacts(encoder.image_token_id, PixtralImageProcessor.from_model_dir(path), grid=encoder.grid,
                          spans=encoder.span_ids)
    if cls is Llama4ImageEncoder:
        # The template writes "<|image|>"; the server expands it to the image's whole span.
        with torch.device("meta"):
            encoder = Llama4ImageEncoder.for_model_dir(path, text_hidden=1)
        return ImageFacts(encoder.placeholder_token_id, Llama4ImageProcessor.from_model_dir(path), grid=encoder.grid,
                          spans=encoder.span_ids)
    with torch.device("meta"):      # validates the config as loading would, allocating nothing
        encoder = cls(config, text_hidden=1)
    if cls is LlavaImageEncoder:
        steps = ImageProcessor.from_model_dir(path)
        return ImageFacts(encoder.image_token_id, None if steps is None else FixedSizeProcessor(steps),
                          tokens_per_image=encoder.tokens_per_image)
    # LLaVA-OneVision's processor has its own defaults (no center crop, 384-pixel tiles).
    processor = (OnevisionImageProcessor if cls is llava_onevision.LlavaOnevisionImageEncoder
                 else AnyresImageProcessor).from_model_dir(path)
    if processor is not None and (processor.tile_size, processor.pinpoints) != (encoder.image_size,
                                                                                 encoder.grid.pinpoints):
        raise ValueError(f"{path}: preprocessor_config.json's tiles ({processor.tile_size} pixels, pinpoints "
                         f"{processor.pinpoints}) are not config.json's ({encoder.image_size} pixels, pinpoints "
                         f"{encoder.grid.pinpoints})")
    if cls is not llava_onevision.LlavaOnevisionImageEncoder:
        return ImageFacts(encoder.image_token_id, processor, grid=encoder.grid)
    video = OnevisionVideoProcessor.from_model_dir(path)
    side = encoder.image_size
    if video is not None and video.frame_size not in (None, (side, side)):
        raise ValueError(f"{path}: the video processor's frames ({video.frame_size}) are not the tower's "
                         f"{side} x {side} (config.json's vision_config.image_size)")
    return ImageFacts(encoder.image_token_id, processor, grid=encoder.grid, spans=encoder.span_ids,
                      video_token_id=encoder.video_token_id, video_grid=encoder.video_grid, video_processor=video)


def _qwen_vl_facts(path: str, config: dict, cls) -> ImageFacts:
    with torch.device("meta"):
        encoder = cls(config, pixel_limits(read_preprocessor(path)), video_fields(read_video_preprocessor(path)))
    processor = QwenVLImageProcessor.from_model_dir(path)
    if processor is not None and processor.grid != encoder.grid:
        g, want = processor.grid, encoder.grid
        raise ValueError(f"{path}: preprocessor_config.json's patches (patch_size {g.patch_size}, merge_size "
                         f"{g.merge_size}, temporal_patch_size {g.temporal_patch_size}) are not config.json's "
                         f"({want.patch_size}, {want.merge_size}, {want.temporal_patch_size})")
    if not encoder.takes_video:
        return ImageFacts(encoder.image_token_id, processor, grid=encoder.grid)
    video = QwenVLVideoProcessor.from_model_dir(path)
    if video is not None:       # the patch sizes were checked against the tower's above
        video = dataclasses.replace(video, grid=encoder.video_grid)
    return ImageFacts(encoder.image_token_id, processor, grid=encoder.grid, spans=encoder.span_ids,
                      video_token_id=encoder.video_token_id, video_grid=encoder.video_grid, video_processor=video)


def _gemma3_facts(path: str, config: dict) -> ImageFacts:
    with torch.device("meta"):
        encoder = Gemma3ImageEncoder(config, text_hidden=1)
    processor = Gemma3ImageProcessor.from_model_dir(path)
    if processor is not None and processor.size != {"height": encoder.image_size, "width": encoder.image_size}:
        raise ValueError(f"{path}: preprocessor_config.json's size {processor.size} is not the tower's "
                         f"{encoder.image_size} x {encoder.image_size} (config.json's vision_config.image_size)")
    return ImageFacts(encoder.image_token_id, processor, tokens_per_image=encoder.tokens_per_image,
                      wrap_ids=(encoder.boi_token_id, encoder.eoi_token_id))


def processor_for(model_dir: str | os.PathLike) -> FixedSizeProcessor | AnyresImageProcessor | QwenVLImageProcessor | \
        Gemma3ImageProcessor | PixtralImageProcessor | Llama4ImageProcessor | None:
    """The checkpoint's image processor (PIL image -> (pixels, (height, width))), else None."""
    facts = image_facts(model_dir)
    return None if facts is None else facts.processor


def llava_image_facts(model_dir: str | os.PathLike) -> tuple[int, int] | None:
    """LLaVA-1.5's (image_token_id, tokens_per_image), from config.json and the stored tensor
    names alone; None where `image_encoder_for` gives None and for LLaVA-NeXT (see `image_facts`);
    the same ValueError for a config it cannot serve."""
    path = os.fspath(model_dir)
    if _encoder_class(path) is not LlavaImageEncoder:
        return None
    with torch.device("meta"):
        encoder = LlavaImageEncoder(read_config(path), text_hidden=1)
    return encoder.image_token_id, encoder.tokens_per_image
