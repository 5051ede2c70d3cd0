"""Image pixels cross the cluster as handles (gateway `share_images` -> router -> instance
`fetch_images`), without Ray: `ClusterClient` -> `RouterCore` -> `InstanceWorker` -> `LLMEngine`
in this process, a dict standing in for Ray's object store. The router only ever holds handles,
the instance fetches each once, the tokens equal one engine's, and a handle that cannot be
fetched fails its request naming the image instead of stopping the worker."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
import torch
from PIL import Image
from switchboard import Switchboard

from raycluster.cluster.client import ClusterClient
from raycluster.cluster.instance import InstanceWorker
from raycluster.cluster.router_core import RouterConfig, RouterCore
from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.outputs import InvalidRequestError
from raycluster.model.image_processor import ImageProcessor
from raycluster.model.llava import image_encoder_for
from raycluster.model.loader import load_model
from raycluster.model.tiny_llava import IMAGE_TOKEN_ID
from raycluster.model.tiny_multimodal import write_tiny_multimodal
from raycluster.request import ImageInput, SamplingParams

CONFIG = dict(policy="fcfs", packer="token", predictor="none", block_size=4, num_threads=1, kv_cache_tokens=2048,
              chunk_size=16)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = write_tiny_multimodal(tmp_path_factory.mktemp("llava"), "LlavaForConditionalGeneration", seed=2,
                                 vision_weights=True)
    model, _ = load_model(path)
    processor = ImageProcessor.from_model_dir(path)
    encoder = image_encoder_for(path)
    rng = np.random.default_rng(0)
    pixels = [processor(Image.fromarray(rng.integers(0, 256, size=(30 + k, 41, 3), dtype=np.uint8))) for k in range(2)]
    n = encoder.tokens_per_image
    ids = [5, 6, 7] + [IMAGE_TOKEN_ID] * n + [8, 9] + [IMAGE_TOKEN_ID] * n + [10]
    images = [ImageInput(3 + k * (n + 2), n, px, hashlib.sha256(px.numpy().tobytes()).digest()) for k, px in
              enumerate(pixels)]
    return path, model, encoder, ids, images


class _Store:
    """Ray's object store, in miniature: put gives a handle, get gives the tensors back."""

    def __init__(self, fail: bool = False) -> None:
        self.objects, self.fetched, self.fail = {}, [], fail

    def put(self, tensor: torch.Tensor) -> str:
        handle = f"obj{len(self.objects)}"
        self.objects[handle] = tensor.clone()
        return handle

    def get(self, handles: list[str]) -> list[torch.Tensor]:
        self.fetched.append(list(handles))
        if self.fail:
            raise KeyError(f"object {handles[0]} was lost")
        return [self.objects[h] for h in handles]


class _Board(Switchboard):
    """The switchboard, also keeping the images of each request the router was given."""

    def __init__(self) -> None:
        super().__init__(lambda rid: RouterCore(RouterConfig(policy="fcfs"), router_id=rid))
        self.router_pixels = []

    async def submit(self, meta):
        self.router_pixels += [im.pixel_values for im in meta.sampling.images]
        return await super().submit(meta)


def _serve(llava, store: _Store, max_tokens: int = 8):
    path, model, encoder, ids, images = llava
    board = _Board()
    engine = LLMEngine(EngineConfig(**CONFIG), model, image_encoder=encoder)
    worker = InstanceWorker(engine, "mixed", "i0", board.poll, board.push, poll_timeout_s=0.05,
                            fetch_images=store.get).start()
    client = ClusterClient(board.submit, board.abort, board.pull, board.status, tokenizer=None, max_model_len=2048,
                           vocab_size=model.config.vocab_size, eos_token_ids=(), pull_timeout_s=0.05,
                           share_images=store.put)

    async def run():
        out = []
        async for o in client.generate("r0", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                 images=images)):
            out += o.new_token_ids
        return out

    try:
        tokens = asyncio.run(asyncio.wait_for(run(), 60))
        board.instance_stats = worker.stats()
        return tokens, board, engine
    finally:
        worker.stop()


def test_the_router_holds_handles_and_the_tokens_equal_one_engines(llava):
    path, model, encoder, ids, images = llava
    store = _Store()
    tokens, board, engine = _serve(llava, store)
    alone = LLMEngine(EngineConfig(**CONFIG), model, image_encoder=encoder)
    want = alone.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, images=images))[0]
    assert tokens == want
    assert board.router_pixels == ["obj0", "obj1"]
    assert store.fetched == [["obj0", "obj1"]]
    # Its encoder cache's counts reach the router (vLLM's mm_cache_queries / mm_cache_hits): two
    # new images.
    stats = board.instance_stats
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 0)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_handle_that_cannot_be_fetched_fails_its_request_naming_the_image(llava):
    with pytest.raises(InvalidRequestError, match="image 0's pixels are not a tensor"):
        _serve(llava, _Store(fail=True))
