"""LLaVA's image side against transformers: the image processor (RGB with alpha on white, the
shortest-edge resize, the center crop with its padding, rescale, normalize) equal to transformers'
PIL processors; image bytes refused with ValueError (not an image, truncated, too many pixels,
PIL's decompression bomb); the CLIP tower + projector equal to
`LlavaForConditionalGeneration.get_image_features` in every weight layout (released,
transformers 5's, what transformers 5.24 saves, sharded) for single and listed feature layers,
both select strategies; only the needed tower layers built; the tiny checkpoint's "<image>" token
and content-list chat template; the checkpoints with no tower served on text (`image_encoder_for`
None); and transformers' own generation from the tiny checkpoint with an image, whose
features our encoder's, put at the image tokens' embeddings, reproduce."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
from llava_reference import expand_image_tokens, hf_llava, hf_llava_greedy, hf_pixel_values
from PIL import Image

from raycluster.model.image_processor import ImageProcessor, decode_image
from raycluster.model.llava import LlavaImageEncoder, image_encoder_for, llava_image_facts
from raycluster.model.tiny_llava import IMAGE_TOKEN, IMAGE_TOKEN_ID
from raycluster.model.tiny_multimodal import write_tiny_multimodal

transformers = pytest.importorskip("transformers")
LLAVA = "LlavaForConditionalGeneration"


def _images(seed: int = 0) -> list[Image.Image]:
    """Random images of odd sizes and every mode a request may bring."""
    rng = np.random.default_rng(seed)
    px = lambda h, w, c: rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)    # noqa: E731
    palette = Image.fromarray(px(13, 21, 3)).convert("P")
    palette.info["transparency"] = 0       # a palette image with a transparent color
    return [Image.fromarray(px(37, 53, 3)), Image.fromarray(px(101, 29, 4), "RGBA"),
            Image.fromarray(px(15, 15, 1)[..., 0], "L"), Image.fromarray(px(64, 9, 2), "LA"), palette,
            Image.fromarray(px(28, 28, 3)), Image.fromarray(px(3, 200, 3))]


PROCESSORS = [
    {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}},
    {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},        # llava-1.5's
    {"size": {"height": 20, "width": 40}, "crop_size": {"height": 31, "width": 27}, "resample": 2},  # crop pads
    {"size": 30, "crop_size": 24, "do_normalize": False},
    {"size": {"shortest_edge": 30}, "crop_size": {"height": 41, "width": 17},
     "image_processor_type": "LlavaImageProcessor", "do_pad": True},                        # pad to square
]


@pytest.mark.parametrize("fields", PROCESSORS)
def test_image_processor_equals_transformers_pil_path(tmp_path, fields):
    config = {"image_processor_type": "CLIPImageProcessor", "resample": 3, **fields}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ours = ImageProcessor.from_model_dir(tmp_path)
    reference = (transformers.LlavaImageProcessorPil if "Llava" in config["image_processor_type"]
                 else transformers.CLIPImageProcessorPil).from_pretrained(str(tmp_path))
    for image in _images():
        got, want = ours(image), reference(image, return_tensors="pt")["pixel_values"][0]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_image_processor_absent_is_none(tmp_path):
    assert ImageProcessor.from_model_dir(tmp_path) is None


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (no image data behind it)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def test_decode_image_and_its_refusals(monkeypatch):
    image = _images()[0]
    assert np.array_equal(np.array(decode_image(_png(image))), np.array(image))
    for bad in (b"", b"not an image at all", _png(image)[:60]):        # the last: truncated
        with pytest.raises(ValueError, match="cannot decode image"):
            decode_image(bad)
    with pytest.raises(ValueError, match="larger than the limit"):      # 100M pixels: refused unread
        decode_image(_png_header_only(10_000, 10_000))
    with pytest.raises(ValueError, match="larger than the limit of 100 pixels"):
        decode_image(_png(image), max_pixels=100)
    # PIL's own bomb checks: its warning (above MAX_IMAGE_PIXELS) and error (above twice it).
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for size in ((40, 40), (40, 60)):
        with pytest.raises(ValueError, match="larger than the limit"):
            decode_image(_png(Image.new("RGB", size)))


# (layout, vision options): feature layers as an int and as a list, both strategies, other sizes.
CASES = [("released", {}),
         ("transformers5", {}),
         ("released", {"vision_feature_layer": [-2, 0], "vision_feature_select_strategy": "full"}),
         ("transformers5", {"vision_feature_layer": [1, -1], "projector_hidden_act": "quick_gelu"}),
         ("released", {"vision_feature_layer": -1, "vision_feature_select_strategy": "full", "image_size": 42,
                       "num_hidden_layers": 3, "multimodal_projector_bias": False})]


@pytest.fixture(scope="module", params=CASES, ids=[f"{layout}-{i}" for i, (layout, _) in enumerate(CASES)])
def checkpoint(request, tmp_path_factory):
    layout, options = request.param
    path = write_tiny_multimodal(tmp_path_factory.mktemp("llava"), LLAVA, seed=3, layout=layout, vision_weights=True,
                                 vision_options=options, num_hidden_layers=2)
    return path, options


def _hf_features(path, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = hf_llava(str(path)).get_image_features(pixel_values=pixel_values)
    return torch.stack(list(out.pooler_output))      # transformers 5: a list, one [tokens, hidden] per image


def test_encoder_equals_transformers_image_features(checkpoint):
    path, options = checkpoint
    encoder = image_encoder_for(path)
    size, depth = options.get("image_size", 28), options.get("num_hidden_layers", 2)
    full = options.get("vision_feature_select_strategy") == "full"
    assert (encoder.image_token_id, encoder.image_size) == (IMAGE_TOKEN_ID, size)
    assert encoder.tokens_per_image == (size // 14) ** 2 + full
    assert llava_image_facts(path) == (IMAGE_TOKEN_ID, encoder.tokens_per_image)
    layers = options.get("vision_feature_layer", -2)
    deepest = max(i % (depth + 1) for i in (layers if isinstance(layers, list) else [layers]))
    assert len(encoder.vision_tower.encoder.layers) == deepest        # the rest never built nor read
    pixel_values = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    got = encoder.encode(pixel_values)
    assert got.shape == (3, encoder.tokens_per_image, 256) and got.dtype == torch.float32
    torch.testing.assert_close(got, _hf_features(path, pixel_values), rtol=0, atol=1e-5)
    half = LlavaImageEncoder.from_checkpoint(path, torch.bfloat16).encode(pixel_values)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got, rtol=0.05, atol=0.1)
    with pytest.raises(ValueError, match=rf"pixel_values must be \[N, 3, {size}, {size}\]"):
        encoder.encode(torch.zeros(1, 3, size + 1, size))


def test_encoder_reads_what_transformers_saves_and_shards(tmp_path):
    """A model transformers 5.24 built (not loaded) saves its tower as `vision_tower.*` (no
    `vision_model.`); a sharded checkpoint is read through its index."""
    src = write_tiny_multimodal(tmp_path / "src", LLAVA, seed=4, vision_weights=True, num_hidden_layers=2)
    built = transformers.LlavaForConditionalGeneration(hf_llava(src).config)
    built.load_state_dict(hf_llava(src).state_dict())
    built.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert any(k.startswith("vision_tower.embeddings.") for k in f.keys())
    pixel_values = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    want = _hf_features(src, pixel_values)
    torch.testing.assert_close(image_encoder_for(tmp_path / "saved").encode(pixel_values), want, rtol=0, atol=1e-5)
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(sharded / "model.safetensors"))
    os.remove(sharded / "model.safetensors")
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, str(sharded / shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.testing.assert_close(image_encoder_for(sharded).encode(pixel_values), want, rtol=0, atol=1e-5)


def test_checkpoints_without_a_tower_are_served_on_text(tmp_path):
    from raycluster.model.tiny import write_tiny_model
    llava = write_tiny_multimodal(tmp_path / "llava", LLAVA, num_hidden_layers=1)
    assert image_encoder_for(llava) is None and llava_image_facts(llava) is None
    assert image_encoder_for(write_tiny_multimodal(tmp_path / "gemma3", "Gemma3ForConditionalGeneration",
                                                   num_hidden_layers=1)) is None
    assert image_encoder_for(write_tiny_model(tmp_path / "text", num_hidden_layers=1)) is None


def test_unservable_llava_configs_are_refused(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", LLAVA, vision_weights=True, num_hidden_layers=1)
    config = json.loads((tmp_path / "llava" / "config.json").read_text())
    for change, field in [({"vision_config": {**config["vision_config"], "model_type": "siglip_vision_model"}},
                           "vision_config.model_type"),
                          ({"vision_feature_layer": -4}, "vision feature layer -4"),
                          ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
                          ({"projector_hidden_act": "swish7"}, "projector_hidden_act")]:
        (tmp_path / "llava" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=field):
            image_encoder_for(path)
        with pytest.raises(ValueError, match=field):
            llava_image_facts(path)


def test_tiny_tokenizer_maps_image_token_and_renders_content_parts(tmp_path):
    from raycluster.model.loader import load_model
    from raycluster.model.tiny import write_tiny_model
    from raycluster.model.tokenizer import Tokenizer
    path = write_tiny_multimodal(tmp_path / "llava", LLAVA, vision_weights=True, num_hidden_layers=1)
    tok, hf_tok = Tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(f"look{IMAGE_TOKEN} here", add_special_tokens=False)
    assert ids.count(IMAGE_TOKEN_ID) == 1 and ids == hf_tok.encode(f"look{IMAGE_TOKEN} here", add_special_tokens=False)
    assert tok.decode(ids) == "look here"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                          {"type": "image_url", "image_url": {"url": "data:"}}, {"type": "text",
                                                                                                "text": " b"}]}]
    text = tok.apply_chat_template(parts)
    assert text == "<|bos|><|user|>\na<image><image> b<|eos|>\n<|assistant|>\n"
    assert text == hf_tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text_only = Tokenizer(write_tiny_model(tmp_path / "text", num_hidden_layers=1))
    assert tok.apply_chat_template(plain) == text_only.apply_chat_template(plain)
    _, cfg = load_model(path)      # the text model loads as before; its embedding covers the image id
    assert cfg.vocab_size == IMAGE_TOKEN_ID + 1


def test_transformers_generates_with_an_image_our_features_reproduce(tmp_path):
    path = write_tiny_multimodal(tmp_path / "llava", LLAVA, seed=3, vision_weights=True, num_hidden_layers=2)
    from raycluster.model.tokenizer import Tokenizer
    encoder, processor = image_encoder_for(path), ImageProcessor.from_model_dir(path)
    tok = Tokenizer(path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]), add_special_tokens=False)
    ids = expand_image_tokens(prompt, encoder.image_token_id, encoder.tokens_per_image)
    assert ids.count(IMAGE_TOKEN_ID) == 4
    images = [Image.new("RGB", (40, 30), (255, 0, 0)), _images(5)[0]]
    pixel_values = hf_pixel_values(path, images)
    torch.testing.assert_close(torch.stack([processor(i) for i in images]), pixel_values, rtol=0, atol=1e-6)
    outs = [hf_llava_greedy(path, ids, pixel_values[i:i + 1], 10) for i in range(2)]
    assert outs[0] != outs[1] and len(outs[0]) == 10        # the image changes what the model says
    # The injection recipe: the prompt's token embeddings with the features, in order and unscaled,
    # in place of the image tokens' rows, give transformers' logits.
    model = hf_llava(str(path))
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values[:1]).logits
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, torch.tensor(ids) == IMAGE_TOKEN_ID] = encoder.encode(pixel_values[:1])[0]
        got = model(inputs_embeds=embeds).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
