"""Qwen3-VL's image side against transformers 5.24: the processor (Qwen3-VL's preprocessor_config.json:
16-pixel patches, mean / std 0.5, limits as `size`) equal to `Qwen2VLImageProcessorPil`; the token
count of an image's size equal to what `Qwen3VLProcessor` expands "<|image_pad|>" to; the encoder's
rows (the merger's features, then each DeepStack level) equal to `get_image_features`' pooler_output
and deepstack_features for several images in one call; Qwen3-VL-MoE's tower the same module; what
transformers saves loads; what is refused; and the tiny checkpoint's prompt layout equal to
transformers' processor's, with transformers' greedy tokens (the reference the engine is compared
against) depending on the images and on their DeepStack levels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from qwen3_vl_reference import hf_qwen3_vl, hf_qwen3_vl_greedy, hf_qwen3_vl_image_rows, hf_qwen3_vl_processor

from raycluster.model.checkpoint_files import CheckpointError
from raycluster.model.qwen3_vl import Qwen3VLImageEncoder
from raycluster.model.qwen_vl_processor import QwenVLGrid, QwenVLImageProcessor
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen3_vl import MAX_PIXELS, MIN_PIXELS, write_tiny_qwen3_vl
from raycluster.model.tiny_qwen_vl import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID

transformers = pytest.importorskip("transformers")
HIDDEN = 256        # the tiny text model's


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    px = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(px[..., 0] if channels == 1 else px, mode)


def _picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth picture (a random 3 x 3 grid of colours, stretched): unlike noise, two of them
    differ as wholes, which the tiny model's greedy tokens show."""
    grid = np.random.default_rng(seed).integers(0, 256, size=(3, 3, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((w, h), Image.Resampling.BILINEAR)


# (height, width): wide, tall, square, tiny, thin, odd, up- and downscaled.
SIZES = [(30, 40), (40, 30), (32, 32), (100, 17), (3, 200), (60, 119), (13, 21), (1, 1), (200, 150), (64, 9)]
IMAGES = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)] + [_image(37, 53, 1, "RGBA"), _image(15, 15, 2, "L")]

# Qwen3-VL's released preprocessor_config.json (Qwen3-VL-2B ... 235B).
RELEASED = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
PROCESSORS = [RELEASED,
              {**RELEASED, "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}},     # the tiny one's
              {**RELEASED, "max_pixels": 40000, "resample": 2, "image_mean": [0.4, 0.5, 0.6], "image_std": 0.25}]


@pytest.mark.parametrize("fields", PROCESSORS, ids=["released", "tiny", "overridden"])
def test_processor_equals_transformers_pil_path(tmp_path, fields):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    ours = QwenVLImageProcessor.from_model_dir(tmp_path)
    reference = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert ours.grid.patch_size == 16 and ours.steps.image_mean == tuple(np.broadcast_to(fields["image_mean"], 3))
    for image in IMAGES + [_image(500, 1000, 5), _image(900, 300, 6)]:
        pixels, size = ours(image)
        want = reference(image, return_tensors="pt")
        assert size == (image.height, image.width)
        assert ours.grid.grid_thw(size) == tuple(want["image_grid_thw"][0].tolist())
        assert pixels.dtype == torch.float32 and pixels.shape == want["pixel_values"].shape
        torch.testing.assert_close(pixels, want["pixel_values"], rtol=0, atol=0)


def test_token_count_equals_transformers_processor():
    """The count over a sweep of sizes, as Qwen3VLProcessor computes it for the released limits and the tiny ones."""
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(1, 5000, size=2)) for _ in range(300)] + \
        [(32, 32), (1, 1), (1, 200), (4096, 4096), (5000, 30)]
    sizes = [s for s in sizes if max(s) / min(s) <= 200]
    for low, high in ((65536, 16777216), (MIN_PIXELS, MAX_PIXELS)):
        grid = QwenVLGrid(16, 2, 2, low, high)
        processor = transformers.Qwen3VLProcessor.__new__(transformers.Qwen3VLProcessor)
        processor.image_processor = transformers.Qwen2VLImageProcessorPil(
            size={"shortest_edge": low, "longest_edge": high}, patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        want = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
        assert [grid.tokens_for(s) for s in sizes] == want
    # The tiny limits: a 30x40 image is 6 tokens, none of an aspect ratio up to 8 more than 16.
    tiny = QwenVLGrid(16, 2, 2, MIN_PIXELS, MAX_PIXELS)
    assert tiny.tokens_for((30, 40)) == 6 and max(tiny.tokens_for(s) for s in sizes if max(s) / min(s) <= 8) <= 16


# vision options: the tiny default; a deeper tower with more heads, DeepStack listed out of depth
# order, a 7 x 7 position grid, exact GELU and larger images; and no DeepStack at all.
CASES = [{},
         {"depth": 4, "num_heads": 4, "deepstack_visual_indexes": [3, 1], "num_position_embeddings": 49,
          "hidden_act": "gelu", "max_pixels": 32 * 32 * 40},
         {"depth": 1, "deepstack_visual_indexes": []}]


@pytest.fixture(scope="module", params=CASES, ids=["tiny", "deep", "no-deepstack"])
def checkpoint(request, tmp_path_factory):
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), seed=3, **request.param), request.param


def _hf_inputs(path, images):
    out = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(path))(images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_encoder_equals_transformers_image_features(checkpoint):
    path, options = checkpoint
    encoder = Qwen3VLImageEncoder.from_checkpoint(path)
    levels = len(options.get("deepstack_visual_indexes", [0, 1]))
    assert encoder.image_token_id == IMAGE_TOKEN_ID and encoder.deepstack_levels == levels
    processor = QwenVLImageProcessor.from_model_dir(path)
    images = IMAGES[:4] + [IMAGES[8], IMAGES[10]]
    prepared = [processor(image) for image in images]
    pixel_values, grid_thw = _hf_inputs(path, images)
    assert torch.equal(torch.cat([p for p, _ in prepared]), pixel_values)
    model = hf_qwen3_vl(path)
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid_thw)
    assert len(out.pooler_output) == len(images) and len(out.deepstack_features) == levels
    got = encoder.encode_images(prepared)
    assert len({tuple(g.shape) for g in got}) > 2          # images of different token counts in one call
    for k, ((pixels, size), rows, thw) in enumerate(zip(prepared, got, grid_thw.tolist())):
        assert encoder.check_pixels(pixels, size) is None
        assert rows.dtype == torch.float32 and rows.shape == (encoder.tokens_for(size), (1 + levels) * HIDDEN)
        assert encoder.grid_for(size) == (thw[0], thw[1] // 2, thw[2] // 2)
        torch.testing.assert_close(rows[:, :HIDDEN], out.pooler_output[k], rtol=0, atol=1e-5)
        for level, features in enumerate(out.deepstack_features):
            torch.testing.assert_close(rows[:, HIDDEN * (1 + level):HIDDEN * (2 + level)], features[k],
                                       rtol=0, atol=1e-5)
    # One image alone gives its rows of the batch.
    torch.testing.assert_close(encoder.encode_images(prepared[1:2])[0], got[1], rtol=0, atol=1e-5)
    half = Qwen3VLImageEncoder.from_checkpoint(path, torch.bfloat16).encode_images(prepared[:1])[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got[0], rtol=0.05, atol=0.15)


def test_moe_tower_is_qwen3_vl_s(checkpoint):
    """Qwen3-VL-MoE's vision model is this module: the same tensors give the same features."""
    path, _ = checkpoint
    config = json.loads(open(f"{path}/config.json").read())
    moe = {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"]}
    encoder = Qwen3VLImageEncoder.from_checkpoint(path)
    assert isinstance(Qwen3VLImageEncoder(moe), Qwen3VLImageEncoder)
    vision = {k: v for k, v in config["vision_config"].items() if k != "model_type"}
    reference = transformers.Qwen3VLMoeVisionModel(transformers.Qwen3VLMoeVisionConfig(**vision)).eval()
    reference.load_state_dict(encoder.visual.state_dict())        # strict: the same names and shapes
    pixel_values, grid_thw = _hf_inputs(path, IMAGES[:3])
    with torch.no_grad():
        want = reference(pixel_values, grid_thw=grid_thw)
    merged, levels = encoder.visual(pixel_values, [tuple(g) for g in grid_thw.tolist()])
    torch.testing.assert_close(merged, want.pooler_output, rtol=0, atol=1e-5)
    for g, w in zip(levels, want.deepstack_features, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_encoder_reads_what_transformers_saves(tmp_path):
    """transformers 5.24 saves the tower as `model.visual.*`; a `visual.*` copy reads the same; a
    text-only checkpoint (one tower tensor) has no tower to serve."""
    src = write_tiny_qwen3_vl(tmp_path / "src", seed=4)
    saved, bare = tmp_path / "saved", tmp_path / "bare"
    hf_qwen3_vl(src).save_pretrained(saved)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(saved / "model.safetensors"))
    assert "model.visual.deepstack_merger_list.1.norm.weight" in tensors
    bare.mkdir()
    save_file({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.visual.")},
              str(bare / "model.safetensors"))
    for where in (saved, bare):     # the model's save leaves the processor out
        (where / "preprocessor_config.json").write_text((tmp_path / "src" / "preprocessor_config.json").read_text())
    (bare / "config.json").write_text((saved / "config.json").read_text())
    images = IMAGES[:3]
    pixel_values, grid_thw = _hf_inputs(src, images)
    want = hf_qwen3_vl_image_rows(src, pixel_values, grid_thw)
    items = [QwenVLImageProcessor.from_model_dir(src)(image) for image in images]
    for where in (saved, bare):
        assert Qwen3VLImageEncoder.stores_tower(str(where))
        for g, w in zip(Qwen3VLImageEncoder.from_checkpoint(where).encode_images(items), want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    text_only = write_tiny_multimodal(tmp_path / "text", "Qwen3VLForConditionalGeneration", num_hidden_layers=1)
    assert not Qwen3VLImageEncoder.stores_tower(text_only)
    with pytest.raises(CheckpointError, match="no Qwen3-VL vision tower"):
        Qwen3VLImageEncoder.from_checkpoint(text_only)


def test_pixels_that_do_not_fit_are_refused(tmp_path):
    path = write_tiny_qwen3_vl(tmp_path / "q", depth=2)
    encoder = Qwen3VLImageEncoder.from_checkpoint(path)
    pixels, size = QwenVLImageProcessor.from_model_dir(path)(_image(30, 40))
    assert pixels.shape == (24, 1536) and encoder.check_pixels(pixels, size) is None
    assert "takes (20, 1536)" in encoder.check_pixels(pixels, (100, 17))       # another size, another grid
    assert "aspect ratio" in encoder.check_pixels(pixels, (1, 300))
    for bad in ((30,), (0, 40), (30.0, 40), "30x40"):
        assert "not a (height, width)" in encoder.check_pixels(pixels, bad)
    with pytest.raises(ValueError, match="image 1: pixels are"):
        encoder.encode_images([(pixels, size), (pixels[:16], size)])
    assert encoder.encode_images([]) == []


def test_unservable_configs_are_refused(tmp_path):
    path = write_tiny_qwen3_vl(tmp_path / "q", depth=2)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    vision_changes = [({"out_hidden_size": 128}, "vision_config.out_hidden_size"), ({"num_heads": 3}, "head size"),
                      ({"hidden_act": "swish"}, "hidden_act"), ({"depth": 0}, "vision_config.depth"),
                      ({"deepstack_visual_indexes": [0, 2]}, "deepstack_visual_indexes"),
                      ({"deepstack_visual_indexes": [1, 1]}, "deepstack_visual_indexes"),
                      ({"deepstack_visual_indexes": 1}, "deepstack_visual_indexes"),
                      ({"num_position_embeddings": 0}, "num_position_embeddings"),
                      ({"rope_parameters": {"rope_type": "default"}}, "rope_type")]
    changes = [({"vision_config": {**config["vision_config"], **c}}, field) for c, field in vision_changes]
    changes += [({"architectures": ["Qwen2VLForConditionalGeneration"]}, "architectures"),
                ({"vision_config": None}, "vision_config")]
    for change, field in changes:
        (tmp_path / "q" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            Qwen3VLImageEncoder.from_checkpoint(path)


def test_prompt_layout_and_transformers_greedy_reference(tmp_path):
    """The chat template's vision tokens, each image's "<|image_pad|>" expanded to tokens_for(size)
    as transformers' processor does, and transformers' greedy tokens changing with the images, and
    with their DeepStack levels alone."""
    from raycluster.model.tokenizer import Tokenizer
    path = write_tiny_qwen3_vl(tmp_path / "q", seed=5)
    encoder, tok = Qwen3VLImageEncoder.from_checkpoint(path), Tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
        {"type": "text", "text": "these."}]}])
    assert "<|vision_start|><|image_pad|><|vision_end|>Compare" in text
    prompt = tok.encode(text, add_special_tokens=False)
    assert prompt.count(VISION_START_ID) == prompt.count(IMAGE_TOKEN_ID) == prompt.count(VISION_END_ID) == 2
    images = [_picture(30, 40, 7), _picture(100, 17, 8)]
    counts = iter([encoder.tokens_for((image.height, image.width)) for image in images])
    ids = [t for token in prompt for t in ([token] * next(counts) if token == IMAGE_TOKEN_ID else [token])]
    processor = hf_qwen3_vl_processor(path)
    hf = processor(images=images, text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
    assert hf["input_ids"][0].tolist() == ids
    assert hf["mm_token_type_ids"][0].tolist() == [int(t == IMAGE_TOKEN_ID) for t in ids]
    want = hf_qwen3_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10)
    assert len(want) == 10
    assert hf_qwen3_vl_greedy(path, ids, None, None, 10) != want                 # the prompt as text alone
    other = processor(images=[_picture(30, 40, 9), _picture(100, 17, 10)], text=[text.replace("<|bos|>", "", 1)],
                      return_tensors="pt")
    assert hf_qwen3_vl_greedy(path, ids, other["pixel_values"], other["image_grid_thw"], 10) != want
    # The DeepStack levels weigh in: with their mergers' outputs zeroed the tokens change.
    flat = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for merger in flat.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    assert hf_qwen3_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10, model=flat) != want
