"""Qwen2-VL's and Qwen2.5-VL's videos (raycluster.model.qwen_vl_video) against transformers 5.24:
the patch layout and token counts of `Qwen2VLVideoProcessor` (its module needs torchvision, which is
not installed here, so its `patchify`, `smart_resize` and `get_num_of_video_patches` are compiled
from its source), a still video equal to the image, the encoder's features equal to
`get_video_features`, and the multimodal rotary positions equal to `get_rope_index` (with
Qwen2.5-VL's temporal spacing), or to the models' original arithmetic where 5.24 departs from it."""

from __future__ import annotations

import __future__
import ast
import json
import math
import os
import types

import numpy as np
import pytest
import torch
from qwen_vl_reference import hf_qwen_vl
from PIL import Image

from raycluster.model.llava import image_encoder_for, image_facts
from raycluster.model.mrope import MRopeLayout
from raycluster.model.qwen_vl_processor import QwenVLGrid
from raycluster.model.qwen_vl_video import (DEFAULT_MAX_FRAMES, QwenVLVideoGrid, QwenVLVideoProcessor, VideoFields,
                                            video_fields)
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.model.tiny_qwen_vl import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID

transformers = pytest.importorskip("transformers")
QWEN2, QWEN25 = "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"


def _frames(n: int, h: int, w: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_video():
    """transformers' Qwen2VLVideoProcessor.patchify / get_num_of_video_patches and its smart_resize,
    compiled from its source (no torchvision needed for these three)."""
    import transformers.models.qwen2_vl as pkg

    path = os.path.join(os.path.dirname(pkg.__file__), "video_processing_qwen2_vl.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    smart = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    body = [smart, methods["patchify"], methods["get_num_of_video_patches"]]
    for fn in body:
        fn.decorator_list = []
    ns = {"torch": torch, "math": math}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in ("patchify", "get_num_of_video_patches")})


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 7])
def test_patch_layout_equals_transformers(hf_video, frames):
    grid = QwenVLVideoGrid(QwenVLGrid())
    processor = QwenVLVideoProcessor(grid, steps=None)
    x = torch.randn(frames, 3, 56, 84)
    want, t, h, w = hf_video.patchify(None, x[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    got = processor.patchify(x)
    assert torch.equal(got, want[0])
    assert (t, h, w) == (math.ceil(frames / 2), 4, 6)


def test_token_counts_equal_transformers(hf_video):
    rng = np.random.default_rng(1)
    sizes = [(int(rng.integers(1, 40)), *(int(v) for v in rng.integers(1, 2000, size=2))) for _ in range(200)]
    sizes = [s for s in sizes if max(s[1:]) / min(s[1:]) <= 200] + [(1, 28, 28), (768, 10, 10)]
    for low, high in ((128 * 28 * 28, 28 * 28 * 768), (56 * 56, 28 * 28 * 16), (3136, 12845056)):
        grid = QwenVLVideoGrid(QwenVLGrid(), VideoFields(low, high))
        this = types.SimpleNamespace(size={"shortest_edge": low, "longest_edge": high}, patch_size=14,
                                     merge_size=2, temporal_patch_size=2)
        want = [hf_video.get_num_of_video_patches(this, f, h, w, videos_kwargs={}) // 4 for f, h, w in sizes]
        assert [grid.tokens_for(s) for s in sizes] == want
        assert all(grid.check(s) is None for s in sizes)


def test_refusals():
    grid = QwenVLVideoGrid(QwenVLGrid())
    assert "frames" in grid.check((0, 28, 28)) and "frames" in grid.check((DEFAULT_MAX_FRAMES + 1, 28, 28))
    assert "aspect ratio" in grid.check((2, 2, 500)) and "(frames, height, width)" in grid.check((28, 28))
    processor = QwenVLVideoProcessor(grid, steps=None)
    with pytest.raises(ValueError, match="one size"):
        processor(_frames(1, 30, 40) + _frames(1, 40, 30))
    with pytest.raises(ValueError, match="at least one frame"):
        processor([])
    for bad in ({"max_frames": 0}, {"min_pixels": "many"}, {"size": {"shortest_edge": -1, "longest_edge": 5}}):
        with pytest.raises(ValueError, match="video processor config"):
            video_fields(bad)


def test_video_fields_follow_transformers_files(tmp_path):
    assert video_fields(None) == VideoFields(128 * 28 * 28, 28 * 28 * 768, 768)
    # Without a video_preprocessor_config.json, the image processor's file (its limits) applies.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert QwenVLVideoProcessor.from_model_dir(tmp_path).grid.limits == VideoFields(3136, 12845056, 768)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "max_pixels": 32768, "max_frames": 64}))
    assert QwenVLVideoProcessor.from_model_dir(tmp_path).grid.limits == VideoFields(4096, 32768, 64)


@pytest.fixture(scope="module", params=[QWEN2, QWEN25])
def checkpoint(request, tmp_path_factory):
    return write_tiny_multimodal(tmp_path_factory.mktemp("qwen_video"), request.param, seed=3, vision_weights=True,
                                 num_hidden_layers=2), request.param


def test_a_still_video_is_its_image(checkpoint):
    """Two equal frames make the rows the image processor makes of the one image (an image is a
    frame repeated over the temporal patch), with the video's token."""
    path, _ = checkpoint
    facts, enc = image_facts(path), image_encoder_for(path)
    frame = _frames(1, 50, 70, seed=4)[0]
    image = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(path))(frame, return_tensors="pt")
    pixels, size, n = facts.prepare_video([frame, frame])
    assert size == (2, 50, 70) and torch.equal(pixels, image["pixel_values"])
    assert n == enc.tokens_for((50, 70)) and facts.grid_for(size) == enc.grid_for((50, 70))
    assert enc.span_ids(size) == [VIDEO_TOKEN_ID] * n and enc.span_ids((50, 70)) == [IMAGE_TOKEN_ID] * n
    torch.testing.assert_close(enc.encode_images([(pixels, size)])[0], enc.encode_images([(pixels, (50, 70))])[0])


def test_encoder_equals_transformers_video_features(checkpoint):
    path, arch = checkpoint
    facts, enc = image_facts(path), image_encoder_for(path)
    videos = [facts.prepare_video(_frames(n, h, w, seed=n)) for n, h, w in ((3, 40, 60), (4, 90, 30), (1, 28, 28))]
    hf = hf_qwen_vl(str(path))
    pixels = torch.cat([px for px, _, _ in videos])
    thw = torch.tensor([enc.video_grid.grid_thw(size) for _, size, _ in videos])
    with torch.no_grad():
        want = hf.get_video_features(pixel_values_videos=pixels, video_grid_thw=thw).pooler_output
    got = enc.encode_images([(px, size) for px, size, _ in videos])
    for (px, size, n), g, w in zip(videos, got, want):
        assert enc.check_pixels(px, size) is None and g.shape == (n, 256)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert "video of 3 frames" in enc.check_pixels(videos[1][0], videos[0][1])


def _positions_case(path, frames_hw: tuple[int, int, int]):
    """ids "a b [video] c [image] d" laid out as the server does, and both grids."""
    facts, enc = image_facts(path), image_encoder_for(path)
    vpx, vsize, vn = facts.prepare_video(_frames(*frames_hw))
    ipx, isize, inn = facts.prepare(_frames(1, 60, 40)[0])
    ids = [11, 12] + [VIDEO_TOKEN_ID] * vn + [13] + [IMAGE_TOKEN_ID] * inn + [14, 15]
    layout = MRopeLayout([(2, vn, enc.grid_for(vsize)), (3 + vn, inn, enc.grid_for(isize))],
                         (enc.time_step_for(vsize), enc.time_step_for(isize)))
    return ids, layout, enc, vsize, isize


def test_positions_equal_transformers_get_rope_index(checkpoint):
    """Wide frames, so the video's temporal extent stays inside its width and transformers 5.24
    and the original arithmetic agree (the next test has them differ)."""
    path, arch = checkpoint
    ids, layout, enc, vsize, isize = _positions_case(path, (4, 28, 420))
    hf = hf_qwen_vl(str(path))
    types_ = torch.tensor([[2 if t == VIDEO_TOKEN_ID else 1 if t == IMAGE_TOKEN_ID else 0 for t in ids]])
    kwargs = dict(image_grid_thw=torch.tensor([enc.grid.grid_thw(isize)]),
                  video_grid_thw=torch.tensor([enc.video_grid.grid_thw(vsize)]))
    if arch == QWEN25:
        kwargs["second_per_grid_ts"] = torch.tensor([2 / 2.0])      # temporal_patch_size / fps
        assert enc.time_step_for(vsize) == hf.config.vision_config.tokens_per_second * 1.0 != 1.0
    want, delta = hf.model.get_rope_index(torch.tensor([ids]), types_, **kwargs)
    assert torch.equal(layout.positions(0, len(ids)), want[:, 0].T)
    assert layout.delta == int(delta)
    for start, n in ((0, 5), (3, 7), (9, len(ids) - 9)):        # any run of the prompt
        assert torch.equal(layout.positions(start, n), want[:, 0, start:start + n].T)


def test_a_long_video_resumes_text_past_its_last_temporal_position(checkpoint):
    """Small frames, many of them: the text after the video starts at its largest position + 1 (vLLM
    and the Qwen-VL originals; transformers 5.24 resumes at max(h, w), inside the video's time)."""
    path, arch = checkpoint
    ids, layout, enc, vsize, _ = _positions_case(path, (8, 28, 56))
    t, h, w = enc.grid_for(vsize)
    step = enc.time_step_for(vsize)
    with open(os.path.join(path, "config.json")) as f:
        tokens_per_second = json.load(f)["vision_config"].get("tokens_per_second")
    assert (t, h, w) == (4, 2, 3) and step == (1.0 if arch == QWEN2 else tokens_per_second * 2 / 2.0)
    pos = layout.positions(0, len(ids))
    video = pos[2:2 + t * h * w]
    assert video[:, 0].tolist() == [2 + int(k * step) for k in range(t) for _ in range(h * w)]
    last_t = 2 + int((t - 1) * step)
    assert pos[2 + t * h * w].tolist() == [last_t + 1] * 3        # the "c" after the video


@pytest.fixture(scope="module")
def video_prompt(checkpoint):
    """A prompt with a video and an image as the server lays it out, and transformers' greedy tokens."""
    import hashlib

    from llava_reference import _greedy

    from raycluster.model.loader import load_model
    from raycluster.request import ImageInput

    path, arch = checkpoint
    ids, layout, enc, vsize, isize = _positions_case(path, (4, 28, 420))
    facts = image_facts(path)
    vpx, _, vn = facts.prepare_video(_frames(4, 28, 420))
    ipx, _, inn = facts.prepare(_frames(1, 60, 40)[0])
    inputs = [ImageInput(2, vn, vpx, hashlib.sha256(vpx.numpy().tobytes()).digest(), vsize),
              ImageInput(3 + vn, inn, ipx, hashlib.sha256(ipx.numpy().tobytes()).digest(), isize)]
    hf = hf_qwen_vl(str(path))
    types_ = torch.tensor([[2 if t == VIDEO_TOKEN_ID else 1 if t == IMAGE_TOKEN_ID else 0 for t in ids]])
    extra = {"second_per_grid_ts": torch.tensor([1.0])} if arch == QWEN25 else {}
    want = _greedy(hf, ids, ipx, 10, False, image_grid_thw=torch.tensor([enc.grid.grid_thw(isize)]),
                   pixel_values_videos=vpx, video_grid_thw=torch.tensor([enc.video_grid.grid_thw(vsize)]),
                   mm_token_type_ids=types_, **extra)
    model, _ = load_model(path)
    return model, enc, ids, inputs, want


@pytest.mark.parametrize("chunk", [5, 512])
def test_greedy_tokens_with_a_video_equal_transformers(video_prompt, chunk):
    from image_engine_checks import BASE, image_sp, run_to_end

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine

    model, enc, ids, inputs, want = video_prompt
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=1024, chunk_size=chunk), model, image_encoder=enc)
    req = run_to_end(eng, "v", ids, image_sp(inputs))
    assert req.output_token_ids == want


def test_a_prefix_hit_inside_a_video_and_a_tp_group(video_prompt):
    from image_engine_checks import check_group, check_prefix_hit

    check_prefix_hit(*video_prompt)
    check_group(*video_prompt, {"tp": 2})


def test_the_videos_frames_and_time_steps_are_read(video_prompt):
    """Prompt log-probabilities after the video move when its frames are reversed (the frames'
    order reaches the model), and, on Qwen2.5-VL, when its temporal spacing is dropped."""
    import dataclasses

    from image_engine_checks import BASE, image_sp

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine

    model, enc, ids, inputs, _ = video_prompt
    video = inputs[0]
    t = enc.grid_for(video.size)[0]
    reversed_px = video.pixel_values.view(t, -1, video.pixel_values.shape[1]).flip(0).reshape(video.pixel_values.shape)
    variants = {"as given": inputs, "reversed": [dataclasses.replace(video, pixel_values=reversed_px), inputs[1]]}
    lps = {}
    for name, images in [*variants.items(), ("no time step", inputs)]:
        eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=1024, chunk_size=512), model, image_encoder=enc)
        sp = image_sp(images, 1)
        sp.prompt_logprobs = 0
        req = eng.add_request(name, ids, sp)
        if name == "no time step":
            req.mrope = dataclasses.replace(req.mrope, time_steps=())
        for _ in range(100):
            if not eng.has_unfinished():
                break
            eng.step()
        lps[name] = [e.logprob for e in req.prompt_logprobs[1:]]
    after = video.offset + video.length
    moved = lambda a, b: max(abs(x - y) for x, y in zip(lps[a][after:], lps[b][after:]))      # noqa: E731
    assert moved("as given", "reversed") > 1e-4
    assert (moved("as given", "no time step") > 1e-4) == (enc.video_time_step != 1.0)


def test_qwen3_vl_takes_no_video(tmp_path):
    """Qwen3-VL's videos interleave timestamps with frames: refused, not served wrong."""
    from raycluster.engine.image_inputs import check_images
    from raycluster.engine.outputs import InvalidRequestError
    from raycluster.request import ImageInput, SamplingParams

    from raycluster.model.tiny_qwen3_vl import write_tiny_qwen3_vl

    path = write_tiny_qwen3_vl(tmp_path, seed=1)
    enc = image_encoder_for(path)
    assert not enc.takes_video and "not served" in enc.check_pixels(torch.zeros(1, 1), (2, 32, 32))
    sp = SamplingParams(images=[ImageInput(0, 4, torch.zeros(1, 1), b"", (2, 32, 32))])
    with pytest.raises(InvalidRequestError, match="takes no videos"):
        check_images([1] * 8, sp, enc)
