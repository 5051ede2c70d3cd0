"""Trains an EAGLE head for a target checkpoint by distillation on the target's own greedy
continuations, the target frozen, with teacher forcing (the target's true features as inputs).

EAGLE-1 (`method="eagle"`), as EAGLE does: the head sees (feature at j, token at j + 1) and
regresses the target's final hidden state at j + 1 (smooth L1), plus a cross-entropy between the
target's output head on its prediction and the target's own next token (`cls_weight`).
EAGLE-3 (`method="eagle3"`), as EAGLE-3 does: no feature regression; the head's own output
head is trained by cross-entropy alone, on the fused residual streams of three target layers,
and with training-time test: the head is unrolled `ttt_steps` times, step s feeding at position
j the hidden state step s - 1 gave at j - 1 and attending to the true-feature KV up to j - s + 1
plus its own earlier steps' KV on the diagonal -- what the drafting passes see at inference --
with the losses weighted 0.8^(s - 1).

For checkpoints with no published head -- the tiny one here -- so that EAGLE drafting can be run
and measured (`raycluster bench spec-decode --eagle-steps N`); a real model's head comes from its
authors. Deterministic for a seed on CPU.

    train_eagle_head(target_dir, out_dir, steps=..., method="eagle", ...) -> {"loss_first", "loss_last", "top1"}
    python -m raycluster.model.eagle_train --model tiny|PATH --out DIR [--method eagle3] [--steps 300]

Data: `num_sequences` (default 128; 512 for EAGLE-3, which fits fewer by heart) random prompts of
8-48 non-special tokens, each continued greedily by the target for `gen_tokens` tokens (our own
engine), the target's features taken from one forward over every sequence. The head is written
with `save_eagle_head`.
"""

from __future__ import annotations

import json
import os
import random

import torch
import torch.nn.functional as F

from raycluster.engine.config import EngineConfig
from raycluster.engine.engine import LLMEngine
from raycluster.engine.kv_manager import BlockAllocator
from raycluster.model.config import ModelConfig
from raycluster.model.eagle import EagleHead, save_eagle_head
from raycluster.model.eagle3 import Eagle3Head, default_aux_layers
from raycluster.model.loader import load_model
from raycluster.model.rope import apply_rope
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.request import SamplingParams

FIRST_TOKEN = 6         # the tiny tokenizer's special ids are below this


def head_config_dict(target_config: dict, method: str = "eagle") -> dict:
    """A one-layer head's config.json: the target's, with the head's depth and architecture."""
    arch = "LlamaForCausalLM" if method == "eagle" else "LlamaForCausalLMEagle3"
    return {**target_config, "num_hidden_layers": 1, "architectures": [arch]}


def greedy_sequences(model, num: int, gen_tokens: int, seed: int) -> list[list[int]]:
    """`num` random prompts, each followed by the target's greedy continuation."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    engine = LLMEngine(EngineConfig(policy="fcfs", packer="token", predictor="none",
                                    kv_cache_tokens=max(4096, num * (48 + gen_tokens + 16))), model)
    reqs = [engine.add_request(f"s{i}", [rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(8, 48))],
                               SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True))
            for i in range(num)]
    for _ in range(num * gen_tokens + 10):
        if not engine.has_unfinished():
            break
        engine.step()
    return [r.all_token_ids for r in reqs]


def target_features(model, sequences: list[list[int]], block_size: int = 16,
                    aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The target's features of each sequence (one prefill per sequence): its final hidden
    states [len, H], or with `aux_layers` the residual streams entering them [len, 3 H]."""
    blocks = sum(-(-len(s) // block_size) for s in sequences)
    kv = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=model.model.norm.weight.dtype)
    alloc = BlockAllocator(blocks)
    tables = [alloc.allocate(-(-len(s) // block_size)) for s in sequences]
    plan = StepPlan([t for s in sequences for t in s], [0] * len(sequences), [len(s) for s in sequences],
                    tables, [], [], [])
    input_ids, positions, meta = plan_inputs(plan, block_size)
    hidden = model(input_ids, positions, kv, meta, aux_layers=aux_layers)
    if aux_layers:
        hidden = hidden[1]
    return list(hidden.split([len(s) for s in sequences]))


def _attention(attn, x: torch.Tensor, cos, sin, past: list, mask: torch.Tensor | None):
    """Dense attention of `attn`'s projections for x [B, T, D_in]: queries and keys at positions
    0..T-1 (cos / sin [T, D]), over `past` (k, v) pairs [B, Hkv, T, D] then its own keys, under
    `mask` [T, keys] (None: causal over its own). Returns (output [B, T, H], its k, v)."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b * t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(b * t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, k, cos.repeat(b, 1), sin.repeat(b, 1))
    q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
    values = torch.cat([pv for _, pv in past] + [v], dim=2)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                       scale=attn.scale, enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).reshape(b, t, -1)), k, v


def train_forward(head: EagleHead, embed, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The EAGLE-1 head over whole sequences with autograd: next_ids [B, T] (token at j + 1),
    features [B, T, H] (feature at j) -> predicted features at j + 1 [B, T, H]; positions 0..T-1."""
    x = head.fc(torch.cat((embed(next_ids), features), dim=-1))
    cos, sin = head.rotary.cos_sin(torch.arange(next_ids.shape[1]), x.dtype)
    for layer in head.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, [], None)[0]
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def ttt_mask(step: int, t: int) -> torch.Tensor:
    """Training-time test, unrolled step `step` (1-based) of a one-layer head: query i attends
    to step 1's keys at positions <= i - step + 1 and to step m's key at i - step + m (m = 2..step),
    its own on the diagonal. [t, step * t] booleans; step 1 is plain causal attention."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    blocks = [j <= i - step + 1] + [j == i - step + m for m in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def eagle3_forward(head: Eagle3Head, next_ids: torch.Tensor, hidden: torch.Tensor, past: list,
                   step: int = 1) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One unrolled step of a one-layer EAGLE-3 head over whole sequences with autograd:
    next_ids [B, T], hidden [B, T, H] -> (normed, prenorm, this step's (k, v)) under `ttt_mask`."""
    layer = head.layers[0]
    x, residual = layer.attention_input(head.embed(next_ids), hidden)
    t = next_ids.shape[1]
    cos, sin = head.rotary.cos_sin(torch.arange(t), x.dtype)
    mask = None if step == 1 else ttt_mask(step, t)
    a, k, v = _attention(layer.self_attn, x, cos, sin, past, mask)
    x = residual + a
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.norm(x), x, (k, v)


def _new_head(method: str, cfg_dict: dict, model) -> EagleHead | Eagle3Head:
    cfg = ModelConfig.from_dict({**cfg_dict, "architectures": ["LlamaForCausalLM"]})
    layers = model.config.num_hidden_layers
    if method == "eagle":
        head = EagleHead(cfg, model, layers)
    else:
        head = Eagle3Head(cfg, model, layers, default_aux_layers(layers), cfg.vocab_size)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    if method == "eagle3":              # start from the target's own output head, as EAGLE-3 does
        with torch.no_grad():
            head.lm_head.weight.copy_(_lm_weight(model))
    return head


def _lm_weight(model) -> torch.Tensor:
    return (model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight).detach()


def train_eagle_head(target_dir: str, out_dir: str, steps: int = 300, num_sequences: int | None = None,
                     gen_tokens: int = 96, batch_size: int = 16, lr: float = 3e-3, cls_weight: float = 0.1,
                     seed: int = 0, method: str = "eagle", ttt_steps: int = 3) -> dict:
    torch.manual_seed(seed)
    model, _ = load_model(target_dir)
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg_dict = head_config_dict(json.load(f), method)
    # EAGLE-3's head, trained on tokens alone, fits 128 sequences of the tiny model by heart.
    num_sequences = num_sequences or (128 if method == "eagle" else 512)
    sequences = greedy_sequences(model, num_sequences, gen_tokens, seed)
    finals = target_features(model, sequences)
    with torch.no_grad():               # the target's own next token after each position
        labels = [model.compute_logits(f).argmax(dim=-1) for f in finals]
    head = _new_head(method, cfg_dict, model)
    features = finals if method == "eagle" else target_features(model, sequences, aux_layers=head.aux_layers)
    embed, lm_weight = model.model.embed_tokens, _lm_weight(model)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    span = min(len(s) for s in sequences) - 2       # equal-length windows batch without padding
    losses, top1 = [], 0.0
    for _ in range(steps):
        batch = rng.sample(range(len(sequences)), min(batch_size, len(sequences)))
        starts = [rng.randint(0, len(sequences[i]) - 2 - span) for i in batch]
        next_ids = torch.tensor([sequences[i][s + 1:s + 1 + span] for i, s in zip(batch, starts)])
        feats = torch.stack([features[i][s:s + span] for i, s in zip(batch, starts)]).detach()
        label = torch.stack([labels[i][s + 1:s + 1 + span] for i, s in zip(batch, starts)])
        if method == "eagle":
            target = torch.stack([finals[i][s + 1:s + 1 + span] for i, s in zip(batch, starts)]).detach()
            pred = train_forward(head, embed, next_ids, feats)
            logits = F.linear(pred, lm_weight)
            loss = F.smooth_l1_loss(pred, target) + cls_weight * F.cross_entropy(logits.flatten(0, 1),
                                                                                 label.flatten())
        else:
            loss, hidden, past = 0.0, head.combine(feats), []
            for step in range(1, ttt_steps + 1):
                normed, prenorm, kv = eagle3_forward(head, next_ids, hidden, past, step)
                past.append(kv)
                logits = head.lm_head(normed)
                # Positions before step - 1 have no true context at this depth: no loss there.
                valid = slice(step - 1, None)
                loss = loss + 0.8 ** (step - 1) * F.cross_entropy(logits[:, valid].flatten(0, 1),
                                                                  label[:, valid].flatten())
                if step == 1:
                    top1_logits = logits
                hidden = F.pad(prenorm[:, :-1], (0, 0, 1, 0))      # fed back one position later
            logits = top1_logits
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        top1 = (logits.argmax(dim=-1) == label).float().mean().item()
    save_eagle_head(head, cfg_dict, out_dir)
    return {"loss_first": losses[0], "loss_last": losses[-1], "top1": top1}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from raycluster.model.registry import resolve_model_path
    p = argparse.ArgumentParser(prog="python -m raycluster.model.eagle_train",
                                description="Train an EAGLE head for a checkpoint on its own greedy output.")
    p.add_argument("--model", default="tiny")
    p.add_argument("--method", choices=("eagle", "eagle3"), default="eagle")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sequences", type=int, default=None, help="default 128 (eagle), 512 (eagle3)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(train_eagle_head(resolve_model_path(args.model), args.out, args.steps, args.sequences,
                                      seed=args.seed, method=args.method)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
