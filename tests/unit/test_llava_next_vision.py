"""LLaVA-NeXT's image side against transformers 5.24: the anyres processor (best pinpoint, the
aspect-keeping resize, the black padding, the tiles, the base square, each square's CLIP steps)
equal to `LlavaNextImageProcessorPil`; the placeholder count of an image's size equal to what
`LlavaNextProcessor` expands "<image>" to; the encoder (tower, projector, tiles on one grid,
unpadded, a newline per row) equal to `LlavaNextForConditionalGeneration.get_image_features` in
the released, transformers 5's and transformers-saved layouts; what is refused; our text model
given our features at the image tokens generating transformers' greedy tokens; and LLaVA-1.5's
encoder and facts answering the same common interface."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llava_reference import hf_llava_next, hf_llava_next_greedy
from PIL import Image

from kernels.metadata import AttentionMetadata
from raycluster.model.anyres import DEFAULT_PINPOINTS, AnyresGrid, AnyresImageProcessor
from raycluster.model.image_processor import CLIP_MEAN, CLIP_STD, ImageProcessor
from raycluster.model.llava import (LlavaImageEncoder, image_encoder_for, image_facts, llava_image_facts,
                                    processor_for)
from raycluster.model.llava_next import LlavaNextImageEncoder
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_multimodal import write_tiny_multimodal

transformers = pytest.importorskip("transformers")
NEXT, LLAVA = "LlavaNextForConditionalGeneration", "LlavaForConditionalGeneration"


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    px = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(px[..., 0] if channels == 1 else px, mode)


# (height, width): wide, tall, square, tiny, extreme (a grid cropped to no rows), ties between pinpoints.
SIZES = [(30, 40), (40, 30), (28, 28), (57, 57), (100, 17), (3, 200), (60, 119), (13, 21), (56, 28), (29, 90)]
IMAGES = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)] + [
    _image(37, 53, 1, "RGBA"), _image(15, 15, 2, "L"), _image(64, 9, 3, "LA")]

PROCESSORS = [
    {"image_grid_pinpoints": [[28, 56], [56, 28], [56, 56]]},                  # the tiny checkpoint's
    {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},  # llava-v1.6's (default pinpoints)
    # Tiles resized past the crop and cropped back, bilinear, no normalize; a 1x1 pinpoint.
    {"size": {"shortest_edge": 32}, "resample": 2, "do_normalize": False,
     "image_grid_pinpoints": [[28, 84], [84, 28], [56, 56], [28, 28]]},
    {"size": {"height": 30, "width": 40}, "image_grid_pinpoints": [[28, 56], [56, 28]]},  # the base not square
]


def _preprocessor(tmp_path, fields: dict) -> str:
    config = {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
              "resample": 3, "size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28},
              "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "do_pad": True, **fields}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("fields", PROCESSORS)
def test_processor_equals_transformers_pil_path(tmp_path, fields):
    path = _preprocessor(tmp_path, fields)
    ours = AnyresImageProcessor.from_model_dir(path)
    reference = transformers.LlavaNextImageProcessorPil.from_pretrained(path)
    images = IMAGES + ([_image(500, 1000, 4), _image(900, 300, 5), _image(336, 336, 6)] if "size" in fields and
                       fields["size"].get("shortest_edge") == 336 else [])
    for image in images:
        pixels, size = ours(image)
        want = reference(image, return_tensors="pt")
        assert size == (image.height, image.width) == tuple(want["image_sizes"][0].tolist())
        assert pixels.dtype == torch.float32
        torch.testing.assert_close(pixels, want["pixel_values"][0], rtol=0, atol=1e-6)


def test_token_count_equals_transformers_processor():
    """The count over a sweep of sizes, for llava-v1.6's 336-pixel tiles and the tiny 28-pixel ones,
    as LlavaNextProcessor computes it (llava-v1.6's processor_config: the CLS counted, then dropped)."""
    rng = np.random.default_rng(0)
    sizes = [tuple(int(v) for v in rng.integers(1, 1500, size=2)) for _ in range(300)] + \
        [(336, 336), (672, 672), (1, 1), (336, 1008), (1008, 336), (500, 1000), (1000, 500)]
    for tile, pinpoints in ((336, DEFAULT_PINPOINTS), (28, ((28, 56), (56, 28), (56, 56)))):
        grid = AnyresGrid(pinpoints, tile, 14)
        processor = transformers.LlavaNextProcessor.__new__(transformers.LlavaNextProcessor)
        processor.image_processor = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
            image_grid_pinpoints=[list(p) for p in pinpoints])
        processor.patch_size, processor.num_additional_image_tokens = 14, 1
        processor.vision_feature_select_strategy = "default"
        for h, w in sizes:
            want = processor._get_number_of_features(h, w, tile, tile) - 1
            assert grid.tokens_for((h, w)) == want, (tile, h, w)
    # A square image on llava-v1.6: the 336x672 pinpoint (the first of a tie), its 24x48 grid cut to
    # 24 columns, each row and its newline after the base's 576.
    assert AnyresGrid(DEFAULT_PINPOINTS, 336, 14).tokens_for((336, 336)) == 576 + 24 * (24 + 1)


# (layout, vision options)
CASES = [("released", {}),
         ("transformers5", {"vision_feature_layer": [-2, 0], "projector_hidden_act": "quick_gelu"}),
         ("released", {"image_size": 42, "num_hidden_layers": 3, "multimodal_projector_bias": False,
                       "image_grid_pinpoints": [[42, 84], [84, 42], [84, 84], [42, 126], [126, 42]]})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{layout}-{i}" for i, (layout, _) in enumerate(CASES)])
def checkpoint(request, tmp_path_factory):
    layout, options = request.param
    path = write_tiny_multimodal(tmp_path_factory.mktemp("next"), NEXT, seed=3, layout=layout, vision_weights=True,
                                 vision_options=options, num_hidden_layers=2)
    return path, options


def _hf_inputs(path, images):
    """transformers' processor output for `images` (tiles padded to the most any image has)."""
    out = transformers.LlavaNextImageProcessorPil.from_pretrained(str(path))(images, return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def test_encoder_equals_transformers_image_features(checkpoint):
    path, options = checkpoint
    encoder, facts = image_encoder_for(path), image_facts(path)
    assert isinstance(encoder, LlavaNextImageEncoder)
    assert encoder.image_token_id == facts.image_token_id == IMAGE_TOKEN_ID
    assert llava_image_facts(path) is None          # LLaVA-1.5's pair has no per-image count
    images = IMAGES[:8]
    prepared = [facts.prepare(image) for image in images]
    pixel_values, image_sizes = _hf_inputs(path, images)
    with torch.no_grad():
        want = hf_llava_next(str(path)).get_image_features(pixel_values=pixel_values, image_sizes=image_sizes)
    got = encoder.encode_images([(pixels, size) for pixels, size, _ in prepared])
    for (pixels, size, n), g, w in zip(prepared, got, want.pooler_output):
        assert encoder.check_pixels(pixels, size) is None
        assert g.shape == (n, 256) == (encoder.tokens_for(size), 256) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    half = LlavaNextImageEncoder.from_checkpoint(path, torch.bfloat16).encode_images([prepared[0][:2]])[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got[0], rtol=0.05, atol=0.1)


def test_encoder_reads_what_transformers_saves(tmp_path):
    """A model transformers 5.24 built (not loaded) saves its tower as `vision_tower.*` (no
    `vision_model.`) and the newline as `image_newline`."""
    src = write_tiny_multimodal(tmp_path / "src", NEXT, seed=4, vision_weights=True, num_hidden_layers=2)
    built = transformers.LlavaNextForConditionalGeneration(hf_llava_next(src).config)
    built.load_state_dict(hf_llava_next(src).state_dict())
    built.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "vision_tower.embeddings.patch_embedding.weight" in names and "image_newline" in names
    images = IMAGES[:3]
    pixel_values, image_sizes = _hf_inputs(src, images)
    with torch.no_grad():
        want = hf_llava_next(src).get_image_features(pixel_values=pixel_values, image_sizes=image_sizes).pooler_output
    items = [processor_for(src)(image) for image in images]
    for g, w in zip(image_encoder_for(tmp_path / "saved").encode_images(items), want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_pixels_that_do_not_fit_are_refused(tmp_path):
    path = write_tiny_multimodal(tmp_path / "next", NEXT, vision_weights=True, num_hidden_layers=1)
    encoder = image_encoder_for(path)
    pixels, size = processor_for(path)(_image(30, 40))
    assert pixels.shape == (5, 3, 28, 28) and encoder.check_pixels(pixels, size) is None
    assert "takes (3, 3, 28, 28)" in encoder.check_pixels(pixels, (100, 17))       # another size, another grid
    for bad in ((30,), (0, 40), (30.0, 40), "30x40"):
        assert "not a (height, width)" in encoder.check_pixels(pixels, bad)
    with pytest.raises(ValueError, match="image 1: pixels are"):
        encoder.encode_images([(pixels, size), (pixels[:3], size)])
    assert encoder.encode_images([]) == []


def test_unservable_configs_are_refused(tmp_path):
    path = write_tiny_multimodal(tmp_path / "next", NEXT, vision_weights=True, num_hidden_layers=1)
    config = json.loads((tmp_path / "next" / "config.json").read_text())
    for change, field in [({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
                          ({"image_grid_pinpoints": [[28, 50]]}, "image_grid_pinpoints"),
                          ({"image_grid_pinpoints": [[56, 56]]}, "preprocessor_config.json's tiles")]:
        (tmp_path / "next" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            image_facts(path)
        if field != "preprocessor_config.json's tiles":       # the encoder alone does not read the processor
            with pytest.raises(ValueError, match=field):
                image_encoder_for(path)
    text_only = write_tiny_multimodal(tmp_path / "text", NEXT, num_hidden_layers=1)
    assert image_encoder_for(text_only) is None and image_facts(text_only) is None


def _our_greedy(model, ids: list[int], image_rows, n: int, block_size: int = 16) -> list[int]:
    """Our text model's greedy tokens: the prompt in one chunk with `image_rows` over its image
    tokens' embeddings, then one token at a time through the paged cache."""
    table = list(range(-(-(len(ids) + n) // block_size)))
    cache = torch.zeros(model.kv_cache_shape(len(table), block_size))
    out, pos, chunk = [], 0, list(ids)
    for _ in range(n):
        c = len(chunk)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(pos, pos + c)])
        meta = AttentionMetadata(c, 0, [c], [pos + c], [table], [], [], slots, block_size)
        rows = image_rows if pos == 0 else ()
        hidden = model(torch.tensor(chunk), torch.arange(pos, pos + c), cache, meta, image_rows=rows)
        out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        pos, chunk = pos + c, out[-1:]
    return out


def test_our_features_in_our_text_model_generate_transformers_tokens(tmp_path):
    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    path = write_tiny_multimodal(tmp_path / "next", NEXT, seed=3, vision_weights=True, num_hidden_layers=2)
    facts, encoder, tok = image_facts(path), image_encoder_for(path), Tokenizer(path)
    model, _ = load_model(path)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"},
        {"type": "text", "text": "these."}]}])
    prompt = tok.encode(text, add_special_tokens=False)
    images = [_image(30, 40, 7), _image(100, 17, 8)]
    prepared = [facts.prepare(image) for image in images]
    ids, rows = [], []
    features = encoder.encode_images([(p, s) for p, s, _ in prepared])
    it = iter(zip(prepared, features))
    for t in prompt:
        if t != IMAGE_TOKEN_ID:
            ids.append(t)
            continue
        (_, _, n), f = next(it)
        rows.append((len(ids), f))
        ids.extend([IMAGE_TOKEN_ID] * n)
    # transformers' own processor lays the prompt out the same way (its tokenizer adds the BOS itself).
    hf_processor = transformers.LlavaNextProcessor.from_pretrained(str(path))
    hf = hf_processor(images=images, text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
    assert hf["input_ids"][0].tolist() == ids
    want = hf_llava_next_greedy(path, ids, hf["pixel_values"], hf["image_sizes"], 10)
    assert _our_greedy(model, ids, rows, 10) == want
    blank = [(r, torch.zeros_like(f)) for r, f in rows]
    assert _our_greedy(model, ids, blank, 10) != want         # the images change what the model says


def test_llava_15_answers_the_common_interface(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", LLAVA, seed=3, vision_weights=True, num_hidden_layers=2)
    encoder, facts = image_encoder_for(path), image_facts(path)
    assert isinstance(encoder, LlavaImageEncoder) and encoder.image_token_id == facts.image_token_id == IMAGE_TOKEN_ID
    assert llava_image_facts(path) == (IMAGE_TOKEN_ID, 4)
    steps = ImageProcessor.from_model_dir(path)
    items = []
    for image in IMAGES[:4]:
        pixels, size, n = facts.prepare(image)
        torch.testing.assert_close(pixels, steps(image), rtol=0, atol=0)
        assert size == (image.height, image.width) and n == encoder.tokens_for(size) == encoder.tokens_per_image == 4
        assert encoder.check_pixels(pixels, size) is None
        items.append((pixels, size))
    assert "the encoder takes (3, 28, 28)" in encoder.check_pixels(torch.zeros(3, 28, 29), (28, 29))
    got = encoder.encode_images(items)
    want = encoder.encode(torch.stack([p for p, _ in items]))
    assert len(got) == 4 and all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="image 0: pixels are"):
        encoder.encode_images([(torch.zeros(5, 3, 28, 28), (30, 40))])
    assert processor_for(path) == facts.processor
