"""Qwen-VL's multimodal RoPE (raycluster.model.mrope) against transformers: the (t, h, w)
positions of a prompt with images and the shift after it equal `get_rope_index`'s, whole or by
chunks; the per-frequency choice of stream equals Qwen2-VL's sections and Qwen3-VL's
interleaving; and a plan with such rows gives the model [3, T] positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raycluster.model.mrope import MRopeLayout, MRopeSpec, mrope_cos_sin

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 151655, 151652, 151653


def _hf_positions(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """transformers' Qwen2-VL positions [3, L] and delta for `ids` (grids before the 2x2 merge)."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    cfg = Qwen2VLConfig(text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 152000},
                        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2,
                                       "spatial_merge_size": 2},
                        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    model = Qwen2VLModel(cfg)
    t = torch.tensor([ids])
    types = (t == IMAGE).int()
    pos, delta = model.get_rope_index(t, types, image_grid_thw=torch.tensor(grids))
    return pos[:, 0], int(delta[0, 0])


def _prompt() -> tuple[list[int], MRopeLayout, list[tuple[int, int, int]]]:
    """Text, an image of 2x3 merged patches, text, a 1x1 image, text; and the same as a layout."""
    ids = [10, 11, 12, START] + [IMAGE] * 6 + [END, 13, 14, START] + [IMAGE] + [END, 15, 16, 17]
    layout = MRopeLayout([(4, 6, (1, 2, 3)), (15, 1, (1, 1, 1))])
    return ids, layout, [(1, 4, 6), (1, 2, 2)]


def test_positions_and_delta_equal_transformers():
    ids, layout, grids = _prompt()
    want, delta = _hf_positions(ids, grids)
    assert torch.equal(layout.positions(0, len(ids)).t(), want)
    assert layout.delta == delta == 3 - 6
    # By chunks of any size, from any start.
    for size in (1, 3, 5, 7):
        got = torch.cat([layout.positions(s, min(size, len(ids) - s)) for s in range(0, len(ids), size)])
        assert torch.equal(got.t(), want)
    # A prompt ending with an image: the tokens after it go on from its span.
    ends = MRopeLayout([(2, 6, (1, 3, 2))])
    assert ends.positions(0, 8)[:, 0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2] and ends.delta == 3 - 6
    assert ends.positions(0, 8)[:, 1].tolist() == [0, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("spec", [MRopeSpec((4, 6, 6)), MRopeSpec((6, 5, 5), interleaved=True)])
def test_each_frequency_turns_by_its_stream(spec):
    torch.manual_seed(0)
    d, t = 32, 5
    pos = torch.randint(0, 50, (3, t))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = pos[..., None].float() * inv                       # [3, T, D/2]
    if spec.interleaved:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary
    stub = SimpleNamespace(mrope_section=list(spec.section))
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = mrope_cos_sin(emb.cos(), emb.sin(), spec)
    torch.testing.assert_close(cos, Rotary.recomposition_frequencies(stub, freqs.cos().clone()))
    torch.testing.assert_close(sin, Rotary.recomposition_frequencies(stub, freqs.sin().clone()))
    with pytest.raises(ValueError, match="does not add up"):
        mrope_cos_sin(emb.cos()[..., :8], emb.sin()[..., :8], spec)
