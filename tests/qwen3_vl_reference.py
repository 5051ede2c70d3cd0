"""transformers' Qwen3-VL as the reference for raycluster's Qwen3-VL image input (test-time only).

`hf_qwen3_vl(model_dir)` is the checkpoint's `Qwen3VLForConditionalGeneration` (or the MoE one:
the class `architectures` names; float32, cached); `hf_qwen3_vl_processor(model_dir)` its
`Qwen3VLProcessor` over the PIL image processor (`Qwen2VLImageProcessorPil`, the class
transformers maps qwen3_vl's image processor to without torchvision) and the checkpoint's
tokenizer, built by hand: transformers' loader insists on the video processor, which needs
torchvision. Its output carries `mm_token_type_ids` (image tokens marked 1).
`hf_qwen3_vl_image_rows(model_dir, pixel_values, image_grid_thw)` is `get_image_features` laid
out as raycluster's encoder returns it: per image, [tokens, (1 + levels) * hidden], the merger's
features then each DeepStack level.
`hf_qwen3_vl_greedy(model_dir, input_ids, pixel_values, image_grid_thw, max_new_tokens)` is the
model's greedy continuation of one prompt whose image placeholders are already expanded (pure
argmax: EOS neither stops nor is suppressed unless `stop_at_eos`), the new token ids only; the
prompt's image tokens are marked in `mm_token_type_ids`, from which transformers lays out the
multimodal rotary positions (`get_rope_index`), and the DeepStack levels are added after the first
decoder layers at those tokens. Without pixels (None) it is the prompt read as text alone.
"""

from __future__ import annotations

import torch
from qwen_vl_reference import hf_qwen_vl


def hf_qwen3_vl(model_dir):
    """The checkpoint's model (cached by raycluster's Qwen-VL reference: the class its config names)."""
    return hf_qwen_vl(str(model_dir))


def hf_qwen3_vl_processor(model_dir):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    processor.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor.video_processor, processor.chat_template = None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    for name in ("image", "video", "vision_start", "vision_end"):
        token = getattr(processor, f"{name}_token")
        setattr(processor, f"{name}_token_id", processor.tokenizer.convert_tokens_to_ids(token))
    return processor


def hf_qwen3_vl_image_rows(model_dir, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
    model = hf_qwen3_vl(model_dir)
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return [torch.cat([merged, *(level[k] for level in out.deepstack_features)], dim=-1)
            for k, merged in enumerate(out.pooler_output)]


def hf_qwen3_vl_greedy(model_dir, input_ids: list[int], pixel_values: torch.Tensor | None,
                       image_grid_thw: torch.Tensor | None, max_new_tokens: int, stop_at_eos: bool = False,
                       model=None) -> list[int]:
    """`model`: another loaded model to run instead of the checkpoint's cached one (a test's variant)."""
    from llava_reference import _greedy

    model = hf_qwen3_vl(model_dir) if model is None else model
    image = {}
    if pixel_values is not None:
        types = (torch.tensor([input_ids]) == model.config.image_token_id).int()
        image = {"image_grid_thw": image_grid_thw, "mm_token_type_ids": types}
    return _greedy(model, input_ids, pixel_values, max_new_tokens, stop_at_eos, **image)
