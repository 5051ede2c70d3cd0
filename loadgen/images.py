"""Synthetic pictures for load on image-text models: each request carries `per_request` images
as data URLs in a chat message (the client then posts /v1/chat/completions), and `videos` videos
of `frames` such pictures each, as vLLM's frame lists (data:video/jpeg;base64,<frame>,...).

`synthetic_jpeg(width, height, seed)` draws smooth gradients with noise (it compresses like a
photo, not like noise). `ImagePool` holds `distinct` such images, made on first use, and gives a
request its images by a hash of its id, so a trace picks the same pictures in every run and a
small pool repeats pictures (what a prefix cache keyed on the pixels can reuse).
"""

from __future__ import annotations

import base64
import io
import zlib
from dataclasses import dataclass

import numpy as np


def synthetic_jpeg(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 1, size=3)
    base = np.stack([(x / width + phase[0]) % 1 * 255, (y / height + phase[1]) % 1 * 255,
                     ((x + y) / (width + height) + phase[2]) % 1 * 255], axis=-1)
    img = np.clip(base + rng.normal(0, 12, size=base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@dataclass(frozen=True)
class ImageLoad:
    per_request: int = 0                  # images in each request's message (0: text requests)
    width: int = 640
    height: int = 480
    distinct: int = 64                    # pictures in the pool the requests draw from
    videos: int = 0                       # videos in each request's message
    frames: int = 8                       # pictures in each video


class ImagePool:
    def __init__(self, load: ImageLoad, seed: int = 0) -> None:
        if load.per_request < 0 or load.distinct < 1 or min(load.width, load.height) < 1 or load.videos < 0 \
                or load.frames < 1:
            raise ValueError(f"images: per_request >= 0, distinct >= 1, a positive size, videos >= 0 and frames "
                             f">= 1 needed, got {load}")
        self.load, self.seed = load, seed
        self._urls: dict[int, str] = {}
        self._videos: dict[int, str] = {}

    def _url(self, i: int) -> str:
        if i not in self._urls:
            data = synthetic_jpeg(self.load.width, self.load.height, self.seed * 100_003 + i)
            self._urls[i] = "data:image/jpeg;base64," + base64.b64encode(data).decode()
        return self._urls[i]

    def urls_for(self, request_id: str) -> list[str]:
        return [self._url(i) for i in image_indices(request_id, self.load.per_request, self.load.distinct)]

    def _video(self, i: int) -> str:
        if i not in self._videos:
            first = (self.seed * 100_003 + i) * 1_009 + 500_000_000      # frames apart from the pictures
            frames = [synthetic_jpeg(self.load.width, self.load.height, first + f) for f in range(self.load.frames)]
            self._videos[i] = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
        return self._videos[i]

    def video_urls_for(self, request_id: str) -> list[str]:
        """The request's videos, from the pool of `distinct` by the same rule as its pictures."""
        return [self._video(i) for i in image_indices(request_id + "#video", self.load.videos, self.load.distinct)]


def image_indices(request_id: str, per_request: int, distinct: int) -> list[int]:
    """The pool indices of a request's pictures: consecutive from a hash of its id (the simulator
    draws its requests' pictures by the same rule, raycluster.sim.images)."""
    first = zlib.crc32(request_id.encode())
    return [(first + j) % distinct for j in range(per_request)]
