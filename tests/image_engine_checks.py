"""Checks the image-text engine tests share (tests/unit/test_*_engine.py): a request run to its
end on one engine, a second request over the same prompt and images resuming from a prefix-cache
hit that ends inside an image, and the greedy tokens of a tp / kvp / spp group. Each takes
the model, its image encoder, the expanded prompt ids, their `ImageInput`s and transformers'
greedy tokens `want`."""

from __future__ import annotations

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.request import ImageInput, Request, SamplingParams

BASE = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, group_timeout_s=30)


def laid_out_prompt(path, content: list[dict], pictures) -> tuple[list[int], list[ImageInput], str]:
    """A user message of `content` (its {"type": "image"} parts taking `pictures` in order) laid
    out as the server does it (the checkpoint's image facts): (expanded ids, their `ImageInput`s,
    the rendered template text)."""
    import hashlib

    from raycluster.model.llava import image_facts
    from raycluster.model.tokenizer import Tokenizer

    tok, facts = Tokenizer(path), image_facts(path)
    text = tok.apply_chat_template([{"role": "user", "content": content}])
    ids, inputs, loaded = [], [], iter([facts.prepare(p) for p in pictures])
    for t in tok.encode(text, add_special_tokens=False):
        if t != facts.image_token_id:
            ids.append(t)
            continue
        px, size, n = next(loaded)
        inputs.append(ImageInput(len(ids), n, px, hashlib.sha256(px.numpy().tobytes()).digest(), size))
        ids.extend([t] * n)
    return ids, inputs, text


def image_sp(images, n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, images=images)


def run_to_end(eng: LLMEngine, rid: str, ids: list[int], sp: SamplingParams) -> Request:
    req = eng.add_request(rid, ids, sp)
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    return req


def check_prefix_hit(model, enc, ids, images, want, whole_images: bool = False, block_size: int = 4) -> None:
    """A first request over the prompt is aborted once its prefill passes the middle of its
    longest image (`whole_images`, whose chunks never end inside an image: its end), its full
    blocks left in the prefix cache; a second one takes them, so its prefill resumes inside that
    image (for whole images, `block_size` must leave the image's last block partial), and ends
    with transformers' tokens."""
    eng = LLMEngine(EngineConfig(**{**BASE, "block_size": block_size}, kv_cache_tokens=512, chunk_size=3,
                                 enable_prefix_caching=True), model, image_encoder=enc)
    image = max(images, key=lambda im: im.length)
    first = eng.add_request("a", ids, image_sp(images))
    for _ in range(500):
        if first.num_computed_tokens >= image.offset + (image.length if whole_images else image.length // 2):
            break
        eng.step()
    eng.abort_request("a")
    req = eng.add_request("b", ids, image_sp(images))
    assert image.offset < req.num_computed_tokens < image.offset + image.length
    for _ in range(500):
        if not eng.has_unfinished():
            break
        eng.step()
    assert req.output_token_ids == want


def check_group(model, enc, ids, images, want, group: dict) -> None:
    eng = LLMEngine(EngineConfig(**BASE, kv_cache_tokens=512, chunk_size=8, **group), model, image_encoder=enc)
    try:
        assert eng.generate([ids], [image_sp(images)]) == [want]
    finally:
        eng.runner.close()
