"""LLaVA-OneVision's image side (transformers 5.24's `LlavaOnevisionModel.get_image_features` with its
`pack_image_features`): an image's squares (the base, then its tiles: raycluster.model.
onevision_processor) through a SigLIP tower and the projector to [squares, side * side, text hidden];
then the base square's features, followed by the tiles' features laid on one grid, cropped back to
the image's aspect ratio, bilinearly shrunk when they hold more than `vision_aspect_ratio`'s
"anyres_max_N" tiles' worth (`OnevisionGrid.packed_shape`), each row ended by `image_newline`.

`LlavaOnevisionImageEncoder(config, text_hidden)` validates config.json (ValueError naming the
field): `vision_config` a SigLIP tower (raycluster.model.siglip_vision; LlavaOnevisionConfig's
default tower when left out), `vision_feature_layer` an int or a list of ints (their hidden states,
taken before the tower's post_layernorm as transformers' `hidden_states` are, concatenated along
the features), `vision_feature_select_strategy` "full" only (SigLIP has no CLS: "default" drops a
patch, and transformers' packing then refuses the non-square grid), `projector_hidden_act`,
`multimodal_projector_bias`, `image_grid_pinpoints`, `vision_aspect_ratio`, `image_token_index`
and `video_token_index` (two distinct token ids). Only the tower layers the feature layers need
are built and read.

Pixels and each image's original (height, width) enter `encode_images([(pixels [1 + tiles, 3, S,
S], (height, width)), ...])`; every image's squares run through the tower in one batch, and each
image's features leave as [tokens_for((height, width)), text hidden] in the encoder's dtype, for
the text model's `image_token_id` placeholders in order (`span_ids(size)`: the image token,
tokens_for(size) times).

Videos (`takes_video`, `get_video_features` with `apply_pooling`) go through the same calls with a
size of (frames, height, width) (raycluster.model.onevision_video, `video_grid`): pixels [frames,
3, S, S], each frame a tower square whose features are bilinearly pooled to ceil(side / 2) a side,
the frames' pooled features in order and then one `image_newline` for the whole video, at the
text model's `video_token_id` placeholders. A call's images and videos share one tower batch.

`from_checkpoint(model_dir, dtype, device)` reads config.json and the tensors from
model.safetensors or its shards: the tower under the released files' `vision_tower.vision_model.`
(the text beside it under `language_model.`), transformers 5's `model.vision_tower.vision_model.`,
or the bare `vision_tower.` / `model.vision_tower.` a transformers 5.24 save writes; the projector
under `multi_modal_projector.` (or `model.`-prefixed); `image_newline` (or `model.image_newline`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from raycluster.model.anyres import check_image_size
from raycluster.model.checkpoint_files import copy_whole, read_named, read_prefixed, tower_and_projector
from raycluster.model.clip_vision import _Encoder, _EncoderLayer, activation, hidden_state_index
from raycluster.model.llava_tower import (_Projector, _layer_of, _text_hidden, check_items, pack_each, read_config,
                                          shape_reason, tensor_prefixes)
from raycluster.model.onevision_processor import DEFAULT_VISION, OnevisionGrid
from raycluster.model.onevision_video import OnevisionVideoGrid
from raycluster.model.siglip_vision import SiglipVisionSpec, _Embeddings

ARCHITECTURE = "LlavaOnevisionForConditionalGeneration"
# LlavaOnevisionConfig's image_token_index default (llava-onevision-qwen2's "<image>").
DEFAULT_IMAGE_TOKEN_ID = 151646
# LlavaOnevisionConfig's video_token_index default (its "<video>").
DEFAULT_VIDEO_TOKEN_ID = 151647
# Stored tower tensors never used here: the post-layernorm (transformers' hidden_states are taken
# before it), a pooling head, old saves' position ids buffer.
_UNUSED = ("post_layernorm.", "head.", "embeddings.position_ids")
_NEWLINE = ("image_newline", "model.image_newline")


class SiglipHiddenStates(nn.Module):
    """SigLIP's embeddings and first `num_layers` encoder layers (names as below `vision_model.`)."""

    def __init__(self, spec: SiglipVisionSpec, num_layers: int):
        super().__init__()
        act = activation(spec.hidden_act, "vision_config.hidden_act")
        self.spec = spec
        self.embeddings = _Embeddings(spec)
        self.encoder = _Encoder([_EncoderLayer(spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                                               spec.layer_norm_eps, act) for _ in range(num_layers)])

    def hidden_states(self, pixel_values: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """transformers' `hidden_states[k]` [N, patches, hidden] for each k of `indices` (0: the
        embeddings, k: layer k's output, negative k from the end of the full tower's states)."""
        wanted = [hidden_state_index(i, self.spec.num_hidden_layers) for i in indices]
        x = self.embeddings(pixel_values)
        states = {0: x}
        for k, layer in enumerate(self.encoder.layers[:max(wanted)], start=1):
            x = layer(x)
            states[k] = x
        return [states[k] for k in wanted]


class LlavaOnevisionImageEncoder(nn.Module):
    """The tower, projector and anyres packing (module docstring)."""

    ARCHITECTURE = ARCHITECTURE
    bidirectional = False       # the text model attends an image's tokens causally
    takes_embeds = True         # a client's embeddings [tokens, text hidden] may stand for an image's output
    takes_video = True

    def __init__(self, config: dict, text_hidden: int):
        super().__init__()
        vision = config.get("vision_config")
        spec = SiglipVisionSpec.from_config(DEFAULT_VISION if vision is None else vision)
        layers = config.get("vision_feature_layer", -1)
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers) if isinstance(layers, list) else []
        if not self.feature_layers or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in self.feature_layers):
            raise ValueError(f"config field 'vision_feature_layer' = {layers!r}: expected an int or a list of ints")
        try:
            deepest = max(hidden_state_index(i, spec.num_hidden_layers) for i in self.feature_layers)
        except ValueError as e:
            raise ValueError(f"config field 'vision_feature_layer' = {layers!r}: {e}") from None
        strategy = config.get("vision_feature_select_strategy", "full")
        if strategy != "full":
            raise ValueError(f"config field 'vision_feature_select_strategy' = {strategy!r}: LLaVA-OneVision's "
                             "SigLIP tower has no CLS token, so only 'full' keeps each tile a square grid of "
                             "features (transformers' packing refuses the others too)")
        self.select_strategy = strategy
        self.grid = OnevisionGrid.from_config(config)
        self.vision_tower = SiglipHiddenStates(spec, deepest)
        act = activation(config.get("projector_hidden_act", "gelu"), "projector_hidden_act")
        self.multi_modal_projector = _Projector(spec.hidden_size * len(self.feature_layers), text_hidden, act,
                                                bool(config.get("multimodal_projector_bias", True)))
        self.image_newline = nn.Parameter(torch.empty(text_hidden))
        self.image_token_id: int = _token_id(config, "image_token_index", "image_token_id", DEFAULT_IMAGE_TOKEN_ID)
        self.video_token_id: int = _token_id(config, "video_token_index", "video_token_id", DEFAULT_VIDEO_TOKEN_ID)
        if self.video_token_id == self.image_token_id:
            # transformers would scatter both an image's and a video's features over the same placeholders.
            raise ValueError(f"config field 'video_token_index' = {self.video_token_id}: the image token's id too")
        self.video_grid = OnevisionVideoGrid(self.grid.side)
        self.image_size: int = spec.image_size
        self.text_hidden_size: int = text_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    def tokens_for(self, size) -> int:
        """The features an image of (height, width) or a video of (frames, height, width) becomes
        (LlavaOnevisionProcessor's count)."""
        if _is_video(size):
            return self.video_grid.tokens_for(tuple(size))
        return self.grid.tokens_for(size)

    def span_ids(self, size) -> list[int]:
        """The prompt tokens of an image or video of `size`: its placeholder token, repeated."""
        return [self.video_token_id if _is_video(size) else self.image_token_id] * self.tokens_for(size)

    def check_pixels(self, pixel_values, image_size) -> str | None:
        """None if `pixel_values` are what the processors make of an image or video of `image_size`,
        else why not."""
        if _is_video(image_size):
            return self._check_video(pixel_values, image_size)
        reason = check_image_size(image_size)
        if reason is not None:
            return reason
        spec = self.vision_tower.spec
        return shape_reason(pixel_values, (self.grid.num_tiles(tuple(image_size)) + 1, spec.num_channels,
                                           spec.image_size, spec.image_size), image_size)

    def _check_video(self, pixel_values, size) -> str | None:
        reason = self.video_grid.check(size)
        if reason is not None:
            return reason
        spec = self.vision_tower.spec
        want = (size[0], spec.num_channels, spec.image_size, spec.image_size)
        shape = tuple(getattr(pixel_values, "shape", ()))
        if shape != want:
            return f"pixels are {shape}; a video of {size[0]} frames of {size[1]}x{size[2]} takes {want}"
        return None

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] squares -> [N, side * side, text hidden]: the selected hidden states, projected."""
        states = self.vision_tower.hidden_states(pixel_values.to(self.device, self.dtype), self.feature_layers)
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    @torch.inference_mode()
    def encode_images(self, items: list[tuple[torch.Tensor, tuple]]) -> list[torch.Tensor]:
        """Each image's or video's features [tokens_for(size), text hidden] (module docstring);
        ValueError naming the first item whose pixels do not fit its size."""
        check_items(self, items)
        if not items:
            return []
        # Every image's squares and every video's frames in one tower batch, then each item its own way.
        features = self.tile_features(torch.cat([torch.as_tensor(p) for p, _ in items]))
        return pack_each(features, items, lambda f, size: self._pool(f) if _is_video(size) else self._pack(f, size))

    def _pool(self, features: torch.Tensor) -> torch.Tensor:
        """A video's frame features [frames, side * side, hidden] -> [frames * pooled^2 + 1, hidden]:
        transformers' apply_pooling in its order of operations (so the bilinear resize rounds as
        its does), the frames flattened, then one image_newline."""
        frames, side, pooled = features.shape[0], self.grid.side, self.video_grid.pooled_side
        x = features.view(frames, side, side, -1).permute(0, 3, 1, 2).contiguous()
        x = F.interpolate(x, size=[pooled, pooled], mode="bilinear")
        x = x.permute(0, 2, 3, 1).reshape(frames * pooled * pooled, -1)
        return torch.cat([x, self.image_newline.to(x.dtype)[None]])

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's square features [1 + tiles, side * side, hidden] -> its packed features, in
        transformers' order of operations (so the bilinear shrink rounds as its does)."""
        rows, cols = self.grid.grid_shape(image_size)
        side = self.grid.side
        # [hidden, rows * side, cols * side]: tile (r, c)'s feature (i, j) at row r * side + i, column c * side + j.
        grid = features[1:].view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).contiguous()
        grid = grid.flatten(1, 2).flatten(2, 3)
        row_slice, col_slice = self.grid.kept(image_size)
        grid = grid[:, row_slice, col_slice]
        height, width = self.grid.packed_shape(image_size)
        if (height, width) != tuple(grid.shape[1:]):
            if height and width:
                grid = F.interpolate(grid[None], [height, width], mode="bilinear")[0]
            else:       # shrunk to nothing (only a degenerate grid): interpolate takes no empty size
                grid = grid[:, :height, :width]
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(*grid.shape[:-1], 1)
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([features[0], grid])

    @classmethod
    def stores_tower(cls, path: str | os.PathLike) -> bool:
        """Whether the checkpoint's files hold the SigLIP tower (else it is served on its text)."""
        return tensor_prefixes(os.fspath(path))[0] is not None

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LlavaOnevisionImageEncoder":
        path = os.fspath(model_dir)
        config = read_config(path)
        tower_prefix, projector_prefix = tower_and_projector(tensor_prefixes(path), path, "SigLIP vision tower")
        projector = read_prefixed(path, projector_prefix)
        with torch.device("meta"):
            encoder = cls(config, _text_hidden(config, projector))
        encoder.to_empty(device=device).to(dtype)
        built = len(encoder.vision_tower.encoder.layers)
        loaded = {"vision_tower." + k: v for k, v in read_prefixed(path, tower_prefix).items()
                  if not k.startswith(_UNUSED) and _layer_of(k) < built}
        loaded.update({"multi_modal_projector." + k: v for k, v in projector.items()})
        newline = next((t for t in (read_named(path, name) for name in _NEWLINE) if t is not None), None)
        if newline is not None:
            loaded["image_newline"] = newline
        copy_whole(dict(encoder.named_parameters()), loaded, path, "LLaVA-OneVision vision tower / projector", dtype)
        return encoder.eval()


def _is_video(size) -> bool:
    """A video's size is (frames, height, width); an image's (height, width)."""
    return isinstance(size, (tuple, list)) and len(size) == 3


def _token_id(config: dict, field: str, alias: str, default: int) -> int:
    """config.json's token id `field` (or its transformers 5 `alias`); ValueError naming the field."""
    token = config.get(field, config.get(alias, default))
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"config field {field!r} = {token!r}: expected a token id")
    return token
