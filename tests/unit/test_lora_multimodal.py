"""LoRA adapters on image-text checkpoints (vLLM serves them on the text model): adapters that
name the text layers as transformers 5 (`model.language_model.layers`) or the released files
(`language_model.model.layers`) do, on prompts with images, give the greedy tokens of
transformers + PEFT; an adapter on the vision tower is refused naming it."""

from __future__ import annotations

import json

import pytest
import torch
from llava_reference import _greedy
from safetensors.torch import load_file, save_file
from test_quant_multimodal import _picture, _prompt

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_config, load_model
from raycluster.model.lora import AdapterError, load_adapter
from raycluster.model.tiny import write_tiny_lora
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import SamplingParams

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30,
            kv_cache_tokens=1024, chunk_size=9)


@pytest.mark.parametrize("arch", ["LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration"])
def test_an_adapter_on_an_image_prompt_gives_peft_tokens(tmp_path, arch):
    path = write_tiny_multimodal(tmp_path / "m", arch, seed=2, vision_weights=True, num_hidden_layers=2)
    # A strong adapter (std 0.3): the tiny Qwen2-VL's greedy tokens move only under one.
    adapter = write_tiny_lora(tmp_path / "a", path, seed=3, std=0.3, layers_prefix="model.language_model.layers")
    model, _ = load_model(path)
    enc = image_encoder_for(path)
    pictures = [_picture(40, 30, 5)]
    ids, images = _prompt(path, pictures)
    eng = LLMEngine(EngineConfig(**BASE, lora_modules=[f"tuned={adapter}"]), model, image_encoder=enc)
    outs = {}
    for name in ("tuned", None):
        req = eng.add_request(f"r-{name}", ids, SamplingParams(max_tokens=8, ignore_eos=True, images=images,
                                                              lora_adapter=name))
        for _ in range(200):
            if not eng.has_unfinished():
                break
            eng.step()
        outs[name] = req.output_token_ids
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    hf = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    if arch.startswith("Qwen"):
        out = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")
        extra = {"image_grid_thw": out["image_grid_thw"],
                 "mm_token_type_ids": (torch.tensor([ids]) == enc.image_token_id).int()}
        pixels = out["pixel_values"]
    else:
        extra, pixels = {}, torch.stack([im.pixel_values for im in images])
    want = _greedy(hf, ids, pixels, 8, False, **extra)
    assert outs["tuned"] == want and outs["tuned"] != outs[None]


def test_the_released_layouts_names_load_the_same_weights(tmp_path):
    path = write_tiny_multimodal(tmp_path / "m", "LlavaForConditionalGeneration", seed=2, vision_weights=True)
    cfg = load_config(path)
    new = write_tiny_lora(tmp_path / "new", path, seed=3, layers_prefix="model.language_model.layers")
    old = write_tiny_lora(tmp_path / "old", path, seed=3, layers_prefix="language_model.model.layers")
    a, b = load_adapter(new, cfg, "new"), load_adapter(old, cfg, "old")
    assert a.weights.keys() == b.weights.keys() and len(a.weights) == cfg.num_hidden_layers * 4
    for key in a.weights:
        assert all(torch.equal(x, y) for x, y in zip(a.weights[key], b.weights[key]))


def test_an_adapter_on_the_vision_tower_is_refused(tmp_path):
    path = write_tiny_multimodal(tmp_path / "m", "Qwen2VLForConditionalGeneration", seed=2, vision_weights=True)
    adapter = tmp_path / "a"
    write_tiny_lora(adapter, path, seed=3)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"] = torch.zeros(8, 32)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="targets the vision tower or projector"):
        load_adapter(adapter, load_config(path), "v")
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_type"] == "LORA"
