"""Analytic time of an image encoder on a roofline GPU: a ViT tower and its projector, what a step
of an image-text model spends before its text model runs (the simulator's images).

Owns the tower shapes (`VISION`: CLIP ViT-L/14 at 336 pixels under LLaVA-1.5's two-layer MLP
projector, 576 tokens an image; SigLIP-so400m at 896 pixels under Gemma 3's 4 x 4 pooling and
linear projector, 256 tokens) and one formula, in the notation of raycluster.sched.roofline (a
tower of L layers, width w, MLP m, over s patches; its projector from w to the text model's hidden
size h, through a hidden layer of h on LLaVA):
  F_image = 2 s L (4 w^2 + 2 w m) + 4 L w s^2 + 2 t (w h_p + h_p h)    (t tokens; h_p = h, or 0 for one linear)
  W       = b (L (4 w^2 + 2 w m) + w h_p + h_p h)                      weight bytes read per step
  time(n) = max(n F_image / (t_p P_peak MFU), W / (t_p BW_hbm MBU))    n images, t_p tensor-parallel GPUs
The tower attends over all its patches (non-causal: s^2 pairs). Ignored: patch embedding, norms,
the pooling, tp's all-reduces (a few per layer over s w values, small beside the GEMMs).

`VisionCost(gpu, shape, text_hidden, tp, mfu, mbu).time(num_images)` is what the simulator adds to
a step that encodes `num_images` images.
"""

from __future__ import annotations

from dataclasses import dataclass

from raycluster.sched.roofline import GPUSpec


@dataclass(frozen=True)
class VisionShape:
    name: str
    layers: int
    width: int
    mlp: int
    patches: int                # the tower's sequence per image
    tokens: int                 # the text model's placeholders per image
    projector_mlp: bool = True  # LLaVA's two layers (width -> h -> h), else one linear (width -> h)
    dtype_bytes: int = 2

    def _projector(self, text_hidden: int) -> int:
        """The projector's parameters (as in the module docstring's w h_p + h_p h)."""
        return self.width * text_hidden + text_hidden * text_hidden if self.projector_mlp else self.width * text_hidden

    def flops(self, text_hidden: int) -> float:
        """One image's FLOPs (module docstring's F_image)."""
        per_layer = 4 * self.width ** 2 + 2 * self.width * self.mlp
        return (2 * self.patches * self.layers * per_layer + 4 * self.layers * self.width * self.patches ** 2
                + 2 * self.tokens * self._projector(text_hidden))

    def weight_bytes(self, text_hidden: int) -> float:
        per_layer = 4 * self.width ** 2 + 2 * self.width * self.mlp
        return self.dtype_bytes * (self.layers * per_layer + self._projector(text_hidden))


CLIP_L_336 = VisionShape("clip-vit-l-336", layers=24, width=1024, mlp=4096, patches=577, tokens=576)
SIGLIP_896 = VisionShape("siglip-so400m-896", layers=27, width=1152, mlp=4304, patches=4096, tokens=256,
                         projector_mlp=False)
VISION = {v.name: v for v in (CLIP_L_336, SIGLIP_896)}


@dataclass(frozen=True)
class VisionCost:
    gpu: GPUSpec
    shape: VisionShape
    text_hidden: int
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.8

    def time(self, num_images: int) -> float:
        """Seconds to encode `num_images` images in one step (0 for none)."""
        if num_images <= 0:
            return 0.0
        compute = num_images * self.shape.flops(self.text_hidden) / (self.tp * self.gpu.peak_flops * self.mfu)
        weights = self.shape.weight_bytes(self.text_hidden) / (self.tp * self.gpu.hbm_bw * self.mbu)
        return max(compute, weights)
