"""Trains an EAGLE-1 head for a target checkpoint by distillation on the target's own greedy
continuations, as EAGLE does: the head sees (feature at j, token at j + 1) and regresses the
target's feature at j + 1 (smooth L1), plus a cross-entropy between the target's output head
on its prediction and the target's own next token (weight `cls_weight`), with teacher forcing
(true features as inputs), causal attention over each sequence, the target frozen.

For checkpoints with no published head -- the tiny one here -- so that EAGLE drafting can be
run and measured (`raycluster bench spec-decode --eagle-steps N`); a real model's head comes
from its authors. Deterministic for a seed on CPU.

    train_eagle_head(target_dir, out_dir, steps=..., ...) -> {"loss_first", "loss_last", "top1"}
    python -m raycluster.model.eagle_train --model tiny|PATH --out DIR [--steps 300] [--seed 0]

Data: `num_sequences` random prompts of 8-48 non-special tokens, each continued greedily by the
target for `gen_tokens` tokens (our own engine), the target's final hidden states taken from one
forward over every sequence. The head is written with `save_eagle_head`.
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
from raycluster.model.loader import load_model
from raycluster.model.rope import apply_rope
from raycluster.parallel.plan import StepPlan, plan_inputs
from raycluster.request import SamplingParams

FIRST_TOKEN = 6         # the tiny tokenizer's special ids are below this


def head_config_dict(target_config: dict, num_layers: int = 1) -> dict:
    """An EAGLE head's config.json: the target's, with the head's depth."""
    return {**target_config, "num_hidden_layers": num_layers, "architectures": ["LlamaForCausalLM"]}


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


def target_features(model, sequences: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """The target's final hidden states [len, H] of each sequence (one prefill per sequence)."""
    blocks = sum(-(-len(s) // block_size) for s in sequences)
    kv = torch.zeros(model.kv_cache_shape(blocks, block_size), dtype=model.model.norm.weight.dtype)
    alloc = BlockAllocator(blocks)
    tables = [alloc.allocate(-(-len(s) // block_size)) for s in sequences]
    plan = StepPlan([t for s in sequences for t in s], [0] * len(sequences), [len(s) for s in sequences],
                    tables, [], [], [])
    input_ids, positions, meta = plan_inputs(plan, block_size)
    hidden = model(input_ids, positions, kv, meta)
    return list(hidden.split([len(s) for s in sequences]))


def train_forward(head: EagleHead, embed, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The head over whole sequences with autograd: next_ids [B, T] (token at j + 1), features
    [B, T, H] (feature at j) -> predicted features at j + 1 [B, T, H]; positions 0..T-1."""
    b, t = next_ids.shape
    x = head.fc(torch.cat((embed(next_ids), features), dim=-1))
    cos, sin = head.rotary.cos_sin(torch.arange(t), x.dtype)
    for layer in head.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x).reshape(b * t, -1)
        q = attn.q_proj(h).view(b * t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(b * t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        q, k = apply_rope(q, k, cos.repeat(b, 1), sin.repeat(b, 1))
        q = q.view(b, t, attn.num_heads, attn.head_dim)
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=attn.scale, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def train_eagle_head(target_dir: str, out_dir: str, steps: int = 300, num_sequences: int = 128,
                     gen_tokens: int = 96, batch_size: int = 16, lr: float = 3e-3, cls_weight: float = 0.1,
                     seed: int = 0, num_layers: int = 1) -> dict:
    torch.manual_seed(seed)
    model, _ = load_model(target_dir)
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg_dict = head_config_dict(json.load(f), num_layers)
    sequences = greedy_sequences(model, num_sequences, gen_tokens, seed)
    features = target_features(model, sequences)
    with torch.no_grad():               # the target's own next token after each position
        labels = [model.compute_logits(f).argmax(dim=-1) for f in features]
    head = EagleHead(ModelConfig.from_dict(cfg_dict), model, model.config.num_hidden_layers)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    embed = model.model.embed_tokens
    lm_weight = (embed.weight if model.config.tie_word_embeddings else model.lm_head.weight).detach()
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
        target = torch.stack([features[i][s + 1:s + 1 + span] for i, s in zip(batch, starts)]).detach()
        label = torch.stack([labels[i][s + 1:s + 1 + span] for i, s in zip(batch, starts)])
        pred = train_forward(head, embed, next_ids, feats)
        logits = F.linear(pred, lm_weight)
        loss = F.smooth_l1_loss(pred, target) + cls_weight * F.cross_entropy(logits.flatten(0, 1), label.flatten())
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
                                description="Train an EAGLE-1 head for a checkpoint on its own greedy output.")
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(train_eagle_head(resolve_model_path(args.model), args.out, args.steps, args.sequences,
                                      seed=args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
