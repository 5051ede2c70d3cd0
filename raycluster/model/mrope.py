"""Qwen-VL's multimodal RoPE (M-RoPE): three position streams (time, height, width), each turning
its own section of a head's rotary frequencies.

A text token has the same position in all three streams, so text alone is plain RoPE. An image's
tokens (its grid after the merger: t x h x w, row-major) sit at the position the first of them
would have had as text, plus their (t, h, w) index in the grid; the text after the image goes on
from the largest of those plus one (transformers' `get_rope_index`). A video's temporal index is
its temporal patch's times a step (Qwen2.5-VL: tokens_per_second * seconds per temporal patch,
rounded down; 1 elsewhere). So past an image, a token's position is its index plus a shift, the
image's span (its largest index + 1) less its token count, summed over the images before it.
(transformers 5.24 resumes text at max(h, w) past a video whatever its temporal extent; vLLM and
the models' original code at its largest position + 1, which is followed here: the two agree
unless a video's last temporal index reaches max(h, w).) `MRopeLayout` holds a prompt's images and gives the [n, 3] positions of
any run of its tokens (`positions(start, n)`) and the shift after the prompt (`delta`: a generated
token's position is its index plus delta). `mrope_cos_sin` picks, per rotary frequency, the cos
and sin of its stream: the sections consecutive (Qwen2-VL, Qwen2.5-VL) or interleaved t, h, w
(Qwen3-VL), the same in both halves of the head.

Data enters as (offset, length, grid) per image and as [3, T] positions; leaves as positions
[n, 3] and cos / sin [T, D].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MRopeSpec:
    section: tuple[int, int, int]       # rotary frequencies per stream (t, h, w); they sum to D / 2
    interleaved: bool = False


@functools.lru_cache(maxsize=8)
def _streams(spec: MRopeSpec, dim: int) -> torch.Tensor:
    """The stream (0: t, 1: h, 2: w) of each of a head's `dim` rotary dims."""
    half = dim // 2
    t, h, w = spec.section
    if t + h + w != half:
        raise ValueError(f"mrope_section {list(spec.section)} does not add up to the {half} rotary frequencies")
    if spec.interleaved:      # Qwen3-VL: t, h, w, t, h, w, ... while each stream has frequencies left
        per = [1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0 for j in range(half)]
    else:
        per = [0] * t + [1] * h + [2] * w
    return torch.tensor(per + per, dtype=torch.long)


def mrope_cos_sin(cos3: torch.Tensor, sin3: torch.Tensor, spec: MRopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, D] from each stream's [3, T, D] (the plain tables gathered at its positions)."""
    idx = _streams(spec, cos3.shape[-1]).to(cos3.device).view(1, 1, -1).expand(1, *cos3.shape[1:])
    return cos3.gather(0, idx).squeeze(0), sin3.gather(0, idx).squeeze(0)


@dataclass
class MRopeLayout:
    """A prompt's images (and videos) for M-RoPE: (offset, length, grid (t, h, w)) each, in prompt
    order; `time_steps` their temporal spacing (empty: 1 for every one)."""
    images: list[tuple[int, int, tuple[int, int, int]]]
    time_steps: tuple[float, ...] = ()

    def _steps(self):
        return self.time_steps or (1.0,) * len(self.images)

    @staticmethod
    def _span(grid: tuple[int, int, int], step: float) -> int:
        """Positions an item's grid reaches: its largest (t, h, w) index + 1."""
        t, h, w = grid
        return max(int((t - 1) * step) + 1, h, w)

    @property
    def delta(self) -> int:
        """A position past the last image less its token index."""
        return sum(self._span(grid, s) - length for (_, length, grid), s in zip(self.images, self._steps()))

    def positions(self, start: int, n: int) -> torch.Tensor:
        """The (t, h, w) positions [n, 3] of prompt tokens [start, start + n)."""
        idx = torch.arange(start, start + n, dtype=torch.long)
        out = idx.view(-1, 1).repeat(1, 3)
        shift = 0
        for (offset, length, grid), step in zip(self.images, self._steps()):
            end = offset + length
            if offset < start + n and start < end:          # the run covers some of this image
                t, h, w = grid
                lo, hi = max(start, offset), min(start + n, end)
                local = torch.arange(lo - offset, hi - offset, dtype=torch.long)
                temporal = local // (h * w)
                if step != 1.0:
                    temporal = (temporal.to(torch.float64) * step).long()
                out[lo - start:hi - start] = offset + shift + torch.stack([temporal, local // w % h, local % w], dim=1)
            gap = self._span(grid, step) - length
            shift += gap
            after = max(start, end)                         # text after this image: shifted
            if after < start + n:
                out[after - start:] += gap
        return out
