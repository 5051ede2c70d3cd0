"""EAGLE-3's own layout: the target's aux hidden states equal transformers' (the hidden states
entering the named layers); the head through the paged cache, in one chunk or in chunks and
decode rows, equals the formula written out densely from its weights; logits over a draft
vocabulary land on the target ids `d2t` names; the loader reads the original (`midlayer.`) and
vLLM's names and refuses what does not fit, naming it; the training-time-test mask is the one
the drafting passes see. (Drafts and engine output with EAGLE-3 eagle_heads: test_eagle.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_eagle import paged, write_head

from raycluster.model.config import ModelConfigError
from raycluster.model.eagle import load_eagle_head
from raycluster.model.eagle3 import default_aux_layers
from raycluster.model.eagle_train import target_features, ttt_mask
from raycluster.model.loader import CheckpointError


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    half = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos + half * sin


def _reference(head, ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-layer EAGLE-3 head written out densely from its weights: (normed, prenorm)."""
    c, layer = head.config, head.layers[0]
    attn, eps = layer.self_attn, c.rms_norm_eps
    w = {n: p.detach() for n, p in layer.named_parameters()}
    t = len(ids)
    emb = head.embed(torch.tensor(ids)).detach()
    h = _rms(hidden, w["hidden_norm.weight"], eps)
    x = torch.cat((_rms(emb, w["input_layernorm.weight"], eps), h), -1)
    q = (x @ w["self_attn.q_proj.weight"].T).view(t, attn.num_heads, attn.head_dim)
    k = (x @ w["self_attn.k_proj.weight"].T).view(t, attn.num_kv_heads, attn.head_dim)
    v = (x @ w["self_attn.v_proj.weight"].T).view(t, attn.num_kv_heads, attn.head_dim)
    pos = torch.arange(t)
    q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / attn.head_dim ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    x = hidden + o @ w["self_attn.o_proj.weight"].T
    m = _rms(x, w["post_attention_layernorm.weight"], eps)
    x = x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return _rms(x, head.norm.weight.detach(), eps), x


def test_aux_hidden_states_equal_transformers(tiny_model_dir, loaded):
    from transformers import AutoModelForCausalLM

    ids = list(range(40, 90))
    ours = target_features(loaded[0], [ids], aux_layers=(0, 1, 3))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states   # hs[i]: entering layer i
    torch.testing.assert_close(ours, torch.cat((hs[0][0], hs[1][0], hs[3][0]), -1), atol=1e-4, rtol=1e-5)
    assert default_aux_layers(32) == (2, 16, 29)


def test_head_equals_the_dense_formula(eagle_heads, loaded):
    model = loaded[0]
    head = load_eagle_head(eagle_heads["random3"], model, "eagle3")
    assert head.aux_layers == (0, 1, 3) and head.embed_tokens is not None
    ids = list(range(300, 371))
    aux = target_features(model, [list(range(200, 272))], aux_layers=head.aux_layers)[0][:71]
    hidden = head.combine(aux)
    ref = _reference(head, ids, hidden)
    for pieces in ([71], [9, 40, 22], [68, -1, -1, -1]):
        got = paged(head, ids, hidden, pieces)
        torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=1e-5)
    # Logits over the draft vocabulary land on the target ids d2t names; the rest are -inf.
    logits = head.compute_logits(ref[0][:5])
    targets = torch.arange(head.d2t.numel()) + head.d2t
    assert torch.equal(logits[:, targets], head.lm_head(ref[0][:5]))
    rest = torch.ones(model.config.vocab_size, dtype=torch.bool)
    rest[targets] = False
    assert bool((logits[:, rest] == float("-inf")).all())


def test_loader_names_and_errors(eagle_heads, loaded, tmp_path):
    model = loaded[0]
    src = eagle_heads["random3"]
    tensors = load_file(f"{src}/model.safetensors")
    cfg = json.load(open(f"{src}/config.json"))
    assert any(n.startswith("midlayer.") for n in tensors) and "d2t" in tensors       # the original names
    reference = load_eagle_head(src, model, "eagle3")

    def write(name, t=tensors, c=cfg):
        return write_head(tmp_path / name, t, c)

    # vLLM's names: `model.layers.0.*`, and a t2d it ignores; aux ids under eagle_config.
    vllm_names = {("model." + n.replace("midlayer.", "layers.0.")) if n != "lm_head.weight" else n: t
                  for n, t in tensors.items()}
    nested = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    head = load_eagle_head(write("vllm", {**vllm_names, "t2d": torch.zeros(8, dtype=torch.bool)},
                                 {**nested, "architectures": ["Eagle3LlamaForCausalLM"],
                                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}), model, "eagle3")
    assert head.aux_layers == (0, 1, 3)
    for (n, p), (_, q) in zip(head.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), n
    with pytest.raises(CheckpointError, match="needs its d2t mapping"):
        load_eagle_head(write("no_d2t", {n: t for n, t in tensors.items() if n != "d2t"}), model, "eagle3")
    with pytest.raises(ValueError, match="speculative_model: EAGLE-3 aux layers \\[0, 1, 9\\]"):
        load_eagle_head(write("aux", c={**cfg, "eagle_aux_hidden_state_layer_ids": [0, 1, 9]}), model, "eagle3")
    with pytest.raises(ValueError, match="target_hidden_size is 512"):
        load_eagle_head(write("thid", c={**cfg, "target_hidden_size": 512}), model, "eagle3")
    with pytest.raises(CheckpointError, match="shape mismatch for tensor '(lm_head.weight|d2t)' in EAGLE head"):
        load_eagle_head(write("vocab", c={**cfg, "draft_vocab_size": 512}), model, "eagle3")
    with pytest.raises(ModelConfigError, match="HASS"):
        load_eagle_head(write("hass", c={**cfg, "add_para_norm": True}), model, "eagle3")
    # Without aux hidden states the head reads the target's last hidden state: no fc.
    no_aux = load_eagle_head(write("no_aux", {n: t for n, t in tensors.items() if not n.startswith("fc.")},
                                   {**cfg, "eagle_config": {"use_aux_hidden_state": False}}), model, "eagle3")
    assert no_aux.fc is None and no_aux.aux_layers == ()


def test_training_time_test_mask():
    """Step 3 at position i: step 1's keys up to i - 2, step 2's key at i - 1, its own at i --
    what drafting pass 3 attends to at inference."""
    assert ttt_mask(1, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    m = ttt_mask(3, 4).int().tolist()
    assert m == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
                 [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
                 [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                 [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]]
