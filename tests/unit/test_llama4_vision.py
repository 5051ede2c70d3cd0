"""Llama 4's image side against transformers 5.24: the image processor equal to Llama4ImageProcessor
as Llama4Processor calls it (sizes, aspect ratios, 1 tile and several, resamplings, the max-canvas
mode, image modes; what it cannot do refused, naming the field); an image's prompt span
(`span_ids`, `tokens_for`, `feature_runs`) equal to Llama4Processor's expansion of "<|image|>"; the
tower + projector equal to `get_image_features` + `multi_modal_projector` for several images of
different tile counts in one call, laid out per span (features at the <|patch|> runs, zero rows at
the start / end / separators / <|image|>), in the released layout, the `model.` one and what
transformers' save_pretrained writes; those spans put into the prompt's embeddings give
transformers' logits; pixels that do not fit and bad configs refused; greedy tokens change with the
image.

transformers' Llama 4 image processor needs torchvision, absent here: llama4_reference runs it on a
stand-in for torchvision's three kernels it calls (see there). The tower's features match to
float32 rounding, not bit for bit (one projection over all tiles there, per tile here)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from llama4_reference import (hf_image_processed, hf_llama4, hf_llama4_greedy, hf_llama4_logits, hf_processed,
                              hf_token_embeddings)
from PIL import Image

from raycluster.model.llama4_image import Llama4ImageEncoder
from raycluster.model.llama4_processor import Llama4ImageProcessor
from raycluster.model.tiny_llama4_vl import TOKEN_IDS, write_tiny_llama4_vl

transformers = pytest.importorskip("transformers")
FEATURES = {"rtol": 1e-5, "atol": 1e-5}       # float32 rounding (module docstring)
START, END, IMAGE, PATCH, X_SEP, Y_SEP = TOKEN_IDS


def _images(seed: int = 0) -> list[Image.Image]:
    """Random images of odd sizes and aspect ratios (one tile, several, a strip, one pixel, exactly
    a tile) and every mode a request may bring."""
    rng = np.random.default_rng(seed)
    px = lambda h, w, c: rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)    # noqa: E731
    palette = Image.fromarray(px(13, 21, 3)).convert("P")
    palette.info["transparency"] = 0       # a palette image with a transparent color
    return [Image.fromarray(px(37, 53, 3)), Image.fromarray(px(101, 29, 4), "RGBA"),
            Image.fromarray(px(15, 15, 1)[..., 0], "L"), Image.fromarray(px(64, 9, 2), "LA"), palette,
            Image.fromarray(px(16, 16, 3)), Image.fromarray(px(7, 200, 3)), Image.fromarray(px(1, 1, 3)),
            Image.fromarray(px(90, 61, 3)), Image.fromarray(px(33, 64, 3))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama4_vl(tmp_path_factory.mktemp("llama4"), seed=3)


# Llama 4 Scout's preprocessor_config.json but for a 16-pixel tile and at most 4 tiles.
RELEASED = {"image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
            "crop_size": None, "data_format": "channels_first", "default_to_square": True, "device": None,
            "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "input_data_format": None, "max_patches": 4,
            "resample": 2, "rescale_factor": 0.00392156862745098, "resize_to_max_canvas": False,
            "return_tensors": None, "size": {"height": 16, "width": 16}}
# (preprocessor_config.json, processor_config.json's patch_size and pixel_shuffle_ratio)
PROCESSORS = [(RELEASED, 4, 0.5),
              ({**RELEASED, "resample": 3, "resize_to_max_canvas": True, "image_mean": [0.48, 0.46, 0.41],
                "image_std": [0.27, 0.26, 0.28]}, 4, 0.5),
              ({**RELEASED, "resample": 0, "max_patches": 6, "size": {"height": 24, "width": 24}}, 3, 0.5),
              ({**RELEASED, "do_normalize": False, "size": 20}, 5, 1.0),
              ({"image_processor_type": "Llama4ImageProcessorFast"}, None, None)]       # every default


def _processor_dir(tmp_path, tiny, fields: dict, patch, ratio):
    """A directory with the tiny tokenizer and these processor files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", tmp_path / name)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    processor = {"processor_class": "Llama4Processor", "patch_size": patch, "pixel_shuffle_ratio": ratio}
    (tmp_path / "processor_config.json").write_text(json.dumps({k: v for k, v in processor.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize("fields,patch,ratio", PROCESSORS, ids=["released", "bicubic-max-canvas", "nearest-6",
                                                                "rescale-only", "defaults"])
def test_image_processor_equals_transformers(tmp_path, tiny, fields, patch, ratio):
    path = _processor_dir(tmp_path, tiny, fields, patch, ratio)
    ours = Llama4ImageProcessor.from_model_dir(path)
    images = _images() + [Image.fromarray(np.random.default_rng(1).integers(0, 256, (410, 730, 3), dtype=np.uint8))]
    want, canvases = hf_image_processed(path, images)
    assert len(set(canvases)) > 1        # one tile and several
    for image, expected, canvas in zip(images, want, canvases):
        got, size = ours(image)
        assert got.dtype == torch.float32 and size == (image.height, image.width)
        assert ours.grid.canvas(size) == canvas and got.shape[0] == ours.grid.tiles_for(size)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Llama4Processor's tokens per tile (its patch_size and pixel_shuffle_ratio) are the grid's.
    ids, _, _ = hf_processed(path, "<|image|>", images[5:6])
    assert ids.count(PATCH) == ours.grid.tokens_per_tile * ours.grid.tiles_for((16, 16))


@pytest.mark.parametrize("max_canvas", [False, True])
def test_the_canvas_of_many_sizes_equals_transformers(tmp_path, tiny, max_canvas):
    """get_best_fit's ties and the resize targets' float32 / float64 arithmetic over a sweep."""
    path = _processor_dir(tmp_path, tiny, {**RELEASED, "resize_to_max_canvas": max_canvas, "max_patches": 6}, 4, 0.5)
    sides = [1, 8, 15, 16, 17, 31, 32, 33, 47, 48, 49, 65, 97, 250]
    images = [Image.new("RGB", (w, h), (h % 256, w % 256, 9)) for h in sides for w in sides]
    want, canvases = hf_image_processed(path, images)
    ours = Llama4ImageProcessor.from_model_dir(path)
    for image, expected, canvas in zip(images, want, canvases):
        got, size = ours(image)
        assert ours.grid.canvas(size) == canvas, size
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(set(canvases)) >= 8


def test_image_processor_absent_and_refused(tmp_path, tiny):
    assert Llama4ImageProcessor.from_model_dir(tmp_path) is None
    for change, field in [({"size": {"height": 16, "width": 32}}, "'size'"), ({"do_resize": False}, "do_resize"),
                          ({"do_rescale": False}, "do_rescale"), ({"resample": 1}, "resample"),
                          ({"max_patches": 0}, "max_patches"), ({"image_std": [0.5, 0, 0.5]}, "image_std"),
                          ({"image_mean": [0.5, 0.5]}, "image_mean"), ({"resize_to_max_canvas": "no"},
                                                                      "resize_to_max_canvas")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**RELEASED, **change}))
        with pytest.raises(ValueError, match=field):
            Llama4ImageProcessor.from_model_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(RELEASED))
    for fields, field in [({"patch_size": 0}, "patch_size"), ({"pixel_shuffle_ratio": 0}, "pixel_shuffle_ratio")]:
        (tmp_path / "processor_config.json").write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=field):
            Llama4ImageProcessor.from_model_dir(tmp_path)
    with pytest.raises(ValueError, match="0x5 pixels has no pixel"):
        Llama4ImageProcessor(RELEASED, 4).grid.tokens_for((0, 5))


def _expanded_ids(path, text: str, spans: list[list[int]]) -> list[int]:
    """Our expansion: the text's k-th "<|image|>" replaced by image k's span, tokenized."""
    from raycluster.model.tokenizer import Tokenizer
    tokenizer = Tokenizer(path)
    pieces = text.split("<|image|>")
    assert len(pieces) == len(spans) + 1
    out = tokenizer.encode(pieces[0], add_special_tokens=False)
    for span, piece in zip(spans, pieces[1:]):
        out += span + tokenizer.encode(piece, add_special_tokens=False)
    return out


def test_span_ids_equal_the_processors_expansion(tiny):
    with torch.device("meta"):      # the prompt side needs no weights
        encoder = Llama4ImageEncoder.for_model_dir(tiny)
        assert encoder.tokens_for((37, 53)) == 27 and encoder.check_pixels(torch.zeros(5, 3, 16, 16), (37, 53)) is None
    assert Llama4ImageProcessor.from_model_dir(tiny).grid == encoder.grid
    assert encoder.span_tokens == TOKEN_IDS
    assert encoder.image_token_id == PATCH == hf_llama4(str(tiny)).config.image_token_id
    assert encoder.placeholder_token_id == IMAGE and (encoder.image_start_token_id, encoder.image_end_token_id) == (
        START, END) and (encoder.tile_x_separator_token_id, encoder.tile_y_separator_token_id) == (X_SEP, Y_SEP)
    images = _images(1)
    text = "Look:<|image|> and<|image|>" + "<|image|>" * (len(images) - 2) + " done."
    ids, _, canvases = hf_processed(tiny, text, images)
    sizes = [(i.height, i.width) for i in images]
    spans = [encoder.span_ids(size) for size in sizes]
    assert ids == _expanded_ids(tiny, text, spans)
    assert {r * c for r, c in canvases} >= {1, 2, 4}
    for size, span, (rows, columns) in zip(sizes, spans, canvases):
        runs, n, t = encoder.feature_runs(size), rows * columns, encoder.grid.tokens_per_tile
        assert len(span) == encoder.tokens_for(size) and span[0] == START and span[-1] == END and span.count(IMAGE) == 1
        assert len(runs) == n + (n > 1) and all(b - a == t for a, b in runs)
        assert [j for j, tok in enumerate(span) if tok == PATCH] == [j for a, b in runs for j in range(a, b)]
        assert span.count(X_SEP) == (rows * (columns - 1) if n > 1 else 0)
        assert span.count(Y_SEP) == (rows if n > 1 else 0)
    # One tile; one row of two (the global tile after <|image|>); two rows of two.
    assert encoder.span_ids((16, 16)) == [START, IMAGE] + [PATCH] * 4 + [END]
    assert encoder.feature_runs((16, 16)) == [(2, 6)]
    assert encoder.span_ids((16, 32)) == [START] + [PATCH] * 4 + [X_SEP] + [PATCH] * 4 + [Y_SEP, IMAGE] + [
        PATCH] * 4 + [END]
    assert encoder.feature_runs((16, 32)) == [(1, 5), (6, 10), (12, 16)]
    assert encoder.feature_runs((32, 32)) == [(1, 5), (6, 10), (11, 15), (16, 20), (22, 26)]


# (layout, options): the default tiny tower, and another shape: 3 layers of 48 wide in 3 heads,
# 3-pixel patches of 24-pixel tiles (an 8 x 8 grid: 16 tokens a tile), a 40-wide adapter, bicubic
# up to 3 tiles, the rotary's base as transformers 5 saves it.
CASES = [("released", {}),
         ("transformers5", {"num_hidden_layers": 3, "hidden_size": 48, "num_attention_heads": 3, "patch_size": 3,
                            "image_size": 24, "projector_output_dim": 40, "max_patches": 3, "resample": 3})]


@pytest.fixture(scope="module", params=CASES, ids=[layout for layout, _ in CASES])
def checkpoint(request, tmp_path_factory):
    layout, options = request.param
    return write_tiny_llama4_vl(tmp_path_factory.mktemp("llama4"), seed=5, layout=layout, **options)


def _processed(path, images):
    processor = Llama4ImageProcessor.from_model_dir(path)
    return [processor(image) for image in images]


def _hf_spans(path, encoder, items) -> list[torch.Tensor]:
    """transformers' features of the images, projected as its forward does, laid out per span by hand."""
    model = hf_llama4(str(path))
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.cat([p for p, _ in items])).last_hidden_state
        projected = model.multi_modal_projector(features.view(-1, features.size(-1)))
    spans, at = [], 0
    for _, size in items:
        span = torch.zeros(encoder.tokens_for(size), projected.shape[-1])
        where = [j for a, b in encoder.feature_runs(size) for j in range(a, b)]
        span[where] = projected[at:at + len(where)]
        at += len(where)
        spans.append(span)
    assert at == len(projected)
    return spans


def test_encoder_equals_transformers_image_features(checkpoint):
    encoder = Llama4ImageEncoder.from_checkpoint(checkpoint)
    assert Llama4ImageEncoder.stores_tower(checkpoint) and encoder.ARCHITECTURE == "Llama4ForConditionalGeneration"
    assert not encoder.bidirectional
    items = _processed(checkpoint, _images(2)[:6])       # six sizes, one call
    got = encoder.encode_images(items)
    want = _hf_spans(checkpoint, encoder, items)
    assert [tuple(g.shape) for g in got] == [(encoder.tokens_for(s), 256) for _, s in items]
    assert got[0].dtype == torch.float32 and len({len(p) for p, _ in items}) >= 3       # 1 tile and several
    for g, w, (_, size) in zip(got, want, items):
        torch.testing.assert_close(g, w, **FEATURES)
        features = [j for a, b in encoder.feature_runs(size) for j in range(a, b)]
        others = [j for j in range(len(g)) if j not in features]
        assert not g[others].any() and g[features].abs().amin(-1).gt(0).any()      # start / end / separators: 0
    # One image alone gives what it gave beside the others.
    torch.testing.assert_close(encoder.encode_images(items[1:2])[0], got[1], **FEATURES)
    assert encoder.encode_images([]) == []
    half = Llama4ImageEncoder.from_checkpoint(checkpoint, torch.bfloat16)
    out = half.encode_images(items[:2])
    assert half.dtype == torch.bfloat16 and out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), got[0], rtol=0.05, atol=0.1)


def test_our_spans_in_the_prompt_give_transformers_logits(checkpoint):
    """The engine's use of the spans: each image's span ids in the prompt, the span's rows at its
    feature runs written over the token embeddings (the other rows keep theirs)."""
    encoder = Llama4ImageEncoder.from_checkpoint(checkpoint)
    images = _images(3)[:2] + [Image.new("RGB", (40, 20), (9, 200, 40))]
    text = "Compare<|image|>with<|image|>and<|image|>now."
    ids, pixels, _ = hf_processed(checkpoint, text, images)
    items = _processed(checkpoint, images)
    assert ids == _expanded_ids(checkpoint, text, [encoder.span_ids(s) for _, s in items])
    embeds = hf_token_embeddings(checkpoint, ids)
    start = 0
    for span, (_, size) in zip(encoder.encode_images(items), items):
        start = ids.index(START, start)
        for a, b in encoder.feature_runs(size):
            embeds[start + a:start + b] = span[a:b]
        start += len(span)
    want = hf_llama4_logits(checkpoint, ids, pixel_values=pixels)
    torch.testing.assert_close(hf_llama4_logits(checkpoint, ids, inputs_embeds=embeds), want, rtol=0, atol=1e-4)


def test_transformers_loads_the_tiny_checkpoint_and_we_read_what_it_saves(tmp_path):
    """transformers loads the released layout whole and saves Llama 4 in it, loaded or built; the
    encoder reads those and the `model.` layout alike."""
    from safetensors import safe_open
    src = write_tiny_llama4_vl(tmp_path / "released", seed=4)
    model, info = transformers.Llama4ForConditionalGeneration.from_pretrained(src, output_loading_info=True)
    assert not any(info.values()), info
    built = transformers.Llama4ForConditionalGeneration(model.config)
    built.load_state_dict(model.state_dict())
    items = _processed(src, _images(4)[:3])
    want = Llama4ImageEncoder.from_checkpoint(src).encode_images(items)
    for name, saved in (("loaded", model), ("built", built)):
        saved.save_pretrained(tmp_path / name)
        for file in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
            shutil.copy(f"{src}/{file}", tmp_path / name / file)
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert {"vision_model.patch_embedding.linear.weight", "multi_modal_projector.linear_1.weight"} <= names
        for g, w in zip(Llama4ImageEncoder.from_checkpoint(tmp_path / name).encode_images(items), want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    other = write_tiny_llama4_vl(tmp_path / "model-prefixed", seed=4, layout="transformers5")
    with safe_open(str(tmp_path / "model-prefixed" / "model.safetensors"), "pt") as f:
        assert "model.vision_model.patch_embedding.linear.weight" in f.keys()
    for g, w in zip(Llama4ImageEncoder.from_checkpoint(other).encode_images(items), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_text_only_checkpoint_stores_no_tower(tmp_path):
    from raycluster.model.tiny_multimodal import write_tiny_multimodal
    path = write_tiny_multimodal(tmp_path / "text", "Llama4ForConditionalGeneration", num_hidden_layers=2)
    assert not Llama4ImageEncoder.stores_tower(path) and not Llama4ImageEncoder.stores_tower(tmp_path / "none")
    with pytest.raises(ValueError, match="stores no Llama 4 vision tower"):
        Llama4ImageEncoder.from_checkpoint(path)


def test_pixels_that_do_not_fit_are_refused(tiny):
    encoder = Llama4ImageEncoder.from_checkpoint(tiny)
    assert encoder.check_pixels(torch.zeros(5, 3, 16, 16), (37, 53)) is None
    assert encoder.check_pixels(torch.zeros(1, 3, 16, 16), (16, 16)) is None
    for bad in (torch.zeros(1, 3, 16, 16), torch.zeros(5, 3, 32, 32), torch.zeros(5, 1, 16, 16),
                torch.zeros(3, 16, 16), "pixels"):
        assert "an image of 37x53 takes (5, 3, 16, 16)" in encoder.check_pixels(bad, (37, 53))
    with pytest.raises(ValueError, match=r"image 1: pixels are \(5, 3, 16, 16\)"):
        encoder.encode_images([(torch.zeros(5, 3, 16, 16), (37, 53)), (torch.zeros(5, 3, 16, 16), (16, 16))])
    assert "has no pixel" in encoder.check_pixels(torch.zeros(1, 3, 16, 16), (0, 16))


def test_bad_configs_are_refused_naming_the_field(tmp_path):
    path = write_tiny_llama4_vl(tmp_path / "m", seed=0)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    wide = {"vision_output_dim": 48, "projector_input_dim": 48, "projector_output_dim": 48}
    for change, field in [({"vision_config": {**vision, "model_type": "clip_vision_model"}},
                           "vision_config.model_type"),
                          ({"vision_config": {**vision, "num_attention_heads": 3}}, "vision_config.hidden_size"),
                          ({"vision_config": {**vision, "hidden_size": 36, "intermediate_size": 144}},
                           "vision_config.hidden_size"),
                          ({"vision_config": {**vision, "pixel_shuffle_ratio": 1 / 3}}, "pixel_shuffle_ratio' = 0.33"),
                          ({"vision_config": {**vision, "pixel_shuffle_ratio": 0.3}}, "pixel_shuffle_ratio' = 0.3"),
                          ({"vision_config": {**vision, "intermediate_size": 64}}, "vision_config.intermediate_size"),
                          ({"vision_config": {**vision, "projector_input_dim": 32}},
                           "vision_config.projector_input_dim"),
                          ({"vision_config": {**vision, "vision_output_dim": 32}}, "vision_config.vision_output_dim"),
                          ({"vision_config": {**vision, "patch_size": [4, 4]}}, "vision_config.patch_size"),
                          ({"vision_config": {**vision, "image_size": 2}}, "vision_config.image_size"),
                          ({"vision_config": {**vision, "rope_parameters": {"rope_type": "llama3"}}},
                           "vision_config.rope_parameters.rope_type"),
                          ({"vision_config": {**vision, "rope_theta": -1}}, "vision_config.rope_theta"),
                          ({"vision_config": "llama4"}, "'vision_config'"),
                          ({"image_token_index": "x"}, "'image_token_index'"),
                          ({"image_token_index": 7}, "'image_token_index' = 7 is not the tokenizer's '<\\|patch\\|>'"),
                          ({"text_config": {**text, "hidden_size": 128}}, "text_config.hidden_size"),
                          ({"vision_config": {**vision, **wide}}, "vision_config.vision_output_dim")]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            Llama4ImageEncoder.from_checkpoint(path)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    processor = json.loads((tmp_path / "m" / "processor_config.json").read_text())
    preprocessor = json.loads((tmp_path / "m" / "preprocessor_config.json").read_text())
    for file, fields, field in [("preprocessor_config.json", {**preprocessor, "size": {"height": 32, "width": 32}},
                                 "size 32 is not config.json's vision_config.image_size 16"),
                                ("processor_config.json", {**processor, "patch_size": 8},
                                 "give 1 tokens a tile, config.json's vision_config 4"),
                                ("processor_config.json", {**processor, "image_token": "<|img|>"},
                                 "no '<\\|img\\|>' token"),
                                ("preprocessor_config.json", {**preprocessor, "resample": 5}, "'resample'")]:
        original = (tmp_path / "m" / file).read_text()
        (tmp_path / "m" / file).write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=field):
            Llama4ImageEncoder.from_checkpoint(path)
        (tmp_path / "m" / file).write_text(original)
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Llama4ImageEncoder.from_checkpoint(path)
    with pytest.raises(ValueError, match="span token ids are not given"):
        Llama4ImageEncoder(config)


def test_chat_template_and_greedy_tokens_change_with_the_image(tiny):
    from raycluster.model.tokenizer import Tokenizer
    parts = [{"type": "text", "text": "What is"}, {"type": "image"}, {"type": "text", "text": "this?"}]
    text = Tokenizer(tiny).apply_chat_template([{"role": "user", "content": parts}])
    assert text == "<|bos|><|user|>\nWhat is<|image|>this?<|eos|>\n<|assistant|>\n"
    # Two flat colors of one size (the same prompt): noise images' features differ patch by patch
    # and largely average out in the tiny text model's attention; a flat color's do not.
    image, other = Image.new("RGB", (53, 37), (200, 30, 30)), Image.new("RGB", (53, 37), (30, 30, 200))
    ids, pixels, canvases = hf_processed(tiny, text, [image])
    other_ids, other_pixels, _ = hf_processed(tiny, text, [other])
    assert ids == other_ids and canvases == [(2, 2)]
    with_image = hf_llama4_greedy(tiny, ids, pixels, 10)
    with_other = hf_llama4_greedy(tiny, ids, other_pixels, 10)
    assert len(with_image) == len(with_other) == 10 and with_image != with_other
    # Our expansion of the template's "<|image|>" and our pixels give transformers the same tokens.
    ours, size = Llama4ImageProcessor.from_model_dir(tiny)(image)
    with torch.device("meta"):
        span = Llama4ImageEncoder.for_model_dir(tiny).span_ids(size)
    assert _expanded_ids(tiny, text, [span]) == ids
    assert hf_llama4_greedy(tiny, ids, [ours], 10) == with_image
