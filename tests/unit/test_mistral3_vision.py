"""Mistral 3's image side against transformers 5.24: the image processor equal to
PixtralImageProcessorPil as PixtralProcessor calls it (sizes, aspect ratios, resamplings, modes;
what it cannot do refused, naming the field); an image's prompt span (`span_ids`, `tokens_for`,
`feature_runs`) equal to PixtralProcessor's expansion of "[IMG]"; the Pixtral tower + projector
equal to `Mistral3Model.get_image_features` for several images of different sizes in one call,
laid out per span (features at the [IMG] runs, zero rows at [IMG_BREAK] / [IMG_END]), in the
released layout, transformers 5's and what transformers' save_pretrained writes; those spans put
into the prompt's embeddings give transformers' logits; pixels that do not fit and bad configs
refused; greedy tokens change with the image.

The tower's features match to float32 rounding, not bit for bit: transformers runs one attention
over all images' patches with a block-diagonal mask, here one unmasked attention per image."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from mistral3_reference import (hf_mistral3, hf_mistral3_greedy, hf_mistral3_logits, hf_processed,
                                hf_token_embeddings, padded_batch)
from PIL import Image

from raycluster.model.mistral3_vision import Mistral3ImageEncoder
from raycluster.model.pixtral_processor import PixtralImageProcessor
from raycluster.model.tiny_mistral3_vl import (IMAGE_BREAK_TOKEN_ID, IMAGE_END_TOKEN_ID, IMAGE_TOKEN_ID,
                                               write_tiny_mistral3_vl)

transformers = pytest.importorskip("transformers")
FEATURES = {"rtol": 1e-5, "atol": 1e-5}       # float32 rounding (module docstring)


def _images(seed: int = 0) -> list[Image.Image]:
    """Random images of odd sizes and aspect ratios (smaller and larger than the bound, one
    merged patch thin) and every mode a request may bring."""
    rng = np.random.default_rng(seed)
    px = lambda h, w, c: rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)    # noqa: E731
    palette = Image.fromarray(px(13, 21, 3)).convert("P")
    palette.info["transparency"] = 0       # a palette image with a transparent color
    return [Image.fromarray(px(37, 53, 3)), Image.fromarray(px(101, 29, 4), "RGBA"),
            Image.fromarray(px(15, 15, 1)[..., 0], "L"), Image.fromarray(px(64, 9, 2), "LA"), palette,
            Image.fromarray(px(40, 40, 3)), Image.fromarray(px(7, 200, 3)), Image.fromarray(px(1, 1, 3)),
            Image.fromarray(px(90, 61, 3))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_mistral3_vl(tmp_path_factory.mktemp("mistral3"), seed=3)


# Mistral Small 3.1's preprocessor_config.json but for a tiny bound (its patch_size is the
# tower's; PixtralProcessor passes processor_config.json's patch x merge over it).
RELEASED = {"image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor", "crop_size": None,
            "default_to_square": True, "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True,
            "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": {"height": 14, "width": 14},
            "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": 40}}
# (preprocessor_config.json, processor_config.json's patch_size and spatial_merge_size)
PROCESSORS = [(RELEASED, 4, 2),
              ({**RELEASED, "size": {"longest_edge": 64}, "resample": 2, "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3}, 3, 2),
              ({**RELEASED, "size": {"height": 24, "width": 56}, "do_normalize": False}, 4, 2),
              ({**RELEASED, "size": 30, "resample": 0, "do_rescale": False}, 5, 1),
              ({"image_processor_type": "PixtralImageProcessor"}, None, None)]       # every default


def _processor_dir(tmp_path, tiny, fields: dict, patch, merge):
    """A directory with the tiny tokenizer and these processor files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny}/{name}", tmp_path / name)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    processor = {"processor_class": "PixtralProcessor", "patch_size": patch, "spatial_merge_size": merge}
    (tmp_path / "processor_config.json").write_text(json.dumps({k: v for k, v in processor.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize("fields,patch,merge", PROCESSORS, ids=["released", "bilinear", "height-width", "nearest",
                                                                "defaults"])
def test_image_processor_equals_transformers_pil_path(tmp_path, tiny, fields, patch, merge):
    path = _processor_dir(tmp_path, tiny, fields, patch, merge)
    ours = PixtralImageProcessor.from_model_dir(path)
    images = _images() if fields.get("size") else _images()[:3]         # 1024-pixel bound: three suffice
    _, want, want_sizes = hf_processed(path, "[IMG]" * len(images), images)
    for image, expected, resized in zip(images, want, want_sizes):
        got, size = ours(image)
        assert got.dtype == torch.float32 and size == (image.height, image.width)
        assert ours.grid.resized(size) == resized == tuple(got.shape[1:])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_image_processor_absent_and_refused(tmp_path, tiny):
    assert PixtralImageProcessor.from_model_dir(tmp_path) is None
    for change, field in [({"size": {"shortest_edge": 32}}, "'size'"), ({"do_resize": False}, "do_resize"),
                          ({"do_center_crop": True}, "do_center_crop"), ({"image_mean": [0.5, 0.5]}, "image_mean")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**RELEASED, **change}))
        with pytest.raises(ValueError, match=field):
            PixtralImageProcessor.from_model_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(RELEASED))
    # A strip that shrinks to no pixel of height: transformers' resize fails on it, ours refuses it.
    strip = Image.new("RGB", (200, 3))
    with pytest.raises(ValueError, match="3x200 pixels is too thin"):
        PixtralImageProcessor.from_model_dir(tmp_path)(strip)
    with pytest.raises(ValueError, match="too thin"), torch.device("meta"):
        Mistral3ImageEncoder.for_model_dir(tiny).tokens_for((3, 200))
    with pytest.raises(ValueError):
        hf_processed(tiny, "[IMG]", [strip])
    (tmp_path / "processor_config.json").write_text(json.dumps({"patch_size": 0}))
    with pytest.raises(ValueError, match="patch_size"):
        PixtralImageProcessor.from_model_dir(tmp_path)


def _expanded_ids(path, text: str, spans: list[list[int]]) -> list[int]:
    """Our expansion: the text's k-th "[IMG]" replaced by image k's span, tokenized."""
    from raycluster.model.tokenizer import Tokenizer
    tokenizer = Tokenizer(path)
    pieces = text.split("[IMG]")
    assert len(pieces) == len(spans) + 1
    out = tokenizer.encode(pieces[0], add_special_tokens=False)
    for span, piece in zip(spans, pieces[1:]):
        out += span + tokenizer.encode(piece, add_special_tokens=False)
    return out


def test_span_ids_equal_the_processors_expansion(tiny):
    with torch.device("meta"):      # the prompt side needs no weights
        encoder = Mistral3ImageEncoder.for_model_dir(tiny)
    assert PixtralImageProcessor.from_model_dir(tiny).grid == encoder.grid
    assert (encoder.image_token_id, encoder.image_break_token_id, encoder.image_end_token_id) == (
        IMAGE_TOKEN_ID, IMAGE_BREAK_TOKEN_ID, IMAGE_END_TOKEN_ID)
    images = _images(1)
    text = "Look:[IMG] and[IMG]" + "[IMG]" * (len(images) - 2) + " done."
    ids, _, _ = hf_processed(tiny, text, images)
    sizes = [(i.height, i.width) for i in images]
    spans = [encoder.span_ids(size) for size in sizes]
    assert ids == _expanded_ids(tiny, text, spans)
    for size, span in zip(sizes, spans):
        rows, columns = encoder.grid.grid_for(size)
        runs = encoder.feature_runs(size)
        assert len(span) == encoder.tokens_for(size) == rows * (columns + 1) and span[-1] == IMAGE_END_TOKEN_ID
        assert len(runs) == rows and all(b - a == columns for a, b in runs)
        assert [j for j, t in enumerate(span) if t == IMAGE_TOKEN_ID] == [j for a, b in runs for j in range(a, b)]
        assert span.count(IMAGE_BREAK_TOKEN_ID) == rows - 1
    # (1, 1) grows to one merged patch; a 7 x 200 strip shrinks to one row of five.
    assert encoder.span_ids((1, 1)) == [IMAGE_TOKEN_ID, IMAGE_END_TOKEN_ID]
    assert encoder.span_ids((7, 200)) == [IMAGE_TOKEN_ID] * 5 + [IMAGE_END_TOKEN_ID]
    assert encoder.feature_runs((16, 24)) == [(0, 3), (4, 7)]


# (layout, options): the default tiny tower, and another shape whose features come off the
# second-to-last layer, with a projector bias, 3-pixel patches and 18-wide heads (an odd number of
# rotary pairs: the row angles take one pair more than the column angles).
CASES = [("released", {}),
         ("transformers5", {"vision_feature_layer": -2, "num_hidden_layers": 3, "hidden_act": "gelu",
                            "patch_size": 3, "longest_edge": 45, "hidden_size": 36, "num_attention_heads": 2,
                            "multimodal_projector_bias": True, "projector_hidden_act": "silu"})]


@pytest.fixture(scope="module", params=CASES, ids=[layout for layout, _ in CASES])
def checkpoint(request, tmp_path_factory):
    layout, options = request.param
    return write_tiny_mistral3_vl(tmp_path_factory.mktemp("mistral3"), seed=5, layout=layout, **options)


def _processed(path, images):
    processor = PixtralImageProcessor.from_model_dir(path)
    return [processor(image) for image in images]


def _hf_spans(path, encoder, items) -> list[torch.Tensor]:
    """transformers' features of the images, laid out per span by hand (zero break / end rows)."""
    batch, sizes = padded_batch([p for p, _ in items], [p.shape[1:] for p, _ in items])
    with torch.no_grad():
        features = hf_mistral3(str(path)).model.get_image_features(pixel_values=batch, image_sizes=sizes).pooler_output
    spans = []
    for feats, (_, size) in zip(features, items):
        span = torch.zeros(encoder.tokens_for(size), feats.shape[-1])
        span[[j for a, b in encoder.feature_runs(size) for j in range(a, b)]] = feats
        spans.append(span)
    return spans


def test_encoder_equals_transformers_image_features(checkpoint):
    encoder = Mistral3ImageEncoder.from_checkpoint(checkpoint)
    assert Mistral3ImageEncoder.stores_tower(checkpoint) and encoder.ARCHITECTURE == "Mistral3ForConditionalGeneration"
    assert not encoder.bidirectional
    items = _processed(checkpoint, _images(2)[:5])       # five sizes, one call
    got = encoder.encode_images(items)
    want = _hf_spans(checkpoint, encoder, items)
    assert [tuple(g.shape) for g in got] == [(encoder.tokens_for(s), 256) for _, s in items]
    assert got[0].dtype == torch.float32 and len({g.shape[0] for g in got}) > 2
    for g, w, (_, size) in zip(got, want, items):
        torch.testing.assert_close(g, w, **FEATURES)
        features = [j for a, b in encoder.feature_runs(size) for j in range(a, b)]
        others = [j for j in range(len(g)) if j not in features]
        assert len(others) == encoder.grid.grid_for(size)[0] and not g[others].any()     # break / end rows: 0
        assert g[features].abs().amin(-1).gt(0).any()
    # One image alone gives what it gave beside the others.
    torch.testing.assert_close(encoder.encode_images(items[1:2])[0], got[1], **FEATURES)
    assert encoder.encode_images([]) == []
    half = Mistral3ImageEncoder.from_checkpoint(checkpoint, torch.bfloat16)
    out = half.encode_images(items[:2])
    assert half.dtype == torch.bfloat16 and out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), got[0], rtol=0.05, atol=0.1)


def test_our_spans_in_the_prompt_give_transformers_logits(checkpoint):
    """The engine's use of the spans: each image's span ids in the prompt, the span's rows at its
    feature runs written over the token embeddings (break / end rows keep theirs)."""
    encoder = Mistral3ImageEncoder.from_checkpoint(checkpoint)
    images = _images(3)[:2]
    text = "Compare[IMG]with[IMG]now."
    ids, pixels, sizes = hf_processed(checkpoint, text, images)
    items = _processed(checkpoint, images)
    assert ids == _expanded_ids(checkpoint, text, [encoder.span_ids(s) for _, s in items])
    embeds = hf_token_embeddings(checkpoint, ids)
    start = 0
    for span, (_, size) in zip(encoder.encode_images(items), items):
        start = ids.index(IMAGE_TOKEN_ID, start)
        for a, b in encoder.feature_runs(size):
            embeds[start + a:start + b] = span[a:b]
        start += len(span)
    want = hf_mistral3_logits(checkpoint, ids, pixel_values=pixels, image_sizes=sizes)
    torch.testing.assert_close(hf_mistral3_logits(checkpoint, ids, inputs_embeds=embeds), want, rtol=0, atol=1e-4)


def test_transformers_loads_the_tiny_checkpoint_and_we_read_what_it_saves(tmp_path):
    """transformers loads both layouts whole; it saves a loaded model in the layout it was loaded
    from and a model it built (not loaded) in the released one; the encoder reads all of them."""
    from safetensors import safe_open
    saved = {}
    for layout in ("released", "transformers5"):
        src = write_tiny_mistral3_vl(tmp_path / layout, seed=4, layout=layout)
        model, info = transformers.Mistral3ForConditionalGeneration.from_pretrained(src, output_loading_info=True)
        assert not any(info.values()), info
        saved[layout] = model
    saved["built"] = transformers.Mistral3ForConditionalGeneration(saved["released"].config)
    saved["built"].load_state_dict(saved["released"].state_dict())
    src = str(tmp_path / "released")
    items = _processed(src, _images(4)[:3])
    want = Mistral3ImageEncoder.from_checkpoint(src).encode_images(items)
    for name, prefix in (("released", ""), ("transformers5", "model."), ("built", "")):
        saved[name].save_pretrained(tmp_path / f"saved-{name}")
        for file in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
            shutil.copy(f"{src}/{file}", tmp_path / f"saved-{name}" / file)
        with safe_open(str(tmp_path / f"saved-{name}" / "model.safetensors"), "pt") as f:
            assert {prefix + "vision_tower.patch_conv.weight", prefix + "multi_modal_projector.linear_1.weight"} <= set(
                f.keys())
        got = Mistral3ImageEncoder.from_checkpoint(tmp_path / f"saved-{name}").encode_images(items)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_text_only_checkpoint_stores_no_tower(tmp_path):
    from raycluster.model.tiny_multimodal import write_tiny_multimodal
    path = write_tiny_multimodal(tmp_path / "text", "Mistral3ForConditionalGeneration", num_hidden_layers=1)
    assert not Mistral3ImageEncoder.stores_tower(path) and not Mistral3ImageEncoder.stores_tower(tmp_path / "none")
    with pytest.raises(ValueError, match="stores no Pixtral vision tower"):
        Mistral3ImageEncoder.from_checkpoint(path)


def test_pixels_that_do_not_fit_are_refused(tiny):
    encoder = Mistral3ImageEncoder.from_checkpoint(tiny)
    assert encoder.check_pixels(torch.zeros(3, 32, 40), (37, 53)) is None
    for bad in (torch.zeros(3, 40, 40), torch.zeros(1, 32, 40), torch.zeros(32, 40, 3), torch.zeros(1, 3, 32, 40),
                "pixels"):
        assert "an image of 37x53 takes (3, 32, 40)" in encoder.check_pixels(bad, (37, 53))
    with pytest.raises(ValueError, match=r"image 1: pixels are \(3, 8, 8\)"):
        encoder.encode_images([(torch.zeros(3, 32, 40), (37, 53)), (torch.zeros(3, 8, 8), (37, 53))])
    assert "3x200 pixels is too thin" in encoder.check_pixels(torch.zeros(3, 8, 40), (3, 200))


@pytest.mark.parametrize("text_type", ["mistral", "ministral3"])
def test_projector_norm_eps_defaults_to_the_text_models(tiny, text_type):
    """The projector's RMSNorm takes the text config's rms_norm_eps; left out, its model's default."""
    config = json.loads(open(f"{tiny}/config.json").read())
    text = {k: v for k, v in config["text_config"].items() if k != "rms_norm_eps"}
    config["text_config"] = {**text, "model_type": text_type}
    with torch.device("meta"):
        encoder = Mistral3ImageEncoder({**config, "image_break_token_id": 1, "image_end_token_id": 2})
    want = transformers.Mistral3Config(**{k: v for k, v in config.items() if k != "architectures"})
    assert encoder.multi_modal_projector.norm.eps == want.text_config.rms_norm_eps == (
        1e-5 if text_type == "ministral3" else 1e-6)


def test_bad_configs_are_refused_naming_the_field(tmp_path):
    path = write_tiny_mistral3_vl(tmp_path / "m", seed=0)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    for change, field in [({"vision_config": {**vision, "model_type": "clip_vision_model"}},
                           "vision_config.model_type"),
                          ({"vision_config": {**vision, "hidden_act": "swish7"}}, "vision_config.hidden_act"),
                          ({"vision_config": {**vision, "num_attention_heads": 3}}, "vision_config.hidden_size"),
                          ({"vision_config": {**vision, "hidden_size": 30}}, "vision_config.hidden_size"),
                          ({"vision_config": {**vision, "patch_size": [4, 4]}}, "vision_config.patch_size"),
                          ({"vision_config": {**vision, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}},
                           "vision_config.rope_parameters.rope_type"),
                          ({"vision_config": {**vision, "rope_theta": -1}}, "vision_config.rope_theta"),
                          ({"vision_config": "pixtral"}, "'vision_config'"),
                          ({"spatial_merge_size": 0}, "'spatial_merge_size'"),
                          ({"vision_feature_layer": [-1, -2]}, "'vision_feature_layer'"),
                          ({"vision_feature_layer": -4}, "'vision_feature_layer' = -4"),
                          ({"projector_hidden_act": "swish7"}, "projector_hidden_act"),
                          ({"multimodal_projector_bias": "yes"}, "multimodal_projector_bias"),
                          ({"image_token_index": "x"}, "'image_token_index'"),
                          ({"image_token_index": 7}, "'image_token_index' = 7 is not the tokenizer's '\\[IMG\\]'"),
                          ({"text_config": {**text, "rms_norm_eps": 0}}, "text_config.rms_norm_eps"),
                          ({"text_config": {**text, "hidden_size": 128}}, "text_config.hidden_size"),
                          ({"vision_config": {**vision, "hidden_size": 48}}, "vision_config.hidden_size")]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            Mistral3ImageEncoder.from_checkpoint(path)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    processor = json.loads((tmp_path / "m" / "processor_config.json").read_text())
    preprocessor = json.loads((tmp_path / "m" / "preprocessor_config.json").read_text())
    for file, fields, field in [("processor_config.json", {**processor, "spatial_merge_size": 1},
                                 "processor_config.json's patch_size 4 x spatial_merge_size 1"),
                                ("processor_config.json", {**processor, "image_break_token": "[BRK]"},
                                 "no '\\[BRK\\]' token"),
                                ("preprocessor_config.json", {**preprocessor, "size": {"shortest_edge": 9}}, "'size'")]:
        original = (tmp_path / "m" / file).read_text()
        (tmp_path / "m" / file).write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=field):
            Mistral3ImageEncoder.from_checkpoint(path)
        (tmp_path / "m" / file).write_text(original)
    # Ids config.json sets itself need no tokenizer; without either, the encoder says where they come from.
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Mistral3ImageEncoder.from_checkpoint(path)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "image_break_token_id": 7,
                                                            "image_end_token_id": 8}))
    encoder = Mistral3ImageEncoder.from_checkpoint(path)
    assert encoder.span_ids((16, 16)) == [IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 7, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 8]
    with pytest.raises(ValueError, match="'image_break_token_id' is not set"):
        Mistral3ImageEncoder(config)


def test_chat_template_and_greedy_tokens_change_with_the_image(tiny):
    from raycluster.model.tokenizer import Tokenizer
    parts = [{"type": "text", "text": "What is"}, {"type": "image"}, {"type": "text", "text": "this?"}]
    text = Tokenizer(tiny).apply_chat_template([{"role": "user", "content": parts}])
    assert text == "<|bos|><|user|>\nWhat is[IMG]this?<|eos|>\n<|assistant|>\n"
    # Two flat colors of one size (the same prompt): noise images' features differ patch by patch
    # and largely average out in the tiny text model's attention; a flat color's do not.
    image, other = Image.new("RGB", (53, 37), (200, 30, 30)), Image.new("RGB", (53, 37), (30, 30, 200))
    ids, pixels, sizes = hf_processed(tiny, text, [image])
    other_ids, other_pixels, other_sizes = hf_processed(tiny, text, [other])
    assert ids == other_ids and sizes == other_sizes
    with_image = hf_mistral3_greedy(tiny, ids, pixels, sizes, 10)
    with_other = hf_mistral3_greedy(tiny, ids, other_pixels, other_sizes, 10)
    assert len(with_image) == len(with_other) == 10 and with_image != with_other
    # The reference is transformers' generation from PixtralProcessor's own outputs.
    from mistral3_reference import hf_mistral3_processor
    inputs = hf_mistral3_processor(tiny)(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = hf_mistral3(str(tiny)).generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                              pad_token_id=2)
    assert out[0, len(ids):].tolist() == with_image
