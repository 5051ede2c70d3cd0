"""LLaVA-OneVision's videos (raycluster.model.onevision_video, raycluster.model.llava_onevision)
against transformers 5.24: the encoder's features of a video's frames equal to
`LlavaOnevisionModel.get_video_features` (tower, projector, `apply_pooling`, one newline), in two
layouts and tile sizes, mixed with images in one call; the token count equal to
`LlavaOnevisionProcessor`'s (`_get_num_multimodal_tokens`, `replace_video_token`); the video
processor's defaults equal to `LlavaOnevisionVideoProcessor`'s and its pixels to the PIL image
processor's on frames already at the target size (transformers' video processor needs
torchvision, not installed here, so its resize is not compared); what is refused; and the
engine's greedy tokens for a prompt with a video and an image equal to transformers' `generate`,
in prefill chunks (with the prompt's log-probabilities), from a prefix hit inside the video, and
on a tp group."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from raycluster.model.llava_onevision import DEFAULT_VIDEO_TOKEN_ID, LlavaOnevisionImageEncoder
from raycluster.model.onevision_processor import OnevisionImageProcessor
from raycluster.model.onevision_video import DEFAULT_MAX_FRAMES, OnevisionVideoGrid, OnevisionVideoProcessor
from raycluster.model.tiny_llava_onevision import (IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, tiny_pinpoints,
                                                   write_tiny_llava_onevision)

transformers = pytest.importorskip("transformers")


def _frames(n: int, h: int, w: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for _ in range(n)]


# (layout, vision_config fields, top-level fields): the tiny 28-pixel tiles (4 x 4 features pooled
# to 2 x 2), and 42-pixel tiles (an odd 3 x 3, pooled to 2 x 2) over two concatenated layers.
CASES = [("released", {}, {}),
         ("transformers5", {"image_size": 42, "patch_size": 14, "num_hidden_layers": 3},
          {"vision_feature_layer": [-2, 0], "projector_hidden_act": "quick_gelu",
           "image_grid_pinpoints": tiny_pinpoints(42)})]


@pytest.fixture(scope="module", params=CASES, ids=[layout for layout, _, _ in CASES])
def checkpoint(request, tmp_path_factory):
    layout, vision, fields = request.param
    path = write_tiny_llava_onevision(tmp_path_factory.mktemp("ov"), seed=3, layout=layout, vision=vision, **fields)
    hf = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, LlavaOnevisionImageEncoder.from_checkpoint(path)


def test_video_features_equal_transformers(checkpoint):
    path, hf, enc = checkpoint
    assert enc.takes_video and enc.video_token_id == VIDEO_TOKEN_ID == hf.config.video_token_id
    side = enc.image_size // hf.config.vision_config.patch_size
    assert enc.video_grid == OnevisionVideoGrid(side) and enc.video_grid.pooled_side == 2
    g = torch.Generator().manual_seed(0)
    for frames in (1, 2, 5):
        pixels = torch.randn(frames, 3, enc.image_size, enc.image_size, generator=g)
        size = (frames, 50, 70)         # a frame's original size: it changes nothing but the check
        with torch.no_grad():
            want = hf.model.get_video_features(pixel_values_videos=pixels[None]).pooler_output[0]
        assert enc.check_pixels(pixels, size) is None
        (got,) = enc.encode_images([(pixels, size)])
        assert got.shape == (enc.tokens_for(size), 256) == (frames * 4 + 1, 256) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert enc.span_ids(size) == [VIDEO_TOKEN_ID] * (frames * 4 + 1)


def test_images_and_videos_in_one_call_equal_each_alone(checkpoint):
    path, _, enc = checkpoint
    processor = OnevisionImageProcessor.from_model_dir(path)
    images = [processor(frame) for frame in _frames(1, 30, 40, 1) + _frames(1, 120, 90, 2)]
    g = torch.Generator().manual_seed(1)
    videos = [(torch.randn(n, 3, enc.image_size, enc.image_size, generator=g), (n, 30, 40)) for n in (3, 1)]
    items = [videos[0], images[0], images[1], videos[1]]
    together = enc.encode_images(items)
    for item, got in zip(items, together):
        torch.testing.assert_close(got, enc.encode_images([item])[0], rtol=0, atol=1e-5)
    assert enc.span_ids(images[0][1]) == [IMAGE_TOKEN_ID] * enc.tokens_for(images[0][1])


def _counting_processor(tile: int, patch: int):
    """LlavaOnevisionProcessor's counting state alone (its constructor wants a video processor,
    which needs torchvision)."""
    processor = transformers.LlavaOnevisionProcessor.__new__(transformers.LlavaOnevisionProcessor)
    processor.num_image_tokens = (tile // patch) ** 2
    processor.video_token = "<video>"
    return processor


def test_token_count_equals_transformers_processor():
    """llava-onevision-qwen2's 384-pixel squares in 14-pixel patches (27 x 27 pooled to 14 x 14), and
    tiny ones of 4, 3 and 2 features a side, over a sweep of frame counts."""
    rng = np.random.default_rng(0)
    sizes = [(int(rng.integers(1, DEFAULT_MAX_FRAMES + 1)), *(int(v) for v in rng.integers(1, 2000, size=2)))
             for _ in range(50)] + [(1, 1, 1), (DEFAULT_MAX_FRAMES, 384, 384), (32, 480, 640)]
    for tile, patch in ((384, 14), (28, 7), (42, 14), (28, 14)):
        grid, processor = OnevisionVideoGrid(tile // patch), _counting_processor(tile, patch)
        want = processor._get_num_multimodal_tokens(video_sizes=sizes)["num_video_tokens"]
        assert [grid.tokens_for(s) for s in sizes] == want
        assert all(grid.check(s) is None for s in sizes)
        for frames in (1, 4):       # the prompt expansion, from the processed video's frames
            expanded = processor.replace_video_token({"pixel_values_videos": [torch.zeros(frames, 3, 2, 2)]}, 0)
            assert expanded == "<video>" * grid.tokens_for((frames, 10, 10))
    assert OnevisionVideoGrid(27).tokens_for((32, 480, 640)) == 32 * 196 + 1


def test_video_processor_equals_transformers_on_frames_at_its_size(tmp_path):
    """Frames already 28 x 28: the PIL resize is the identity, so the pixels are the image
    processor's steps: equal to LlavaOnevisionImageProcessorPil's base square of the same frame, and
    to the video processor's fused rescale-and-normalize, (x - 255 * mean) / (255 * std)."""
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    processor = OnevisionVideoProcessor.from_model_dir(path)
    assert processor.frame_size == (28, 28) and processor.steps.resample == 3
    frames = _frames(3, 28, 28, 5)
    assert all(np.array_equal(np.array(f.resize((28, 28), Image.Resampling.BICUBIC)), np.array(f)) for f in frames)
    pixels, size = processor(frames)
    assert size == (3, 28, 28) and pixels.dtype == torch.float32 and pixels.shape == (3, 3, 28, 28)
    image = transformers.LlavaOnevisionImageProcessorPil.from_pretrained(str(path))
    for frame, got in zip(frames, pixels):
        torch.testing.assert_close(got, image(frame, return_tensors="pt")["pixel_values"][0, 0], rtol=0, atol=1e-6)
        raw = torch.from_numpy(np.array(frame)).permute(2, 0, 1).float()
        torch.testing.assert_close(got, (raw - 0.5 * 255) / (0.5 * 255), rtol=0, atol=1e-6)
    enc = LlavaOnevisionImageEncoder.from_checkpoint(path)
    assert enc.check_pixels(pixels, size) is None
    # Larger frames are resized (PIL bicubic here, torchvision's there: not compared) to the square.
    assert processor(_frames(2, 50, 70))[0].shape == (2, 3, 28, 28)


def test_video_processor_files_and_defaults(tmp_path):
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    reference = LlavaOnevisionVideoProcessor       # its class defaults (an instance needs torchvision)
    steps = OnevisionVideoProcessor.from_fields({}).steps
    assert steps.size == reference.size and steps.resample == reference.resample
    assert steps.image_mean == tuple(reference.image_mean) and steps.image_std == tuple(reference.image_std)
    assert steps.rescale_factor == reference.rescale_factor and not steps.do_center_crop
    assert OnevisionVideoProcessor.from_model_dir(tmp_path) is None
    # Without a video_preprocessor_config.json the image processor's file applies; with one, it wins.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.1, 0.2, 0.3],
                                                                    "size": {"height": 56, "width": 56}}))
    steps = OnevisionVideoProcessor.from_model_dir(tmp_path).steps
    assert steps.image_mean == (0.1, 0.2, 0.3) and steps.image_std == tuple(reference.image_std)
    assert steps.size == {"height": 56, "width": 56}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"image_std": 0.5, "resample": 2}))
    steps = OnevisionVideoProcessor.from_model_dir(tmp_path).steps
    assert steps.image_std == (0.5,) * 3 and steps.resample == 2 and steps.size == reference.size
    for bad, field in (({"size": 384}, "size"), ({"size": {"shortest_edge": 384}}, "size"),
                       ({"do_center_crop": True}, "crop_size")):
        with pytest.raises(ValueError, match=field):
            OnevisionVideoProcessor.from_fields(bad)


def test_refusals(tmp_path):
    path = write_tiny_llava_onevision(tmp_path / "ov", text_layers=1)
    enc, processor = LlavaOnevisionImageEncoder.from_checkpoint(path), OnevisionVideoProcessor.from_model_dir(path)
    with pytest.raises(ValueError, match="at least one frame"):
        processor([])
    with pytest.raises(ValueError, match="one size"):
        processor(_frames(1, 30, 40) + _frames(1, 40, 30))
    with pytest.raises(ValueError, match="frames"):
        OnevisionVideoProcessor(processor.steps, max_frames=2)(_frames(3, 28, 28))
    pixels, size = processor(_frames(3, 30, 40))
    assert "takes (2, 3, 28, 28)" in enc.check_pixels(pixels, (2, 30, 40))
    assert "takes (3, 3, 28, 28)" in enc.check_pixels(pixels[:, :, :14], size)
    assert "video of 3 frames" in enc.check_pixels(pixels[None], size)
    assert "1 to 768 frames" in enc.check_pixels(pixels[:0], (0, 30, 40))
    assert "frames" in enc.check_pixels(pixels, (DEFAULT_MAX_FRAMES + 1, 30, 40))
    assert "0x40" in enc.check_pixels(pixels, (3, 0, 40))
    for bad in ((3.0, 30, 40), (3, 30, True)):
        assert "(frames, height, width)" in enc.check_pixels(pixels, bad)
    with pytest.raises(ValueError, match="image 1: pixels are"):
        enc.encode_images([(pixels, size), (pixels[:2], size)])
    config = json.loads((tmp_path / "ov" / "config.json").read_text())
    for change in ({"video_token_index": IMAGE_TOKEN_ID}, {"video_token_index": "<video>"},
                   {"video_token_index": -1}):
        with pytest.raises(ValueError, match="video_token_index"):
            LlavaOnevisionImageEncoder({**config, **change}, 256)
    config.pop("video_token_index")
    with torch.device("meta"):
        assert LlavaOnevisionImageEncoder(config, 256).video_token_id == DEFAULT_VIDEO_TOKEN_ID


@pytest.fixture(scope="module")
def video_prompt(tmp_path_factory):
    """The chat prompt "<video>What happens, and<image>?" laid out as the server does, and
    transformers' greedy tokens for it (the video as `pixel_values_videos`)."""
    from llava_reference import _greedy

    from raycluster.model.loader import load_model
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.request import ImageInput

    path = write_tiny_llava_onevision(tmp_path_factory.mktemp("ov"), seed=4)
    enc = LlavaOnevisionImageEncoder.from_checkpoint(path)
    tok = Tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": "What happens, and"}, {"type": "image"},
        {"type": "text", "text": "?"}]}])
    # 20 frames: 81 tokens, more than the image's 70, so the prefix hit below resumes inside the video.
    vpx, vsize = OnevisionVideoProcessor.from_model_dir(path)(_frames(20, 45, 60, 9))
    picture = _frames(1, 30, 40, 8)[0]
    ipx, isize = OnevisionImageProcessor.from_model_dir(path)(picture)
    ids, inputs = [], []
    for t in tok.encode(text, add_special_tokens=False):
        if t not in (VIDEO_TOKEN_ID, IMAGE_TOKEN_ID):
            ids.append(t)
            continue
        px, size = (vpx, vsize) if t == VIDEO_TOKEN_ID else (ipx, isize)
        inputs.append(ImageInput(len(ids), enc.tokens_for(size), px, hashlib.sha256(px.numpy().tobytes()).digest(),
                                 size))
        ids.extend(enc.span_ids(size))
    assert [im.size for im in inputs] == [vsize, isize] and [im.length for im in inputs] == [20 * 4 + 1, 70]
    hf_image = transformers.LlavaOnevisionImageProcessorPil.from_pretrained(path)(picture, return_tensors="pt")
    hf = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pictures = {"pixel_values": hf_image["pixel_values"], "image_sizes": hf_image["image_sizes"]}
    want = _greedy(hf, ids, pictures.pop("pixel_values"), 10, False, **pictures, pixel_values_videos=vpx[None])
    model, _ = load_model(path)
    return model, enc, ids, inputs, want, _prompt_logprobs(hf, ids, hf_image, vpx)


def _prompt_logprobs(hf, ids: list[int], image: dict, video: torch.Tensor) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first; checked to depend on
    the video's frames (a greedy continuation of the tiny model need not)."""
    def run(frames):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids]), pixel_values=image["pixel_values"],
                        image_sizes=image["image_sizes"], pixel_values_videos=frames[None]).logits[0]
        return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    want = run(video)
    assert (want - run(video.flip(0))).abs().max() > 1e-4       # the frames' order reaches the text model
    return want


@pytest.mark.parametrize("chunk", [5, 512])
def test_greedy_tokens_with_a_video_equal_transformers(video_prompt, chunk):
    from image_engine_checks import BASE, image_sp, run_to_end

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine

    model, enc, ids, inputs, want, logprobs = video_prompt
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=2048, chunk_size=chunk), model, image_encoder=enc)
    sp = image_sp(inputs)
    sp.prompt_logprobs = 0
    req = run_to_end(eng, "v", ids, sp)
    assert req.output_token_ids == want
    got = torch.tensor([e.logprob for e in req.prompt_logprobs])        # entry i: prompt token i + 1
    torch.testing.assert_close(got, logprobs, rtol=0, atol=1e-4)


def test_a_prefix_hit_inside_a_video_and_a_tp_group(video_prompt):
    from image_engine_checks import check_group, check_prefix_hit

    check_prefix_hit(*video_prompt[:5])
    check_group(*video_prompt[:5], {"tp": 2})
