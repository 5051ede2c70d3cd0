"""transformers' Gemma 3 as the reference for raycluster's Gemma 3 image input (test-time only).

`hf_gemma3(model_dir)` is the checkpoint's Gemma3ForConditionalGeneration (float32, cached);
`hf_gemma3_processor(model_dir)` its Gemma3Processor (the PIL image processor and the
checkpoint's tokenizer), whose output for a text with "<start_of_image>" and its images is the
expanded prompt ids, `token_type_ids` (1 at each "<image_soft_token>") and `pixel_values`;
`hf_pixel_values(model_dir, images)` the image processor's pixels alone (Gemma3ImageProcessorPil),
called as Gemma3Processor calls it: with do_convert_rgb true (the processor's own default, over
the file's null or false; and its do_pan_and_scan false likewise overrides the file's).

`image_token_types(model_dir, input_ids)` is what that processor gives as `token_type_ids` for
already expanded ids: 1 at the image token, 0 elsewhere (begin / end of image included).
`hf_gemma3_greedy(model_dir, input_ids, pixel_values, max_new_tokens)` is the model's greedy
continuation of one expanded prompt with those token types, so its image tokens attend
bidirectionally within each image as after the processor (pure argmax: EOS neither stops nor is
suppressed unless `stop_at_eos`), the new token ids only. `hf_gemma3_logits(model_dir,
input_ids, inputs_embeds=..., pixel_values=..., bidirectional=True)` is one forward's logits [L,
vocab]; `hf_gemma3_masks(model_dir, input_ids)` the boolean attention masks ([L, L], True: the
query row may see the key column) transformers builds for the prompt's full and sliding layers in
such a forward, caught on their way into the text model.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_gemma3(model_dir: str):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_gemma3_processor(model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))


def hf_pixel_values(model_dir, images) -> torch.Tensor:
    """[N, 3, S, S] float32 from transformers' Gemma 3 image processor (its PIL backend)."""
    from transformers import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil.from_pretrained(str(model_dir))
    return processor(list(images), do_convert_rgb=True, return_tensors="pt")["pixel_values"]


def image_token_types(model_dir, input_ids: list[int]) -> torch.Tensor:
    """[1, L] token types as Gemma3Processor makes them: 1 exactly at the image token."""
    return (torch.tensor([input_ids]) == hf_gemma3(str(model_dir)).config.image_token_id).long()


def hf_gemma3_greedy(model_dir, input_ids: list[int], pixel_values: torch.Tensor | None, max_new_tokens: int,
                     stop_at_eos: bool = False) -> list[int]:
    from llava_reference import _greedy

    types = {} if pixel_values is None else {"token_type_ids": image_token_types(model_dir, input_ids)}
    return _greedy(hf_gemma3(str(model_dir)), input_ids, pixel_values, max_new_tokens, stop_at_eos, **types)


def hf_gemma3_logits(model_dir, input_ids: list[int], inputs_embeds: torch.Tensor | None = None,
                     pixel_values: torch.Tensor | None = None, bidirectional: bool = True) -> torch.Tensor:
    """[L, vocab] logits of one forward over the prompt: from `inputs_embeds` [L, hidden] when
    given (the ids then only mark the image tokens), else the ids (and `pixel_values`);
    `bidirectional` False leaves the token types out (a plain causal mask)."""
    model = hf_gemma3(str(model_dir))
    types = {"token_type_ids": image_token_types(model_dir, input_ids)} if bidirectional else {}
    inputs = {"inputs_embeds": inputs_embeds[None]} if inputs_embeds is not None else \
        {"input_ids": torch.tensor([input_ids]), "pixel_values": pixel_values}
    with torch.no_grad():
        return model(**inputs, **types).logits[0]


def hf_gemma3_masks(model_dir, input_ids: list[int]) -> dict[str, torch.Tensor]:
    """{"full_attention": [L, L], "sliding_attention": [L, L]} boolean masks of a forward with the
    prompt's token types (module docstring)."""
    model = hf_gemma3(str(model_dir))
    caught = {}

    def catch(module, args, kwargs):
        caught.update(kwargs["attention_mask"])

    handle = model.model.language_model.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([input_ids]), token_type_ids=image_token_types(model_dir, input_ids))
    finally:
        handle.remove()
    out = {}
    for kind, mask in caught.items():
        if mask.dtype != torch.bool:        # eager's additive float mask: 0 where attended
            mask = mask == 0
        out[kind] = mask[0, 0]
    return out
