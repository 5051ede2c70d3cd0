"""Chat requests' videos: a `video_url` part's URL to decoded frames.

A video comes as vLLM's frame list, `data:video/jpeg;base64,<frame>,<frame>,...`: each frame one
base64 image (JPEG, or any format PIL decodes), in order, all of one size. The frames are taken as
given (none sampled; the model's processor, raycluster.model.qwen_vl_video, says how many a video
may hold). Container files (mp4, webm, ...), whether inline, fetched or local, need a video
decoder, which this server does not ship: they are refused with a 400 that says so.

`video_frames(url)` checks the URL and decodes its frames (off the event loop: the caller's),
bounded in encoded bytes and in decoded pixels over the whole video.
"""

from __future__ import annotations

import base64
import binascii

from PIL import Image

from raycluster.model.image_processor import decode_image

MAX_VIDEOS_PER_PROMPT = 2            # default of vLLM's --limit-mm-per-prompt {"video": N} here
MAX_VIDEO_BYTES = 64 * 2 ** 20       # a video's encoded frames, all together
MAX_VIDEO_PIXELS = 128 * 2 ** 20     # a video's decoded pixels, all frames together (~400 MB of RGB)
FRAMES_PREFIX = "data:video/jpeg;base64,"


def video_frames(url: str) -> list[Image.Image]:
    """The frames of a video's URL (module docstring); ValueError for a URL that is not a frame
    list, or frames that do not decode or are too many pixels."""
    if not url.startswith(FRAMES_PREFIX):
        kind = url.split(";", 1)[0].split(",", 1)[0][:40] if url.startswith("data:") else url[:40]
        raise ValueError(f"only frame lists are decoded here ({FRAMES_PREFIX}<frame>,<frame>,... with each frame "
                         f"a base64 image), not {kind!r}: container files (mp4, webm, ...) need a video decoder "
                         "this server lacks")
    payload = url[len(FRAMES_PREFIX):]
    if len(payload) * 3 // 4 > MAX_VIDEO_BYTES:
        raise ValueError(f"more than {MAX_VIDEO_BYTES} bytes of frames")
    frames, pixels = [], 0
    for i, part in enumerate(payload.split(",")):
        try:
            data = base64.b64decode(part, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"frame {i} is not base64") from None
        try:
            frame = decode_image(data, max_pixels=MAX_VIDEO_PIXELS - pixels)
        except ValueError as e:
            raise ValueError(f"frame {i}: {e} (a video holds at most {MAX_VIDEO_PIXELS} pixels over its "
                             "frames)") from None
        pixels += frame.width * frame.height
        frames.append(frame)
    return frames
