"""transformers' Qwen2-VL and Qwen2.5-VL as the reference for raycluster's image input (test-time only).

`hf_qwen_vl(model_dir)` is the checkpoint's `Qwen2VLForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` (float32, cached); `hf_qwen_vl_processor(model_dir)` its
`Qwen2VLProcessor` over the PIL image processor and the checkpoint's tokenizer (built by hand:
transformers' loader insists on the video processor, which needs torchvision);
`hf_qwen_vl_greedy(model_dir, input_ids, pixel_values, image_grid_thw, max_new_tokens)` the
model's greedy continuation of one prompt whose image placeholders are already expanded (pure
argmax: EOS neither stops nor is suppressed unless `stop_at_eos`), the new token ids only. The
prompt's image tokens are marked in `mm_token_type_ids`, from which transformers lays out the
multimodal rotary positions (`get_rope_index`).
"""

from __future__ import annotations

import functools
import json
import os

import torch
from llava_reference import _greedy


@functools.lru_cache(maxsize=4)
def hf_qwen_vl(model_dir: str):
    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_qwen_vl_processor(model_dir):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    processor.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor.video_processor, processor.chat_template = None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = processor.tokenizer.convert_tokens_to_ids(processor.video_token)
    return processor


def hf_qwen_vl_greedy(model_dir, input_ids: list[int], pixel_values: torch.Tensor | None,
                      image_grid_thw: torch.Tensor | None, max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    model = hf_qwen_vl(str(model_dir))
    image = {}
    if image_grid_thw is not None:
        types = (torch.tensor([input_ids]) == model.config.image_token_id).int()
        image = {"image_grid_thw": image_grid_thw, "mm_token_type_ids": types}
    return _greedy(model, input_ids, pixel_values, max_new_tokens, stop_at_eos, **image)


def compare_prompt(model_dir, images, hf_processor) -> tuple[list[int], list, dict]:
    """The tiny Qwen-VL chat prompt "<image>Compare<image>these." with `images` (PIL) as the server
    lays it out (raycluster.model.llava's facts): (expanded ids, their `ImageInput`s, and
    transformers' `hf_processor(model_dir)` output for the same, whose ids must be equal)."""
    from image_engine_checks import laid_out_prompt

    ids, inputs, text = laid_out_prompt(model_dir, [{"type": "image"}, {"type": "text", "text": "Compare"},
                                                    {"type": "image"}, {"type": "text", "text": "these."}], images)
    hf = hf_processor(model_dir)(images=images, text=[text.replace("<|bos|>", "", 1)], return_tensors="pt")
    assert hf["input_ids"][0].tolist() == ids
    return ids, inputs, hf
