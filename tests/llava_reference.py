"""transformers' LLaVA as the reference for raycluster's image input (test-time only).

`expand_image_tokens(ids, image_token_id, tokens_per_image)` repeats each image placeholder as
LlavaProcessor does (one id per image feature); `hf_pixel_values(model_dir, images)` is the
checkpoint's image processor output through transformers' PIL path; `hf_llava_greedy(model_dir,
input_ids, pixel_values, max_new_tokens)` is LlavaForConditionalGeneration's greedy continuation
of one prompt whose image placeholders are already expanded (pure argmax: EOS neither stops nor is
suppressed unless `stop_at_eos`), the new token ids only. `hf_llava_next_greedy(model_dir, input_ids,
pixel_values, image_sizes, max_new_tokens)` is the same for LlavaNextForConditionalGeneration, whose
images bring their squares ([images, 1 + tiles, 3, S, S]) and (height, width) each.
"""

from __future__ import annotations

import functools

import torch


def expand_image_tokens(ids: list[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    out: list[int] = []
    for t in ids:
        out.extend([t] * tokens_per_image if t == image_token_id else [t])
    return out


def hf_pixel_values(model_dir, images) -> torch.Tensor:
    """[N, 3, S, S] float32 from transformers' CLIP image processor (its PIL backend)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(str(model_dir))(list(images), return_tensors="pt")["pixel_values"]


@functools.lru_cache(maxsize=4)
def hf_llava(model_dir: str):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def hf_llava_next(model_dir: str):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_llava_next_greedy(model_dir, input_ids: list[int], pixel_values: torch.Tensor | None,
                         image_sizes: torch.Tensor | None, max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    image = {} if image_sizes is None else {"image_sizes": image_sizes}
    return _greedy(hf_llava_next(str(model_dir)), input_ids, pixel_values, max_new_tokens, stop_at_eos, **image)


def hf_llava_greedy(model_dir, input_ids: list[int], pixel_values: torch.Tensor | None, max_new_tokens: int,
                    stop_at_eos: bool = False) -> list[int]:
    return _greedy(hf_llava(str(model_dir)), input_ids, pixel_values, max_new_tokens, stop_at_eos)


def _greedy(model, input_ids: list[int], pixel_values: torch.Tensor | None, max_new_tokens: int, stop_at_eos: bool,
            **image) -> list[int]:
    """The model's greedy new tokens (pure argmax: EOS neither stops nor is suppressed unless
    `stop_at_eos`). Without pixels (None) no pixel_values reach generate(): some models encode
    whatever they are handed, None too."""
    ids = torch.tensor([input_ids])
    if pixel_values is not None:
        image = {"pixel_values": pixel_values, **image}
    kwargs = {} if stop_at_eos else {"eos_token_id": None}
    config = model.generation_config
    saved = config.eos_token_id
    if not stop_at_eos:
        config.eos_token_id = None      # generate() would take the model's EOS back from here
    try:
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=2, **image, **kwargs)
    finally:
        config.eos_token_id = saved
    return seq[0, len(input_ids):].tolist()
