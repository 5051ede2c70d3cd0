"""Gemma 3's image side against transformers 5.24: the image processor equal to
Gemma3ImageProcessorPil (sizes, resamplings, modes; pan-and-scan and non-square sizes refused,
naming the field); the SigLIP tower + projector equal to `Gemma3Model.get_image_features` for
several images in one call, in the released layout, transformers 5's and what transformers'
save_pretrained writes; pixels that do not fit refused; bad configs refused naming the field; the
prompt's expansion of "<start_of_image>" and its token types equal Gemma3Processor's; our
features put at the image tokens (with those token types) give transformers' logits; greedy
tokens change with the image; and how transformers lets image tokens see each other: the exact
masks of the full and sliding layers, and the logits that show them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gemma3_reference import (hf_gemma3, hf_gemma3_greedy, hf_gemma3_logits, hf_gemma3_masks, hf_gemma3_processor,
                              hf_pixel_values, image_token_types)
from PIL import Image

from raycluster.model.gemma3_processor import Gemma3ImageProcessor
from raycluster.model.gemma3_vision import Gemma3ImageEncoder
from raycluster.model.tiny_gemma3_vl import (BOI_TOKEN, BOI_TOKEN_ID, EOI_TOKEN, EOI_TOKEN_ID, IMAGE_TOKEN,
                                             IMAGE_TOKEN_ID, write_tiny_gemma3_vl)

transformers = pytest.importorskip("transformers")


def _images(seed: int = 0) -> list[Image.Image]:
    """Random images of odd sizes and every mode a request may bring."""
    rng = np.random.default_rng(seed)
    px = lambda h, w, c: rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)    # noqa: E731
    palette = Image.fromarray(px(13, 21, 3)).convert("P")
    palette.info["transparency"] = 0       # a palette image with a transparent color
    return [Image.fromarray(px(37, 53, 3)), Image.fromarray(px(101, 29, 4), "RGBA"),
            Image.fromarray(px(15, 15, 1)[..., 0], "L"), Image.fromarray(px(64, 9, 2), "LA"), palette,
            Image.fromarray(px(32, 32, 3)), Image.fromarray(px(3, 200, 3))]


RELEASED = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
            "do_resize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_seq_length": 256,
            "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None, "resample": 2, "rescale_factor": 1 / 255,
            "size": {"height": 896, "width": 896}}
PROCESSORS = [RELEASED,                                                  # gemma-3-4b-it's file
              {**RELEASED, "size": {"height": 32, "width": 32}},
              {**RELEASED, "size": 40, "resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]},
              {**RELEASED, "size": {"height": 24, "width": 24}, "do_normalize": False},
              {**RELEASED, "size": 16, "resample": 0, "do_rescale": False},
              {"image_processor_type": "Gemma3ImageProcessor"}]           # every default


@pytest.mark.parametrize("fields", PROCESSORS, ids=["released", "tiny", "bicubic", "no-norm", "nearest", "defaults"])
def test_image_processor_equals_transformers_pil_path(tmp_path, fields):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    ours = Gemma3ImageProcessor.from_model_dir(tmp_path)
    images = _images() if fields.get("size") != RELEASED["size"] else _images()[:2]      # 896 squares: two suffice
    want = hf_pixel_values(tmp_path, images)
    for image, expected in zip(images, want):
        got, size = ours(image)
        assert got.dtype == torch.float32 and size == (image.height, image.width)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_image_processor_absent_and_refused(tmp_path):
    assert Gemma3ImageProcessor.from_model_dir(tmp_path) is None
    # Pan-and-scan is ignored, as Gemma3Processor ignores the file's value: the same pixels.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**RELEASED, "do_pan_and_scan": True}))
    image = _images()[0]
    torch.testing.assert_close(Gemma3ImageProcessor.from_model_dir(tmp_path)(image)[0],
                               Gemma3ImageProcessor(RELEASED)(image)[0], rtol=0, atol=0)
    for change, field in [({"size": {"shortest_edge": 32}}, "'size'"),
                          ({"image_mean": [0.5, 0.5]}, "image_mean")]:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({**RELEASED, **change}))
        with pytest.raises(ValueError, match=field):
            Gemma3ImageProcessor.from_model_dir(tmp_path)


# (layout, vision options): the default tower (16 tokens of an 8x8 grid) and another shape.
CASES = [("released", {}),
         ("transformers5", {"mm_tokens_per_image": 4, "image_size": 28, "patch_size": 7, "num_hidden_layers": 3,
                            "hidden_act": "gelu", "layer_norm_eps": 1e-5})]


@pytest.fixture(scope="module", params=CASES, ids=[layout for layout, _ in CASES])
def checkpoint(request, tmp_path_factory):
    layout, options = request.param
    return write_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3"), seed=3, layout=layout, **options), options


def _hf_features(path, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_gemma3(str(path)).model.get_image_features(pixel_values=pixel_values).pooler_output


def test_encoder_equals_transformers_image_features(checkpoint):
    path, options = checkpoint
    encoder = Gemma3ImageEncoder.from_checkpoint(path)
    size, tokens = options.get("image_size", 32), options.get("mm_tokens_per_image", 16)
    assert Gemma3ImageEncoder.stores_tower(path) and encoder.ARCHITECTURE == "Gemma3ForConditionalGeneration"
    assert (encoder.image_token_id, encoder.boi_token_id, encoder.eoi_token_id) == (IMAGE_TOKEN_ID, BOI_TOKEN_ID,
                                                                                  EOI_TOKEN_ID)
    assert encoder.tokens_per_image == tokens and encoder.tokens_for((123, 45)) == tokens
    pixels = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    got = encoder.encode_images([(p, (50 + k, 60)) for k, p in enumerate(pixels)])
    assert [tuple(g.shape) for g in got] == [(tokens, 256)] * 3 and got[0].dtype == torch.float32
    torch.testing.assert_close(torch.stack(got), _hf_features(path, pixels), rtol=0, atol=1e-6)
    assert encoder.encode_images([]) == []
    half = Gemma3ImageEncoder.from_checkpoint(path, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.encode_images([(pixels[0], (1, 1))])[0].dtype == torch.bfloat16
    torch.testing.assert_close(half.encode_images([(pixels[0], (1, 1))])[0].float(), got[0], rtol=0.05, atol=0.2)


def test_encoder_reads_what_transformers_saves(tmp_path):
    """transformers 5.24 saves a loaded model in the layout it was loaded from (tested above), and a
    model it built (not loaded) with the tower under the bare `vision_tower.` (no `vision_model.`)."""
    src = write_tiny_gemma3_vl(tmp_path / "src", seed=4, layout="transformers5")
    built = transformers.Gemma3ForConditionalGeneration(hf_gemma3(src).config)
    built.load_state_dict(hf_gemma3(src).state_dict())
    built.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "vision_tower.embeddings.patch_embedding.weight" in names
    assert "multi_modal_projector.mm_input_projection_weight" in names
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    got = Gemma3ImageEncoder.from_checkpoint(tmp_path / "saved").encode_images([(p, (32, 32)) for p in pixels])
    torch.testing.assert_close(torch.stack(got), _hf_features(src, pixels), rtol=0, atol=1e-6)


def test_text_only_checkpoint_stores_no_tower(tmp_path):
    from raycluster.model.tiny_multimodal import write_tiny_multimodal
    path = write_tiny_multimodal(tmp_path / "text", "Gemma3ForConditionalGeneration", num_hidden_layers=1)
    assert not Gemma3ImageEncoder.stores_tower(path) and not Gemma3ImageEncoder.stores_tower(tmp_path / "nothing")
    with pytest.raises(ValueError, match="stores no SigLIP vision tower"):
        Gemma3ImageEncoder.from_checkpoint(path)


def test_pixels_that_do_not_fit_are_refused(checkpoint):
    path, options = checkpoint
    encoder, size = Gemma3ImageEncoder.from_checkpoint(path), options.get("image_size", 32)
    assert encoder.check_pixels(torch.zeros(3, size, size), (7, 9)) is None
    for bad in (torch.zeros(3, size, size + 1), torch.zeros(1, size, size), torch.zeros(size, size, 3),
                torch.zeros(1, 3, size, size), "pixels"):
        assert f"takes (3, {size}, {size})" in encoder.check_pixels(bad, (7, 9))
    with pytest.raises(ValueError, match=r"image 1: pixels are \(3, 8, 8\)"):
        encoder.encode_images([(torch.zeros(3, size, size), (1, 1)), (torch.zeros(3, 8, 8), (8, 8))])


def test_bad_configs_are_refused_naming_the_field(tmp_path):
    path = write_tiny_gemma3_vl(tmp_path / "g", seed=0)
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    vision = config["vision_config"]
    for change, field in [({"mm_tokens_per_image": 15}, "'mm_tokens_per_image' = 15"),      # not a square
                          ({"mm_tokens_per_image": 9}, "'mm_tokens_per_image' = 9"),        # 3 does not divide 8
                          ({"mm_tokens_per_image": 0}, "'mm_tokens_per_image'"),
                          ({"vision_config": {**vision, "model_type": "clip_vision_model"}},
                           "vision_config.model_type"),
                          ({"vision_config": {**vision, "hidden_act": "swish7"}}, "vision_config.hidden_act"),
                          ({"vision_config": {**vision, "num_attention_heads": 3}}, "vision_config.hidden_size"),
                          ({"vision_config": {**vision, "image_size": [32, 16]}}, "vision_config.image_size"),
                          ({"vision_config": "siglip"}, "'vision_config'"),
                          ({"image_token_index": "x"}, "'image_token_index'"),
                          ({"boi_token_index": -1}, "'boi_token_index'"),
                          ({"text_config": {**config["text_config"], "hidden_size": 128}}, "text_config.hidden_size"),
                          ({"vision_config": {**vision, "hidden_size": 48}}, "vision_config.hidden_size")]:
        (tmp_path / "g" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            Gemma3ImageEncoder.from_checkpoint(path)


def _prompt(path, images: int) -> str:
    from raycluster.model.tokenizer import Tokenizer
    parts = [{"type": "text", "text": "Compare"}] + [{"type": "image"}] * images + [{"type": "text", "text": "now."}]
    return Tokenizer(path).apply_chat_template([{"role": "user", "content": parts}])


def _expanded_ids(path, text: str, tokens: int) -> list[int]:
    """Our expansion of each "<start_of_image>" in the text, tokenized."""
    from raycluster.model.tokenizer import Tokenizer
    run = f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * tokens}{EOI_TOKEN}\n\n"
    return Tokenizer(path).encode(text.replace(BOI_TOKEN, run), add_special_tokens=False)


def test_prompt_expansion_and_token_types_equal_gemma3_processors(checkpoint):
    path, options = checkpoint
    tokens = options.get("mm_tokens_per_image", 16)
    text = _prompt(path, 2)
    assert text == "<|bos|><|user|>\nCompare<start_of_image><start_of_image>now.<|eos|>\n<|assistant|>\n"
    images = _images(1)[:2]
    want = hf_gemma3_processor(path)(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    ids = _expanded_ids(path, text, tokens)
    assert ids == want["input_ids"][0].tolist() and ids.count(IMAGE_TOKEN_ID) == 2 * tokens
    assert torch.equal(image_token_types(path, ids), want["token_type_ids"])
    processor = Gemma3ImageProcessor.from_model_dir(path)
    torch.testing.assert_close(torch.stack([processor(i)[0] for i in images]), want["pixel_values"], rtol=0, atol=1e-6)


def _embeds_with(path, ids: list[int], features: list[torch.Tensor]) -> torch.Tensor:
    """The prompt's (scaled) token embeddings with the images' features, in order and unscaled, in
    place of the image tokens' rows: what the engine feeds the text model."""
    model = hf_gemma3(str(path))
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(ids))
    embeds[torch.tensor(ids) == IMAGE_TOKEN_ID] = torch.cat(features)
    return embeds


def test_our_features_at_the_image_tokens_give_transformers_logits(checkpoint):
    path, options = checkpoint
    ids = _expanded_ids(path, _prompt(path, 2), options.get("mm_tokens_per_image", 16))
    processor, encoder = Gemma3ImageProcessor.from_model_dir(path), Gemma3ImageEncoder.from_checkpoint(path)
    items = [processor(image) for image in _images(2)[:2]]
    want = hf_gemma3_logits(path, ids, pixel_values=torch.stack([p for p, _ in items]))
    got = hf_gemma3_logits(path, ids, inputs_embeds=_embeds_with(path, ids, encoder.encode_images(items)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_greedy_tokens_change_with_the_image(tmp_path):
    path = write_tiny_gemma3_vl(tmp_path / "g", seed=3)
    text, image = _prompt(path, 1), _images(3)[1]
    ids = _expanded_ids(path, text, 16)
    pixels = Gemma3ImageProcessor.from_model_dir(path)(image)[0][None]
    with_image = hf_gemma3_greedy(path, ids, pixels, 10)
    zeroed = hf_gemma3_greedy(path, ids, torch.zeros_like(pixels), 10)
    assert len(with_image) == len(zeroed) == 10 and with_image != zeroed
    # The reference is transformers' generation from Gemma3Processor's own outputs.
    inputs = hf_gemma3_processor(path)(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = hf_gemma3(str(path)).generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                            pad_token_id=2)
    assert out[0, len(ids):].tolist() == with_image


def test_image_tokens_see_their_own_image_both_ways(tmp_path):
    """transformers 5.24's Gemma 3, given the processor's token types: on every layer an image
    token also sees the later tokens of its own image (and only those: not its begin / end of
    image tokens, not another image); sliding layers keep their window on the earlier side."""
    path = write_tiny_gemma3_vl(tmp_path / "g", seed=1)
    window = json.loads((tmp_path / "g" / "config.json").read_text())["text_config"]["sliding_window"]
    ids = _expanded_ids(path, _prompt(path, 2), 16)
    n = len(ids)
    is_image = torch.tensor(ids) == IMAGE_TOKEN_ID
    run = torch.cumsum(torch.tensor([ids[i] == BOI_TOKEN_ID for i in range(n)]), 0)    # which image a token is in
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    same_image = is_image[:, None] & is_image[None, :] & (run[:, None] == run[None, :])
    masks = hf_gemma3_masks(path, ids)
    assert torch.equal(masks["full_attention"], (k <= q) | same_image)
    assert torch.equal(masks["sliding_attention"], ((k <= q) | same_image) & (k > q - window))
    assert n > window and not torch.equal(masks["sliding_attention"], masks["full_attention"])

    encoder = Gemma3ImageEncoder.from_checkpoint(path)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    first, second, other = encoder.encode_images([(p, (32, 32)) for p in pixels])
    changed = first.clone()
    changed[-1] = other[-1]         # only the last token of the first image differs
    positions = is_image.nonzero().flatten().tolist()
    boi, first_token = positions[0] - 1, positions[0]
    for bidirectional in (True, False):
        a = hf_gemma3_logits(path, ids, _embeds_with(path, ids, [first, second]), bidirectional=bidirectional)
        b = hf_gemma3_logits(path, ids, _embeds_with(path, ids, [changed, second]), bidirectional=bidirectional)
        torch.testing.assert_close(a[:first_token], b[:first_token], rtol=0, atol=0)    # boi and before: unchanged
        moved = (a[first_token] - b[first_token]).abs().max().item()
        assert (moved > 1e-3) if bidirectional else (moved == 0), (bidirectional, moved)
    assert ids[boi] == BOI_TOKEN_ID
    # A later image never reaches back into an earlier one.
    c = hf_gemma3_logits(path, ids, _embeds_with(path, ids, [first, other]))
    a = hf_gemma3_logits(path, ids, _embeds_with(path, ids, [first, second]))
    second_start = positions[16]
    torch.testing.assert_close(a[:second_start], c[:second_start], rtol=0, atol=0)
    assert (a[second_start] - c[second_start]).abs().max() > 1e-3
