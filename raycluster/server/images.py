"""Chat requests' images, from `image_url` content parts to the prompt's `ImageInput`s.

The HTTP server does what vLLM's input processor does before a request reaches an engine:
`load_images` fetches each image part (a `data:` URL, an http(s) URL, bounded in bytes and
time, or a `file:` URL under the directory vLLM's --allowed-local-media-path names), decodes it and runs the checkpoint's image processor (off the event loop), so a bad
image is the client's 400 and never reaches a worker. The chat template then renders each image
as the model's image token: templates that iterate a message's content parts (`takes_parts`,
as llava-hf's do) see `{"type": "image"}` parts in place, other templates see the image token's
text before the message's text, one line each (vLLM's placement). `place_images` expands each
image token of the tokenized prompt to that image's placeholder tokens (a fixed count for
LLaVA-1.5, one that depends on the image's size for LLaVA-NeXT's tiles) and records where each
image's run lies (`ImageInput`), with a digest of its pixels and size for the prefix cache.
`image_spec_for(model_dir, tokenizer)` says whether (and how) a checkpoint takes images.

Videos (`video_url` parts, on Qwen2-VL, Qwen2.5-VL and LLaVA-OneVision) go the same way beside the images, in the
order the messages give them: their frames decoded (raycluster.server.videos), processed by the
checkpoint's video processor, rendered as the video token (a `{"type": "video"}` part), expanded to
the video's placeholders; an `ImageInput` whose size is (frames, height, width).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import NamedTuple

import httpx
import torch

from raycluster.engine.outputs import InvalidRequestError
from raycluster.model.image_processor import decode_image
from raycluster.model.llava import ImageFacts, image_facts
from raycluster.model.qwen_vl_processor import QwenVLGrid
from raycluster.request import ImageInput
from raycluster.server.embeds import decode_embeds
from raycluster.server.videos import MAX_VIDEOS_PER_PROMPT, video_frames

class Loaded(NamedTuple):
    """One image, video or image's given embeddings of a request, ready to place: its pixels (or
    embeddings), its size ((height, width); a video's (frames, height, width); given embeddings:
    the size their grid stands for on Qwen-VL, else (0, 0)), its placeholder tokens."""
    pixels: torch.Tensor
    size: tuple
    tokens: int
    embeds: bool = False


MAX_IMAGES_PER_PROMPT = 16           # default of vLLM's --limit-mm-per-prompt {"image": N} here
MAX_IMAGE_BYTES = 20 * 2 ** 20       # an image's encoded bytes, fetched or inline
FETCH_TIMEOUT_S = 10.0               # vLLM's VLLM_IMAGE_FETCH_TIMEOUT is 5 s; a slow origin gets 10


@dataclass
class ImageSpec:
    """How a checkpoint takes images: its image token's id; the text a template without content
    parts gets for an image (the token's, within Qwen-VL's vision start and end tokens; Gemma 3's
    start-of-image token); and `facts.prepare(image)`: the processed pixels, the image's size and
    its placeholder tokens (raycluster.model.llava).

    `wrap` (Gemma 3): the image's marker is expanded in the prompt's text, before tokenizing, to
    wrap[0] + the placeholder token's text once per placeholder + wrap[1], as transformers'
    processor does (its newlines then merge with the template's as the tokenizer sees them);
    `placeholder_text` is that token's text. None: the marker is one image token, expanded
    after tokenizing."""
    token_id: int
    token_text: str
    facts: ImageFacts
    wrap: tuple[str, str] | None = None
    placeholder_text: str | None = None
    # Videos (Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision): their token, and its text (Qwen-VL: between
    # the vision start / end tokens).
    video_token_id: int | None = None
    video_text: str | None = None

    def expand_text(self, prompt: str, loaded: list[Loaded | tuple]) -> str:
        """`prompt` with its k-th image marker expanded for the k-th image (`wrap`); unchanged
        without `wrap`. InvalidRequestError when the markers are not one per image."""
        if self.wrap is None:
            return prompt
        loaded = [item if isinstance(item, Loaded) else Loaded(*item) for item in loaded]
        pieces = prompt.split(self.token_text)
        if len(pieces) - 1 != len(loaded):
            raise InvalidRequestError("messages", f"the prompt holds {len(pieces) - 1} image markers "
                                      f"({self.token_text!r}) for {len(loaded)} images")
        out = [pieces[0]]
        for piece, item in zip(pieces[1:], loaded):
            out += [self.wrap[0], self.placeholder_text * item.tokens, self.wrap[1], piece]
        return "".join(out)


def image_spec_for(model_dir, tokenizer) -> ImageSpec | None:
    """The spec of a checkpoint that can encode images (raycluster.model.llava), else None."""
    facts = image_facts(model_dir)
    if facts is None or facts.processor is None:
        return None
    text = tokenizer.id_to_token(facts.image_token_id)
    if text is None:
        raise ValueError(f"{model_dir}: the image token id {facts.image_token_id} is not in the tokenizer's vocabulary")
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if facts.wrap_ids is not None:
        # Gemma 3: "<start_of_image>" marks an image; its processor's text around the placeholders.
        boi, eoi = (tokenizer.id_to_token(i) for i in facts.wrap_ids)
        if boi is None or eoi is None:
            raise ValueError(f"{model_dir}: the start / end of image token ids are not in the tokenizer's vocabulary")
        return ImageSpec(facts.image_token_id, boi, facts, wrap=(f"\n\n{boi}", f"{eoi}\n\n"), placeholder_text=text)
    # Qwen-VL's placeholder is the image token between its vision start and end tokens.
    around = [tokenizer.id_to_token(config.get(k)) if isinstance(config.get(k), int) else None
              for k in ("vision_start_token_id", "vision_end_token_id")]
    video_text = tokenizer.id_to_token(facts.video_token_id) if facts.video_token_id is not None else None
    if None not in around:
        text = around[0] + text + around[1]
        video_text = None if video_text is None else around[0] + video_text + around[1]
    return ImageSpec(facts.image_token_id, text, facts, video_token_id=facts.video_token_id if video_text else None,
                     video_text=video_text)


_PARTS_LOOP = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


@functools.lru_cache(maxsize=8)
def takes_parts(template: str | None) -> bool:
    """Whether a chat template iterates a message's content parts (vLLM's "openai" content
    format) rather than reading it as one string."""
    return bool(template) and _PARTS_LOOP.search(template) is not None


def template_content(message, parts: bool, image_text: str | None, video_text: str | None = None):
    """A message's content as the template reads it: a list of text, image and video parts
    (`parts`), else a string with one line of the image's (video's) token text per image (video),
    in order, before the text."""
    if parts:
        if isinstance(message.content, str) or message.content is None:
            return [{"type": "text", "text": message.text()}]
        kinds = {"image_url": "image", "video_url": "video", "image_embeds": "image"}
        return [{"type": "text", "text": p.text} if p.type == "text" else {"type": kinds[p.type]}
                for p in message.content]
    media = message.media()
    if not media:
        return message.text()
    return "\n".join([video_text if kind == "video" else image_text for kind, _ in media] + [message.text()])


async def load_images(messages, spec: ImageSpec | None, limit: int = MAX_IMAGES_PER_PROMPT,
                      client: httpx.AsyncClient | None = None, local_root: str | None = None,
                      video_limit: int = MAX_VIDEOS_PER_PROMPT, embeds: bool = False) -> list[Loaded]:
    """(pixels, size, placeholder tokens) of the messages' image and video parts, in order (an
    image's size (height, width), a video's (frames, height, width)); InvalidRequestError for what
    the client got wrong (no images or videos on this model, more than `limit` images or
    `video_limit` videos, a URL, image or video that does not load). `local_root` (vLLM's
    --allowed-local-media-path): file:// image URLs under that directory are read too (None: refused).
    `embeds` (vLLM's --enable-mm-embeds): image_embeds parts are taken (raycluster.server.embeds),
    each counted as an image."""
    media = [(kind, u if kind == "image_embeds" else u.url) for m in messages for kind, u in m.media()]
    if not media:
        return []
    if spec is None:
        raise InvalidRequestError("messages", "this model takes no images (image_url parts need an image-text "
                                  "checkpoint whose vision tower is served)")
    if not embeds and any(kind == "image_embeds" for kind, _ in media):
        raise InvalidRequestError("messages", "image_embeds parts are not taken by this server (vLLM's "
                                  "--enable-mm-embeds; only for trusted clients)")
    urls = [url for kind, url in media if kind == "image"]
    videos = [url for kind, url in media if kind == "video"]
    if videos and spec.video_token_id is None:
        raise InvalidRequestError("messages", "this model takes no videos (video_url parts need Qwen2-VL, Qwen2.5-VL "
                                  "or LLaVA-OneVision)")
    images = len(media) - len(videos)
    for n, most, what in ((images, limit, "images"), (len(videos), video_limit, "videos")):
        if n > most:
            raise InvalidRequestError("messages", f"{n} {what}; this server takes at most {most} per request "
                                      "(limit_mm_per_prompt)")
    datas = iter(await asyncio.gather(*(_image_bytes(u, k, client, local_root) for k, u in enumerate(urls))))
    return await asyncio.to_thread(_preprocess, [(kind, next(datas) if kind == "image" else url)
                                                 for kind, url in media], spec.facts)


def _preprocess(items: list[tuple[str, bytes | str]], facts: ImageFacts) -> list[Loaded]:
    """Each image's bytes, video's URL or embeddings' payload, processed, in order."""
    out, counts = [], {"image": 0, "video": 0, "image_embeds": 0}
    for kind, data in items:
        k = counts[kind]
        counts[kind] += 1
        try:
            if kind == "image_embeds":
                e, grid = decode_embeds(data)
                out.append(Loaded(e, embeds_size(grid, facts), e.shape[0], embeds=True))
            else:
                out.append(Loaded(*(facts.prepare(decode_image(data)) if kind == "image" else
                                    facts.prepare_video(video_frames(data)))))
        except ValueError as e:
            raise InvalidRequestError("messages", f"{kind} {k}: {e}") from None
    return out


async def _image_bytes(url: str, k: int, client: httpx.AsyncClient | None, local_root: str | None = None) -> bytes:
    if url.startswith("file:"):
        return await asyncio.to_thread(_local_file, url, k, local_root)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise InvalidRequestError("messages", f"image {k}: a data URL must be data:<type>;base64,<data>")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("messages", f"image {k}: the data URL's payload is not base64") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise InvalidRequestError("messages", f"image {k}: {len(data)} bytes; at most {MAX_IMAGE_BYTES}")
        return data
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError("messages", f"image {k}: the URL must be http(s)://, data: or file:, got {url[:40]!r}")
    try:
        if client is not None:
            return await _fetch(client, url, k)
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True) as own:
            return await _fetch(own, url, k)
    except httpx.HTTPError as e:
        raise InvalidRequestError("messages", f"image {k}: cannot fetch {url[:200]}: {e!r}") from None


def _local_file(url: str, k: int, local_root: str | None) -> bytes:
    """The bytes of a file:// image under `local_root` (its real path: no way out by `..` or a link)."""
    if local_root is None:
        raise InvalidRequestError("messages", f"image {k}: file: URLs are not served (the server's "
                                  "--allowed-local-media-path names a directory they may read)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError("messages", f"image {k}: a file: URL names no host, got {parsed.netloc!r}")
    root = os.path.realpath(local_root)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise InvalidRequestError("messages", f"image {k}: {parsed.path} is outside the allowed local media path")
    try:
        size = os.path.getsize(path)
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequestError("messages", f"image {k}: {size} bytes; at most {MAX_IMAGE_BYTES}")
        with open(path, "rb") as f:
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise InvalidRequestError("messages", f"image {k}: cannot read {parsed.path}: {e.strerror}") from None


async def _fetch(client: httpx.AsyncClient, url: str, k: int) -> bytes:
    async with asyncio.timeout(FETCH_TIMEOUT_S):
        async with client.stream("GET", url) as r:
            if r.status_code != 200:
                raise InvalidRequestError("messages", f"image {k}: {url[:200]} answered HTTP {r.status_code}")
            chunks, size = [], 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise InvalidRequestError("messages", f"image {k}: more than {MAX_IMAGE_BYTES} bytes at {url[:200]}")
                chunks.append(chunk)
    return b"".join(chunks)


def place_images(ids: list[int], loaded: list[Loaded | tuple], spec: ImageSpec
                 ) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image token expanded to that image's placeholder tokens, and the
    images (`load_images`' output, or (pixels, size, tokens) tuples) laid on those runs in order. InvalidRequestError when the
    template placed another number of image tokens than there are images."""
    loaded = [item if isinstance(item, Loaded) else Loaded(*item) for item in loaded]
    if spec.wrap is not None:
        return _place_on_runs(ids, loaded, spec)
    marks = {spec.token_id, spec.video_token_id}
    at = [i for i, t in enumerate(ids) if t in marks]
    kinds = [ids[i] == spec.token_id for i in at]
    videos = [len(item.size) == 3 for item in loaded]
    if kinds != [not v for v in videos]:
        raise InvalidRequestError("messages", f"the prompt holds {sum(kinds)} image tokens ({spec.token_text!r}) and "
                                  f"{len(kinds) - sum(kinds)} video tokens, in another order than its "
                                  f"{len(videos) - sum(videos)} images and {sum(videos)} videos")
    if not loaded:
        return ids, []
    out: list[int] = []
    images: list[ImageInput] = []
    last = 0
    for pos, item in zip(at, loaded):
        out.extend(ids[last:pos])
        images.append(_input(len(out), item))
        out.extend([spec.token_id] * item.tokens if item.embeds else spec.facts.span_ids(item.size))
        last = pos + 1
    out.extend(ids[last:])
    return out, images


def _place_on_runs(ids: list[int], loaded, spec: ImageSpec) -> tuple[list[int], list[ImageInput]]:
    """The images on the runs of placeholder tokens a text expansion (`ImageSpec.expand_text`) left."""
    runs: list[list[int]] = []
    for i, t in enumerate(ids):
        if t == spec.token_id:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
    if [b - a for a, b in runs] != [item.tokens for item in loaded]:
        raise InvalidRequestError("messages", f"the prompt holds runs of {[b - a for a, b in runs]} image tokens "
                                  f"({spec.placeholder_text!r}) for images of {[item.tokens for item in loaded]}")
    return ids, [_input(a, item) for (a, _), item in zip(runs, loaded)]


def _input(offset: int, item: Loaded) -> ImageInput:
    """The `ImageInput` of a loaded image, video or image's given embeddings."""
    digest = image_digest(item.pixels, (*item.size, "embeds") if item.embeds else item.size)
    return ImageInput(offset=offset, length=item.tokens, pixel_values=item.pixels, digest=digest, size=item.size,
                      embeds=item.embeds)


def embeds_size(grid: tuple[int, int, int] | None, facts: ImageFacts) -> tuple[int, int]:
    """The image size given embeddings stand for: on Qwen-VL the size whose patch grid is `grid`
    (its rotary layout comes from it), else (0, 0). ValueError for a grid the model does not lay
    images on."""
    if grid is None:
        return (0, 0)
    if not isinstance(facts.grid, QwenVLGrid):
        raise ValueError("image_grid_thw is Qwen-VL's; this model takes the embeddings tensor alone")
    t, h, w = grid
    if t != 1:
        raise ValueError(f"image_grid_thw {list(grid)}: an image's temporal grid is 1 (video embeddings are not served)")
    return h * facts.grid.patch_size, w * facts.grid.patch_size


def image_digest(pixels: torch.Tensor, size: tuple[int, int]) -> bytes:
    """The prefix cache's key of an image: its pixels and size."""
    return hashlib.sha256(repr(size).encode() + pixels.contiguous().numpy().tobytes()).digest()


def image_limit(limit_mm_per_prompt: dict[str, int] | None, kind: str = "image") -> int:
    """Images (`kind` "video": videos) a request may carry under vLLM's `limit_mm_per_prompt`
    ({"image": N, "video": M}; None or a kind left out: the default)."""
    default = MAX_IMAGES_PER_PROMPT if kind == "image" else MAX_VIDEOS_PER_PROMPT
    if not limit_mm_per_prompt:
        return default
    unknown = sorted(set(limit_mm_per_prompt) - {"image", "video"})
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: only 'image' and 'video' are served here, not {', '.join(unknown)}")
    for key, n in limit_mm_per_prompt.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt: {key!r} must be a count >= 0, got {n!r}")
    return limit_mm_per_prompt.get(kind, default)
