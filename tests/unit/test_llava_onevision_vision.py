"""LLaVA-OneVision's image side against transformers 5.24: the processor (best pinpoint, aspect-keeping
resize, black padding, tiles, base square, each square's steps; OneVision's defaults) equal to
`LlavaOnevisionImageProcessorPil`; the placeholder count of an image's size equal to
`LlavaOnevisionProcessor`'s (its arithmetic over a sweep of sizes, and "<image>" expanded in a
prompt); the encoder (SigLIP tower, projector, tiles on one grid, unpadded, shrunk past
"anyres_max_N", a newline per row) equal to `LlavaOnevisionModel.get_image_features` and to the
inputs_embeds transformers gives its text model, in the released, transformers 5's and
transformers-saved layouts; what is refused; and the text model served from the wrapper's config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from raycluster.model.llava_onevision import ARCHITECTURE, LlavaOnevisionImageEncoder
from raycluster.model.onevision_processor import DEFAULT_PINPOINTS, OnevisionGrid, OnevisionImageProcessor
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_llava_onevision import tiny_pinpoints, write_tiny_llava_onevision

transformers = pytest.importorskip("transformers")


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    px = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(px[..., 0] if channels == 1 else px, mode)


# (height, width): wide, tall, square, tiny, very wide / tall (cropped to a row or two), large
# enough for the 4 x 4 tile grid (shrunk under "anyres_max_9"), ties between pinpoints.
SIZES = [(30, 40), (40, 30), (28, 28), (5, 3), (20, 300), (300, 20), (200, 200), (113, 57), (56, 112), (90, 29)]
IMAGES = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)] + [
    _image(37, 53, 1, "RGBA"), _image(15, 15, 2, "L"), _image(64, 9, 3, "LA")]


def _hf_image_processor(path):
    return transformers.LlavaOnevisionImageProcessorPil.from_pretrained(str(path))


# preprocessor_config.json fields over the tiny checkpoint's (28-pixel tiles, mean / std 0.5).
PROCESSORS = [
    {},
    # Left to OneVision's defaults: the 384-pixel square, CLIP's mean / std, the 36 pinpoints.
    {"size": None, "image_mean": None, "image_std": None, "image_grid_pinpoints": None},
    # Tiles resized past the crop and cropped back, bilinear, no normalize.
    {"size": {"shortest_edge": 32}, "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "resample": 2,
     "do_normalize": False},
]


@pytest.mark.parametrize("fields", PROCESSORS, ids=["tiny", "defaults", "crop"])
def test_processor_equals_transformers_pil_path(tmp_path, fields):
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    config = json.loads((tmp_path / "ov" / "preprocessor_config.json").read_text())
    config = {k: v for k, v in {**config, **fields}.items() if v is not None}
    (tmp_path / "ov" / "preprocessor_config.json").write_text(json.dumps(config))
    ours, reference = OnevisionImageProcessor.from_model_dir(path), _hf_image_processor(path)
    defaults = "size" not in config
    assert ours.tile_size == (384 if defaults else 28)
    assert ours.pinpoints == (DEFAULT_PINPOINTS if defaults else tuple(map(tuple, tiny_pinpoints(28))))
    # On 384-pixel tiles: a wide image on 2 x 6 tiles, one big enough for the 6 x 6 grid.
    images = [IMAGES[0], IMAGES[4], IMAGES[10]] + [_image(500, 1400, 4), _image(2400, 2000, 5)] if defaults else IMAGES
    for image in images:
        pixels, size = ours(image)
        want = reference(image, return_tensors="pt")
        assert size == (image.height, image.width) == tuple(want["image_sizes"][0].tolist())
        assert pixels.dtype == torch.float32
        torch.testing.assert_close(pixels, want["pixel_values"][0], rtol=0, atol=1e-6)
    assert OnevisionImageProcessor.from_model_dir(tmp_path) is None


def _counting_processor(tile: int, patch: int, pinpoints, aspect_ratio: str):
    """LlavaOnevisionProcessor's counting state alone (its constructor wants a video processor,
    which needs torchvision)."""
    processor = transformers.LlavaOnevisionProcessor.__new__(transformers.LlavaOnevisionProcessor)
    processor.image_processor = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile}, image_grid_pinpoints=[list(p) for p in pinpoints])
    processor.num_image_tokens = (tile // patch) ** 2
    processor.vision_feature_select_strategy, processor.vision_aspect_ratio = "full", aspect_ratio
    return processor


def test_token_count_equals_transformers_processor():
    """The count over a sweep of sizes: llava-onevision-qwen2's 384-pixel tiles (27 x 27 features,
    36 pinpoints) and the tiny 28-pixel ones, under anyres_max_9 and a tighter anyres_max_2."""
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(1, 3000, size=2)) for _ in range(300)] + \
        [(384, 384), (2304, 2304), (1, 1), (1, 3000), (3000, 1), (384, 2304), (700, 1400), (5, 3)]
    cases = [(384, 14, DEFAULT_PINPOINTS, "anyres_max_9"),
             (28, 7, tuple(map(tuple, tiny_pinpoints(28))), "anyres_max_9"),
             (28, 7, tuple(map(tuple, tiny_pinpoints(28))), "anyres_max_2")]
    shrunk = 0
    for tile, patch, pinpoints, aspect in cases:
        grid = OnevisionGrid(pinpoints, tile, patch, int(aspect.rpartition("_")[2]))
        processor = _counting_processor(tile, patch, pinpoints, aspect)
        for h, w in sizes:
            assert grid.tokens_for((h, w)) == processor._get_number_of_features(h, w, tile, tile), (tile, aspect, h, w)
            rows, cols = grid.kept((h, w))
            shrunk += grid.packed_shape((h, w)) != (rows.stop - rows.start, cols.stop - cols.start)
    assert shrunk > 100         # the sweep reaches the shrink, not just the plain anyres count
    # A square image on llava-onevision: the 1 x 1 pinpoint, 729 base features, 27 rows of 27 and a newline.
    assert OnevisionGrid(DEFAULT_PINPOINTS, 384, 14).tokens_for((384, 384)) == 729 + 27 * 28


def test_prompt_expansion_equals_transformers_processor(tmp_path, monkeypatch):
    """LlavaOnevisionProcessor expanding each "<image>" of a prompt, images given flat (each its own anyres)."""
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    encoder = LlavaOnevisionImageEncoder.from_checkpoint(path)
    # The constructor type-checks its video processor through a mapping that needs torchvision.
    monkeypatch.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", lambda *args: None)
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=_hf_image_processor(path), tokenizer=transformers.AutoTokenizer.from_pretrained(str(path)),
        video_processor=None, **json.loads((tmp_path / "ov" / "processor_config.json").read_text()))
    images = IMAGES[:7]
    out = processor(images=images, text=["Look: <image>" * 3 + " and <image><image> then " + "<image>" * 2],
                    return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids.count(IMAGE_TOKEN_ID) == sum(encoder.tokens_for((im.height, im.width)) for im in images)
    one = processor(images=[IMAGES[6]], text=["<image>"], return_tensors="pt")["input_ids"][0].tolist()
    assert one.count(IMAGE_TOKEN_ID) == encoder.tokens_for((200, 200)) == 16 + 12 * 13     # shrunk from 16 x 16


# (layout, vision_config fields, top-level fields)
CASES = [("released", {}, {}),
         ("transformers5", {}, {"vision_feature_layer": [-2, 0], "projector_hidden_act": "quick_gelu",
                                "vision_aspect_ratio": "anyres_max_2"}),
         # 42-pixel tiles in 14-pixel patches (3 x 3 features); the second-to-last of 3 layers.
         ("released", {"image_size": 42, "patch_size": 14, "num_hidden_layers": 3},
          {"vision_feature_layer": -2, "multimodal_projector_bias": False, "image_grid_pinpoints": tiny_pinpoints(42)})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{layout}-{i}" for i, (layout, _, _) in enumerate(CASES)])
def checkpoint(request, tmp_path_factory):
    layout, vision, fields = request.param
    path = write_tiny_llava_onevision(tmp_path_factory.mktemp("ov"), seed=3, layout=layout, vision=vision, **fields)
    hf = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _hf_inputs(path, images):
    """transformers' processor output for `images` given flat (tiles padded to the most any image has)."""
    out = _hf_image_processor(path)(images, return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def test_encoder_equals_transformers_image_features(checkpoint):
    path, hf = checkpoint
    encoder, processor = LlavaOnevisionImageEncoder.from_checkpoint(path), OnevisionImageProcessor.from_model_dir(path)
    assert encoder.image_token_id == IMAGE_TOKEN_ID and LlavaOnevisionImageEncoder.stores_tower(path)
    assert (processor.tile_size, processor.pinpoints) == (encoder.image_size, encoder.grid.pinpoints)
    images = IMAGES[:10]
    items = [processor(image) for image in images]
    pixel_values, image_sizes = _hf_inputs(path, images)
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixel_values, image_sizes=image_sizes).pooler_output
    got = encoder.encode_images(items)
    for (pixels, size), g, w in zip(items, got, want):
        assert encoder.check_pixels(pixels, size) is None
        assert g.shape == (encoder.tokens_for(size), 256) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    half = LlavaOnevisionImageEncoder.from_checkpoint(path, torch.bfloat16).encode_images([items[6]])[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got[6], rtol=0.05, atol=0.1)
    # The "default" strategy we refuse, transformers' packing refuses too: each tile a feature short of a square.
    with pytest.raises(ValueError, match="not consistent"), torch.no_grad():
        hf.model.get_image_features(pixel_values=pixel_values[:1], image_sizes=image_sizes[:1],
                                    vision_feature_select_strategy="default")


def test_features_are_what_transformers_gives_its_text_model(checkpoint):
    """The whole model's inputs_embeds for a prompt with two images: ours at the image tokens."""
    path, hf = checkpoint
    encoder, processor = LlavaOnevisionImageEncoder.from_checkpoint(path), OnevisionImageProcessor.from_model_dir(path)
    images = [IMAGES[6], IMAGES[4]]
    items = [processor(image) for image in images]
    counts = [encoder.tokens_for(size) for _, size in items]
    ids = [0, 9, 10] + [IMAGE_TOKEN_ID] * counts[0] + [11] + [IMAGE_TOKEN_ID] * counts[1] + [12]
    pixel_values, image_sizes = _hf_inputs(path, images)
    seen = {}

    def capture(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"][0]

    hook = hf.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values, image_sizes=image_sizes)
    finally:
        hook.remove()
    image_rows = seen["embeds"][torch.tensor(ids) == IMAGE_TOKEN_ID]
    torch.testing.assert_close(torch.cat(encoder.encode_images(items)), image_rows, rtol=0, atol=1e-5)


def test_encoder_reads_what_transformers_saves(tmp_path, checkpoint):
    """A model transformers 5.24 built (not loaded) saves its tower as the bare `vision_tower.*`."""
    path, hf = checkpoint
    built = transformers.LlavaOnevisionForConditionalGeneration(hf.config)
    built.load_state_dict(hf.state_dict())
    built.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "vision_tower.embeddings.patch_embedding.weight" in names and "image_newline" in names
    processor = OnevisionImageProcessor.from_model_dir(path)
    items = [processor(image) for image in IMAGES[5:8]]
    ours = LlavaOnevisionImageEncoder.from_checkpoint(path).encode_images(items)
    for g, w in zip(LlavaOnevisionImageEncoder.from_checkpoint(tmp_path / "saved").encode_images(items), ours):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_pixels_that_do_not_fit_are_refused(tmp_path):
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    encoder, processor = LlavaOnevisionImageEncoder.from_checkpoint(path), OnevisionImageProcessor.from_model_dir(path)
    pixels, size = processor(_image(30, 40))
    assert pixels.shape == (5, 3, 28, 28) and encoder.check_pixels(pixels, size) is None
    assert "takes (17, 3, 28, 28)" in encoder.check_pixels(pixels, (200, 200))      # another size, another grid
    assert "takes (5, 3, 28, 28)" in encoder.check_pixels(pixels[:, :, :14], size)
    for bad in ((30,), (0, 40), (30.0, 40), "30x40"):
        assert "not a (height, width)" in encoder.check_pixels(pixels, bad)
    with pytest.raises(ValueError, match="image 1: pixels are"):
        encoder.encode_images([(pixels, size), (pixels[:3], size)])
    assert encoder.encode_images([]) == []


def test_a_grid_shrunk_to_no_rows_leaves_the_base_square():
    """One row of 3-feature tiles 16 wide under anyres_max_1 shrinks to 0 rows: the processor counts
    the base square alone, and so do we (transformers' interpolate takes no empty size and raises)."""
    config = {"vision_config": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "image_size": 42, "patch_size": 14},
              "image_grid_pinpoints": [[42, 672]], "vision_aspect_ratio": "anyres_max_1", "image_token_index": 7}
    encoder = LlavaOnevisionImageEncoder(config, 16)
    for p in encoder.parameters():
        torch.nn.init.normal_(p, std=0.1)
    processor = _counting_processor(42, 14, ((42, 672),), "anyres_max_1")
    assert encoder.grid.packed_shape((10, 1000)) == (0, 20)
    assert encoder.tokens_for((10, 1000)) == processor._get_number_of_features(10, 1000, 42, 42) == 9
    (out,) = encoder.encode_images([(torch.randn(17, 3, 42, 42), (10, 1000))])
    assert out.shape == (9, 16)


def test_unservable_configs_are_refused(tmp_path):
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    config = json.loads((tmp_path / "ov" / "config.json").read_text())
    vision = config["vision_config"]
    for change, field in [({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy"),
                          ({"vision_aspect_ratio": "anyres"}, "vision_aspect_ratio"),
                          ({"vision_aspect_ratio": "anyres_max_0"}, "vision_aspect_ratio"),
                          ({"vision_feature_layer": 3}, "vision_feature_layer"),
                          ({"vision_feature_layer": "last"}, "vision_feature_layer"),
                          ({"image_grid_pinpoints": [[28, 50]]}, "image_grid_pinpoints"),
                          ({"projector_hidden_act": "swish!"}, "projector_hidden_act"),
                          ({"vision_config": {**vision, "model_type": "clip_vision_model"}},
                           "vision_config.model_type")]:
        (tmp_path / "ov" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            LlavaOnevisionImageEncoder.from_checkpoint(path)
    preprocessor = json.loads((tmp_path / "ov" / "preprocessor_config.json").read_text())
    for change, field in [({"do_center_crop": True}, "crop_size"), ({"image_grid_pinpoints": [[28, 30]]},
                                                                    "image_grid_pinpoints")]:
        (tmp_path / "ov" / "preprocessor_config.json").write_text(json.dumps({**preprocessor, **change}))
        with pytest.raises(ValueError, match=field):
            OnevisionImageProcessor.from_model_dir(path)
    from raycluster.model.tiny_multimodal import write_tiny_multimodal
    text_only = write_tiny_multimodal(tmp_path / "text", ARCHITECTURE, num_hidden_layers=1)
    assert not LlavaOnevisionImageEncoder.stores_tower(text_only)


def test_text_model_is_served(checkpoint):
    """The wrapper's Qwen2 text model, loaded from the image-text checkpoint: transformers' logits on text."""
    from test_model_hf import _prompt, run_chunks

    from raycluster.model.loader import load_model
    path, hf = checkpoint
    model, cfg = load_model(path)
    assert cfg.multimodal == ARCHITECTURE and cfg.architecture == "Qwen2ForCausalLM"
    ids = _prompt(40, 4000)
    ours, _, _ = run_chunks(model, ids, [len(ids)])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
