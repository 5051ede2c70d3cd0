"""Qwen2-VL's and Qwen2.5-VL's image side against transformers 5.24: the processor (smart resize,
rescale, normalize, the merge-block patch rows) equal to `Qwen2VLImageProcessorPil`; the token
count of an image's size equal to what `Qwen2VLProcessor` expands "<|image_pad|>" to; the encoder
(Qwen2-VL's tower, Qwen2.5-VL's windowed one, the merger) equal to `get_image_features` in the
released, transformers 5's and transformers-saved layouts; `grid_for` equal to image_grid_thw
after the merge; what is refused; and the tiny checkpoints' prompt layout equal to transformers'
processor's, with transformers' greedy tokens (the reference the engine is compared against)
depending on the images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from qwen_vl_reference import hf_qwen_vl, hf_qwen_vl_greedy, hf_qwen_vl_processor
from PIL import Image

from raycluster.model.llava import image_encoder_for, image_facts, llava_image_facts, processor_for
from raycluster.model.qwen_vl import QwenVLImageEncoder
from raycluster.model.qwen_vl_processor import QwenVLGrid, QwenVLImageProcessor
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen_vl import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID

transformers = pytest.importorskip("transformers")
QWEN2, QWEN25 = "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "P": 1}[mode]
    px = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(px[..., 0] if channels == 1 else px, "L" if mode == "P" else mode).convert(mode)


# (height, width): wide, tall, square, tiny, thin, odd, up- and downscaled.
SIZES = [(30, 40), (40, 30), (28, 28), (57, 57), (100, 17), (3, 200), (60, 119), (13, 21), (56, 28), (29, 90),
         (1, 1), (200, 150)]
IMAGES = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)] + [
    _image(37, 53, 1, "RGBA"), _image(15, 15, 2, "L"), _image(64, 9, 3, "LA"), _image(33, 47, 4, "P")]

PROCESSORS = [
    {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16},        # the tiny checkpoints'
    {"min_pixels": 3136, "max_pixels": 12845056},                # Qwen2-VL's / Qwen2.5-VL's releases
    {"size": {"shortest_edge": 1000, "longest_edge": 50000}, "resample": 2, "do_normalize": False},
    # size overridden by max_pixels; other patches, merge and frames; a scalar mean / std
    {"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 20000, "patch_size": 16, "merge_size": 1,
     "temporal_patch_size": 1, "image_mean": 0.5, "image_std": 0.25},
    {},                                                          # transformers' defaults
]


def _preprocessor(tmp_path, fields: dict) -> str:
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor", **fields}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("fields", PROCESSORS)
def test_processor_equals_transformers_pil_path(tmp_path, fields):
    path = _preprocessor(tmp_path, fields)
    ours = QwenVLImageProcessor.from_model_dir(path)
    reference = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    images = IMAGES + [_image(500, 1000, 5), _image(900, 300, 6)]
    for image in images:
        pixels, size = ours(image)
        want = reference(image, return_tensors="pt")
        assert size == (image.height, image.width)
        assert ours.grid.grid_thw(size) == tuple(want["image_grid_thw"][0].tolist())
        assert pixels.dtype == torch.float32 and pixels.shape == want["pixel_values"].shape
        torch.testing.assert_close(pixels, want["pixel_values"], rtol=0, atol=1e-6)
    # Both refuse an aspect ratio above 200.
    with pytest.raises(ValueError, match="aspect ratio"):
        reference(_image(2, 500))
    with pytest.raises(ValueError, match="aspect ratio"):
        ours(_image(2, 500))


def test_unusable_pixel_limits_are_refused(tmp_path):
    for fields in ({"size": {"shortest_edge": 100}}, {"size": 100}, {"max_pixels": "a lot"}):
        with pytest.raises(ValueError, match="pixel limits"):
            QwenVLImageProcessor.from_model_dir(_preprocessor(tmp_path, fields))
    assert QwenVLImageProcessor.from_model_dir(tmp_path / "none") is None


def test_token_count_equals_transformers_processor():
    """The count over a sweep of sizes, as Qwen2VLProcessor computes it for the released limits
    and the tiny ones."""
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(1, 3000, size=2)) for _ in range(300)] + \
        [(28, 28), (1, 1), (1, 200), (3000, 3000), (4000, 30)]
    sizes = [s for s in sizes if max(s) / min(s) <= 200]
    for low, high in ((3136, 12845056), (56 * 56, 28 * 28 * 16)):
        grid = QwenVLGrid(min_pixels=low, max_pixels=high)
        processor = transformers.Qwen2VLProcessor.__new__(transformers.Qwen2VLProcessor)
        processor.image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high)
        want = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
        assert [grid.tokens_for(s) for s in sizes] == want


# (architecture, layout, vision options)
CASES = [(QWEN2, "released", {}),
         (QWEN2, "transformers5", {"depth": 3, "num_heads": 4, "mlp_ratio": 4, "max_pixels": 28 * 28 * 40}),
         (QWEN25, "released", {}),
         # Windows of 3 x 3 merge blocks, two blocks over the whole image, larger images.
         (QWEN25, "transformers5", {"depth": 3, "window_size": 84, "fullatt_block_indexes": [0, 2],
                                    "max_pixels": 28 * 28 * 64})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a[:7]}-{layout}-{i}" for i, (a, layout, _) in enumerate(CASES)])
def checkpoint(request, tmp_path_factory):
    arch, layout, options = request.param
    path = write_tiny_multimodal(tmp_path_factory.mktemp("qwen_vl"), arch, seed=3, layout=layout, vision_weights=True,
                                 vision_options=options, num_hidden_layers=2)
    return path, arch


def _hf_inputs(path, images):
    out = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(path))(images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_encoder_equals_transformers_image_features(checkpoint):
    path, arch = checkpoint
    encoder, facts = image_encoder_for(path), image_facts(path)
    assert isinstance(encoder, QwenVLImageEncoder) and isinstance(facts.processor, QwenVLImageProcessor)
    assert encoder.image_token_id == facts.image_token_id == IMAGE_TOKEN_ID
    assert llava_image_facts(path) is None
    images = IMAGES[:12]
    prepared = [facts.prepare(image) for image in images]
    pixel_values, grid_thw = _hf_inputs(path, images)
    hf = hf_qwen_vl(str(path))
    assert type(hf).__name__ == arch
    with torch.no_grad():
        want = hf.get_image_features(pixel_values=pixel_values, image_grid_thw=grid_thw).pooler_output
    assert isinstance(want, tuple) and len(want) == len(images)         # split per image
    got = encoder.encode_images([(pixels, size) for pixels, size, _ in prepared])
    merge = hf.config.vision_config.spatial_merge_size
    for (pixels, size, n), g, w, thw in zip(prepared, got, want, grid_thw.tolist()):
        assert encoder.check_pixels(pixels, size) is None
        assert g.shape == (n, 256) == (encoder.tokens_for(size), 256) and g.dtype == torch.float32
        t, h, w_ = thw
        assert encoder.grid_for(size) == facts.grid_for(size) == (t, h // merge, w_ // merge)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    half = QwenVLImageEncoder.from_checkpoint(path, torch.bfloat16).encode_images([prepared[0][:2]])[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got[0], rtol=0.05, atol=0.1)


@pytest.mark.parametrize("arch", [QWEN2, QWEN25])
def test_encoder_reads_what_transformers_saves(tmp_path, arch):
    """transformers 5.24 saves the tower as `visual.*` beside a nested text_config."""
    src = write_tiny_multimodal(tmp_path / "src", arch, seed=4, layout="transformers5", vision_weights=True,
                                num_hidden_layers=1)
    reference = hf_qwen_vl(src)
    built = getattr(transformers, arch)(reference.config)
    built.load_state_dict(reference.state_dict())
    built.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert "visual.patch_embed.proj.weight" in set(f.keys())
    images = IMAGES[:3]
    pixel_values, grid_thw = _hf_inputs(src, images)
    with torch.no_grad():
        want = reference.get_image_features(pixel_values=pixel_values, image_grid_thw=grid_thw).pooler_output
    items = [processor_for(src)(image) for image in images]
    for g, w in zip(image_encoder_for(tmp_path / "saved").encode_images(items), want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_pixels_that_do_not_fit_are_refused(tmp_path):
    path = write_tiny_multimodal(tmp_path / "q", QWEN25, vision_weights=True, num_hidden_layers=1)
    encoder = image_encoder_for(path)
    pixels, size = processor_for(path)(_image(30, 40))
    assert pixels.shape == (24, 1176) and encoder.check_pixels(pixels, size) is None
    assert "takes (16, 1176)" in encoder.check_pixels(pixels, (100, 17))       # another size, another grid
    assert "aspect ratio" in encoder.check_pixels(pixels, (1, 300))
    for bad in ((30,), (0, 40), (30.0, 40), "30x40"):
        assert "not a (height, width)" in encoder.check_pixels(pixels, bad)
    with pytest.raises(ValueError, match="image 1: pixels are"):
        encoder.encode_images([(pixels, size), (pixels[:16], size)])
    assert encoder.encode_images([]) == []


@pytest.mark.parametrize("arch", [QWEN2, QWEN25])
def test_unservable_configs_are_refused(tmp_path, arch):
    path = write_tiny_multimodal(tmp_path / "q", arch, vision_weights=True, num_hidden_layers=1)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    out = "hidden_size" if arch == QWEN2 else "out_hidden_size"
    for change, field in [({out: 128}, f"vision_config.{out}"), ({"num_heads": 3}, "head size"),
                          ({"hidden_act": "swish"}, "hidden_act"), ({"spatial_merge_size": 1}, "patches")]:
        vision = {**config["vision_config"], **change}
        (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "vision_config": vision}))
        with pytest.raises(ValueError, match=field):
            image_facts(path)
        if field != "patches":       # the encoder alone does not read the processor's patch fields
            with pytest.raises(ValueError, match=field):
                image_encoder_for(path)
    text_only = write_tiny_multimodal(tmp_path / "text", arch, num_hidden_layers=1)
    assert image_encoder_for(text_only) is None and image_facts(text_only) is None


@pytest.mark.parametrize("arch,seed", [(QWEN2, 5), (QWEN25, 3)])
def test_prompt_layout_and_transformers_greedy_reference(tmp_path, arch, seed):
    """The chat template's vision tokens, each image's "<|image_pad|>" expanded to tokens_for(size)
    as transformers' processor does, and transformers' greedy tokens (pixels, grids and the
    image-token marks through get_rope_index) changing with the images."""
    from raycluster.model.tokenizer import Tokenizer
    path = write_tiny_multimodal(tmp_path / "q", arch, seed=seed, vision_weights=True, num_hidden_layers=2)
    facts, tok = image_facts(path), Tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
        {"type": "text", "text": "these."}]}])
    assert "<|vision_start|><|image_pad|><|vision_end|>Compare" in text
    prompt = tok.encode(text, add_special_tokens=False)
    assert prompt.count(VISION_START_ID) == prompt.count(IMAGE_TOKEN_ID) == prompt.count(VISION_END_ID) == 2
    images = [_image(30, 40, 7), _image(100, 17, 8)]
    counts = iter([facts.prepare(image)[2] for image in images])
    ids = [t for token in prompt for t in ([token] * next(counts) if token == IMAGE_TOKEN_ID else [token])]
    hf = hf_qwen_vl_processor(path)(images=images, text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
    assert hf["input_ids"][0].tolist() == ids
    want = hf_qwen_vl_greedy(path, ids, hf["pixel_values"], hf["image_grid_thw"], 10)
    assert len(want) == 10
    other = hf_qwen_vl_processor(path)(images=[_image(30, 40, 9), _image(100, 17, 10)],
                                       text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
    assert hf_qwen_vl_greedy(path, ids, other["pixel_values"], other["image_grid_thw"], 10) != want
