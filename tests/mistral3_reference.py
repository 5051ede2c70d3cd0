"""transformers' Mistral 3 as the reference for raycluster's Mistral 3 image input (test-time only).

`hf_mistral3(model_dir)` is the checkpoint's Mistral3ForConditionalGeneration (float32, cached).
`hf_mistral3_processor(model_dir)` its PixtralProcessor (what AutoProcessor gives a mistral3
checkpoint) over the PIL image processor (PixtralImageProcessorPil) and the checkpoint's
tokenizer. transformers 5.24 marks processing_pixtral as needing torchvision, which this
environment lacks, though the only thing it takes from the torchvision image processor's module is
`get_resize_output_image_size`, which the PIL module defines identically: the module is imported
with the PIL module standing in for that one, for the import only. `hf_processed(model_dir, text,
images)` is that processor's output for one text with "[IMG]" per image: the expanded prompt ids
(no BOS added), and each image's pixels cut back out of the zero-padded batch by `image_sizes`.

`hf_mistral3_greedy(model_dir, input_ids, pixel_values, image_sizes, max_new_tokens)` is the
model's greedy continuation of one expanded prompt (pure argmax: EOS neither stops nor is
suppressed), the new token ids only; `pixel_values` a list of [3, H, W] images (zero-padded into
one batch, as the processor does: `padded_batch`) or the batch itself, `image_sizes` their (H, W).
`hf_mistral3_logits(model_dir, input_ids, inputs_embeds=..., pixel_values=..., image_sizes=...)`
is one forward's [L, vocab] logits, from embeddings when given, else from the ids and the images;
`hf_token_embeddings(model_dir, input_ids)` the prompt's token embeddings.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch


@functools.lru_cache(maxsize=4)
def hf_mistral3(model_dir: str):
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def pixtral_processor_class():
    """transformers' PixtralProcessor class (module docstring)."""
    name = "transformers.models.pixtral.processing_pixtral"
    try:
        return importlib.import_module(name).PixtralProcessor
    except ImportError:
        pass
    from transformers.models.pixtral import image_processing_pil_pixtral

    stand_in = "transformers.models.pixtral.image_processing_pixtral"
    saved = sys.modules.get(stand_in)
    sys.modules[stand_in] = image_processing_pil_pixtral
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        if saved is None:
            del sys.modules[stand_in]
        else:
            sys.modules[stand_in] = saved


def hf_mistral3_processor(model_dir):
    return pixtral_processor_class().from_pretrained(str(model_dir))


def hf_processed(model_dir, text: str, images) -> tuple[list[int], list[torch.Tensor], list[tuple[int, int]]]:
    """(expanded prompt ids, each image's [3, H, W] pixels, their (H, W)) from PixtralProcessor."""
    out = hf_mistral3_processor(model_dir)(text=[text], images=[list(images)], return_tensors="pt",
                                           add_special_tokens=False)
    sizes = [tuple(int(x) for x in s) for s in out["image_sizes"]]
    pixels = [p[:, :h, :w] for p, (h, w) in zip(out["pixel_values"], sizes)]
    return out["input_ids"][0].tolist(), pixels, sizes


def padded_batch(pixel_values, image_sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """The zero-padded [N, 3, H, W] batch and [N, 2] sizes, as PixtralProcessor returns them."""
    sizes = torch.tensor([list(s) for s in image_sizes])
    if isinstance(pixel_values, torch.Tensor):
        return pixel_values, sizes
    batch = torch.zeros(len(pixel_values), pixel_values[0].shape[0], int(sizes[:, 0].max()), int(sizes[:, 1].max()))
    for k, p in enumerate(pixel_values):
        batch[k, :, :p.shape[1], :p.shape[2]] = p
    return batch, sizes


def hf_mistral3_greedy(model_dir, input_ids: list[int], pixel_values, image_sizes, max_new_tokens: int) -> list[int]:
    from llava_reference import _greedy

    batch, sizes = padded_batch(pixel_values, image_sizes)
    return _greedy(hf_mistral3(str(model_dir)), input_ids, batch, max_new_tokens, False, image_sizes=sizes)


def hf_mistral3_logits(model_dir, input_ids: list[int], inputs_embeds: torch.Tensor | None = None,
                       pixel_values=None, image_sizes=None) -> torch.Tensor:
    """[L, vocab] logits of one forward (module docstring)."""
    model = hf_mistral3(str(model_dir))
    if inputs_embeds is not None:
        inputs = {"inputs_embeds": inputs_embeds[None]}
    else:
        batch, sizes = padded_batch(pixel_values, image_sizes)
        inputs = {"input_ids": torch.tensor([input_ids]), "pixel_values": batch, "image_sizes": sizes}
    with torch.no_grad():
        return model(**inputs).logits[0]


def hf_token_embeddings(model_dir, input_ids: list[int]) -> torch.Tensor:
    """[L, hidden] token embeddings of the prompt (Mistral does not scale them)."""
    with torch.no_grad():
        return hf_mistral3(str(model_dir)).get_input_embeddings()(torch.tensor(input_ids))
