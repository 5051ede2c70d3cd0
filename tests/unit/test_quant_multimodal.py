"""Quantized image-text checkpoints: the text model's layers quantized, the vision tower and
projector dense (as released quantized Qwen2.5-VL / LLaVA checkpoints keep them). `raycluster
quantize` writes them; the engine serves them with images and gives transformers' greedy tokens
(transformers reads compressed-tensors and FP8 checkpoints itself); ignore lists named in the
wrapper's layout reach the text model's layers; a quantized tower is refused naming it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from image_engine_checks import BASE, image_sp, laid_out_prompt, run_to_end
from llava_reference import _greedy
from PIL import Image

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.checkpoint_files import CheckpointError
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.multimodal_config import text_quant_config
from raycluster.model.quant.write import quantize_checkpoint
from raycluster.model.tiny_multimodal import write_tiny_multimodal

transformers = pytest.importorskip("transformers")
GROUP = 32


def _prompt(path, pictures):
    """A chat prompt with the pictures before "describe", laid out as the server does."""
    ids, inputs, _ = laid_out_prompt(path, [*({"type": "image"} for _ in pictures),
                                            {"type": "text", "text": "describe"}], pictures)
    return ids, inputs


def _picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("arch,scheme", [("Qwen2VLForConditionalGeneration", "w4a16"),
                                         ("Qwen2_5_VLForConditionalGeneration", "w8a16"),
                                         ("LlavaForConditionalGeneration", "w4a16")])
def test_quantized_image_text_models_give_transformers_tokens(tmp_path, arch, scheme):
    dense = write_tiny_multimodal(tmp_path / "dense", arch, seed=4, vision_weights=True, num_hidden_layers=2)
    path = str(tmp_path / scheme)
    quantize_checkpoint(dense, path, scheme, GROUP)
    with open(f"{path}/config.json") as f:
        assert f.read().count("re:.*visual.*") == 1       # the tower and projector are named dense
    model, cfg = load_model(path)
    assert cfg.quant is not None and cfg.quant.bits == (4 if scheme == "w4a16" else 8)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantLinear"
    enc = image_encoder_for(path)
    pictures = [_picture(30, 40, 1), _picture(50, 20, 2)]
    ids, images = _prompt(path, pictures)
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=1024, chunk_size=7), model, image_encoder=enc)
    got = run_to_end(eng, "q", ids, image_sp(images)).output_token_ids
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    if arch.startswith("Qwen"):
        out = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")
        types_ = (torch.tensor([ids]) == enc.image_token_id).int()
        want = _greedy(hf, ids, out["pixel_values"], 10, False, image_grid_thw=out["image_grid_thw"],
                       mm_token_type_ids=types_)
    else:
        pixels = torch.stack([image.pixel_values for image in images])
        want = _greedy(hf, ids, pixels, 10, False)
    assert got == want


def test_ignore_lists_in_the_wrappers_layout_name_the_text_models_layers():
    raw = {"quant_method": "awq", "modules_to_not_convert": [
        "language_model.model.layers.0.mlp.down_proj", "model.language_model.layers.1.self_attn.o_proj",
        "language_model.lm_head", "visual", "re:.*vision_tower.*"]}
    assert text_quant_config(raw)["modules_to_not_convert"] == [
        "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj", "lm_head", "visual", "re:.*vision_tower.*"]


def test_a_quantized_tower_is_refused_naming_it(tmp_path):
    """A checkpoint whose tower was quantized too (its linear layers stored packed) is refused
    with the tower named, not half-loaded."""
    from safetensors.torch import load_file, save_file

    dense = write_tiny_multimodal(tmp_path / "dense", "Qwen2VLForConditionalGeneration", seed=4, vision_weights=True)
    path = tmp_path / "q"
    quantize_checkpoint(dense, str(path), "w4a16", GROUP)
    tensors = load_file(str(path / "model.safetensors"))
    name = next(k for k in tensors if k.startswith("visual.") and k.endswith("attn.qkv.weight"))
    weight = tensors.pop(name)
    tensors[name[:-len("weight")] + "weight_packed"] = torch.zeros(weight.shape[0], weight.shape[1] // 8,
                                                                   dtype=torch.int32)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"vision tower\) is stored quantized .*a quantized tower is not served"):
        image_encoder_for(str(path))
