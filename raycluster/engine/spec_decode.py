"""Draft tokens for speculative decoding: the proposers and `build_proposer`, which picks one by
the engine config's `speculative_method` (n-gram prompt lookup here, vLLM's `method: ngram`; a
draft model in `raycluster.engine.draft_model`; an EAGLE-1 or EAGLE-3 head in `raycluster.engine.eagle`). Each
answers `observe(out, sampled, accepted)` (the step before the scheduler's update: only EAGLE
reads it), `propose_batch(requests, rooms)` and `forget(request_id)`.

After a step samples a decoding request's token, the engine asks `NgramProposer.propose` for
drafts: the longest suffix of the request's tokens (between `prompt_lookup_max` and
`prompt_lookup_min` tokens long) that also occurs earlier in them, and the tokens that followed
its latest earlier occurrence, at most `k`. They wait on the request (`Request.spec_token_ids`);
the scheduler runs the request's last token and its drafts as one chunk when the step has budget
and KV for them (`SchedulerOutput.spec_tokens`), and `Sampler.verify` keeps the drafts the
model agrees with plus one token of its own. Costs nothing but a lookup when nothing repeats.

Every request may draft. Penalties, logit bias, min_tokens, allowed ids and bad words apply to
row j with the drafts before it counted as output (the engine passes each row its history); a
structured output's row j is masked by its pattern's state after the drafts before it
(`GuidedDecoding.mask_drafts` steps the guide through them and rolls it back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raycluster.engine.config import HEAD_METHODS

from raycluster.request import Request


@dataclass
class SpecDecodeCounts:
    """An engine's speculative decoding so far, as vLLM counts it: verified runs of drafts
    (`drafts`), draft tokens in them, accepted ones, and accepted ones by position in their run
    (`accepted_per_pos[j]`: runs whose draft j + 1 was kept)."""
    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


def build_proposer(config, model, runner, dtype: torch.dtype):
    """The proposer `config` (an EngineConfig) asks for, or None, for the target `model` run by
    `runner`; the draft model must share the target's vocabulary, an EAGLE head fit the target.
    ValueError naming the field otherwise."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    if config.speculative_method not in ("draft_model", *HEAD_METHODS):
        return None
    from raycluster.model.registry import resolve_model_path
    if config.speculative_method in HEAD_METHODS:
        from raycluster.engine.eagle import EagleProposer
        from raycluster.model.eagle import load_eagle_head
        from raycluster.model.mtp import load_mtp_head
        from raycluster.parallel.shard import Checkpoint, GroupModel, load_vocab
        target, target_path = model, str(resolve_model_path(config.model, config.hf_overrides))
        if isinstance(model, GroupModel):
            # A TP group read from its checkpoint: the leader holds only vocab slices of the
            # embedding and head, so the head gets whole copies of them from the checkpoint.
            target = load_vocab(Checkpoint(target_path, model.config), dtype, config.device)
        head = load_mtp_head(target_path, target, dtype, config.device) if config.speculative_method == "mtp" else \
            load_eagle_head(resolve_model_path(config.speculative_model), target, config.speculative_method, dtype,
                            config.device, first_kv_layer=0)
        return EagleProposer(head, runner, config.num_speculative_tokens)
    path = resolve_model_path(config.speculative_model)
    from raycluster.engine.draft_model import DraftModelProposer
    from raycluster.model.loader import load_model
    target_config = model.config
    draft, draft_config = load_model(path, dtype, device=config.device, quant_kernels=config.quant_kernels)
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_model: the draft's vocabulary has {draft_config.vocab_size} tokens, the "
                         f"target's {target_config.vocab_size}; a draft model must share the target's tokenizer")
    tokens = config.speculative_kv_tokens or config.kv_cache_tokens
    return DraftModelProposer(draft, config.num_speculative_tokens, max(1, tokens // config.block_size),
                              config.block_size, config.device, dtype, draft_config.max_model_len,
                              config.max_num_batched_tokens)



class NgramProposer:
    def __init__(self, k: int, max_n: int, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got {min_n}, {max_n}, {k}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose_batch(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        return [self.propose(r.all_token_ids, room) if room > 0 else [] for r, room in zip(requests, rooms)]

    def observe(self, out, sampled: dict[str, int], accepted: dict[str, list[int]]) -> None:
        pass                        # reads the tokens only

    def forget(self, request_id: str) -> None:
        pass                        # keeps nothing per request

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default the proposer's) tokens that followed the latest earlier occurrence
        of the longest matching suffix of `tokens`; [] when no suffix of min_n tokens recurs."""
        k = self.k if k is None else min(k, self.k)
        n = len(tokens)
        if k <= 0 or n <= self.min_n:
            return []
        # Scan the reversed context (list.index runs in C) from the end, over the earlier
        # occurrences of the last token: each one's match length is the run of equal tokens
        # before it. The first of max_n tokens is the answer (longest, and latest of those).
        rev = tokens[::-1]
        last, max_n = rev[0], self.max_n
        best, best_at, r = 0, 0, 0
        while True:
            try:
                r = rev.index(last, r + 1)
            except ValueError:
                break
            limit = min(max_n, n - r)
            m = 1
            while m < limit and rev[r + m] == rev[m]:
                m += 1
            if m > best:
                best, best_at = m, r
                if m == max_n:
                    break
        if best < self.min_n:
            return []
        e = n - best_at             # where the continuation starts in `tokens`
        return tokens[e:e + k]
