"""What a prompt's image costs, side by side in one engine: the time to first token of a prompt
with an image against a text prompt of the same length, of the same image prompt again (its
blocks found in the prefix cache, keyed on the pixels), and of the same text with another image
(only the blocks before the image found), of other text before the same image (no block
found, the image's encoding found in the encoder cache), and of a new image given as its embeddings
(vLLM's image_embeds: no encoder runs); plus the encoder alone and the HTTP server's part (decoding
a photo and running the image processor).

    raycluster bench images [--image-size 336] [--tower-layers 4] [--text-tokens 24]
                            [--photo 1024x768] [--repeats 7] [--threads 1] --out FILE.json

A tiny LLaVA (raycluster.model.tiny_llava: a 32-wide CLIP tower of `--tower-layers` layers on
`--image-size` images, (image_size / 14)^2 image tokens, the tiny text model) on one engine with
prefix caching (fcfs, 512-token chunks, block 16). Each repeat runs every case once, in turn, with
fresh random text (so only the intended blocks are found); each time is from `add_request` to the
first token, max_tokens 1. The tower is tiny, so its share here is a floor; the preprocessing is
the real cost of a `--photo`-sized JPEG on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import tempfile
import time

import torch

from loadgen.images import synthetic_jpeg
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.model.image_processor import ImageProcessor, decode_image
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import ImageInput, SamplingParams


def _ttft(eng: LLMEngine, rid: str, ids: list[int], images: list[ImageInput]) -> tuple[float, int]:
    """(seconds from add_request to the first token, prompt tokens found in the prefix cache)."""
    t0 = time.perf_counter()
    req = eng.add_request(rid, ids, SamplingParams(max_tokens=1, images=images))
    for _ in range(10_000):
        if req.output_token_ids:
            break
        eng.step()
    dt = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    return dt, req.num_cached_tokens


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_multimodal(tmp, "LlavaForConditionalGeneration", seed=0, vision_weights=True,
                                     vision_options={"image_size": args.image_size,
                                                     "num_hidden_layers": args.tower_layers})
        model = load_model(path)[0]
        encoder = image_encoder_for(path)
        processor = ImageProcessor.from_model_dir(path)
    per = encoder.tokens_per_image
    eng = LLMEngine(EngineConfig(kv_cache_tokens=16 * (per + args.text_tokens) * 8, block_size=16, policy="fcfs",
                                 packer="token", chunk_size=512, predictor="none", num_threads=args.threads,
                                 enable_prefix_caching=True), model, image_encoder=encoder)
    width, height = map(int, args.photo.split("x"))
    rng = random.Random(0)
    text = lambda: [rng.randrange(6, 4000) for _ in range(args.text_tokens)]     # noqa: E731
    cases = {k: [] for k in ("text", "image", "same_image_again", "other_image_same_text", "same_image_other_text",
                             "given_embeddings", "encode", "preprocess")}
    cached = {k: [] for k in ("same_image_again", "other_image_same_text")}
    for r in range(args.repeats + 1):              # repeat 0 warms up and is left out
        jpegs = [synthetic_jpeg(width, height, 2 * r), synthetic_jpeg(width, height, 2 * r + 1)]
        t0 = time.perf_counter()
        pixels = processor(decode_image(jpegs[0]))
        preprocess = time.perf_counter() - t0
        other = processor(decode_image(jpegs[1]))
        t0 = time.perf_counter()
        encoder.encode(pixels[None])
        encode = time.perf_counter() - t0
        head, tail = text(), text()
        ids = head + [IMAGE_TOKEN_ID] * per + tail

        def images(px):
            return [ImageInput(len(head), per, px, hashlib.sha256(px.numpy().tobytes()).digest())]
        times = {"text": _ttft(eng, f"t{r}", text() + [rng.randrange(6, 4000) for _ in range(per)], [])[0]}
        times["image"], _ = _ttft(eng, f"i{r}", ids, images(pixels))
        times["same_image_again"], hit_same = _ttft(eng, f"s{r}", ids, images(pixels))
        times["other_image_same_text"], hit_other = _ttft(eng, f"o{r}", ids, images(other))
        # Other text before the same picture: no block found, the encoder's output is (encoder cache).
        times["same_image_other_text"], _ = _ttft(eng, f"x{r}", text() + [IMAGE_TOKEN_ID] * per + tail, images(pixels))
        # A picture seen nowhere before, given as the encoder's output (computed outside the timing).
        given = encoder.encode_images([(processor(decode_image(synthetic_jpeg(width, height, 10_000 + r))), (0, 0))])[0]
        embeds = [ImageInput(len(head), per, given, hashlib.sha256(given.numpy().tobytes()).digest(), embeds=True)]
        times["given_embeddings"], _ = _ttft(eng, f"e{r}", text() + [IMAGE_TOKEN_ID] * per + text(), embeds)
        if r:
            for k, v in times.items():
                cases[k].append(v)
            cases["encode"].append(encode)
            cases["preprocess"].append(preprocess)
            cached["same_image_again"].append(hit_same)
            cached["other_image_same_text"].append(hit_other)
    med = {k: statistics.median(v) for k, v in cases.items()}
    return {"args": vars(args), "tokens_per_image": per, "prompt_tokens": 2 * args.text_tokens + per,
            "seconds": cases, "median_s": med, "cached_tokens": cached,
            "ratio_image_over_text": med["image"] / med["text"],
            "ratio_same_image_again_over_image": med["same_image_again"] / med["image"],
            "ratio_other_image_over_image": med["other_image_same_text"] / med["image"],
            "ratio_same_image_other_text_over_image": med["same_image_other_text"] / med["image"],
            "ratio_given_embeddings_over_image": med["given_embeddings"] / med["image"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="raycluster bench images", description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--tower-layers", type=int, default=4)
    p.add_argument("--text-tokens", type=int, default=24)
    p.add_argument("--photo", default="1024x768")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    res = run(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    med = res["median_s"]
    print(f"{res['tokens_per_image']} image tokens, {res['prompt_tokens']}-token prompts; medians over {args.repeats}:")
    for k, v in med.items():
        print(f"  {k}: {v * 1e3:.1f} ms")
    print(f"image / text TTFT {res['ratio_image_over_text']:.2f}x; same image again / first "
          f"{res['ratio_same_image_again_over_image']:.2f}x; other image, same text / first "
          f"{res['ratio_other_image_over_image']:.2f}x; same image, other text / first "
          f"{res['ratio_same_image_other_text_over_image']:.2f}x; a new image's embeddings given / first "
          f"{res['ratio_given_embeddings_over_image']:.2f}x")
    return 0
