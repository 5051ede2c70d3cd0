"""Runs one scheduled step of a BERT-style encoder (raycluster.model.bert) in this process.

An encoder step is a batch of whole prompts of pooling requests (the engine schedules encoders
with unchunked prefill, so a prompt never spans steps): their token ids back to back, each
prompt's token types from its `SamplingParams.pair_start` (a cross-encoder's second text is type
1), one forward with bidirectional attention inside each prompt, then each prompt pooled
(raycluster.model.pooling). There is no KV to keep: the KV manager's blocks still count
admissions (the scheduler allocates them) but the cache tensor has no layers.
"""

from __future__ import annotations

import torch

from raycluster.engine.model_runner import ModelRunner, StepLogits, pool_prefills
from raycluster.engine.scheduler import SchedulerOutput
from raycluster.parallel.plan import StepPlan


class EncoderRunner(ModelRunner):
    def kv_bytes_per_token(self) -> int:
        return 0

    def execute(self, out: SchedulerOutput) -> StepLogits:
        if out.decodes:
            raise RuntimeError("an encoder runs no decode steps (it serves pooling requests only)")
        ids, lengths, types = [], [], []
        for req, n in out.prefills:
            if req.num_computed_tokens or n != req.num_prompt_tokens or req.pooling is None:
                raise RuntimeError(f"request {req.request_id!r}: an encoder runs whole prompts of pooling "
                                   f"requests in one step (got {n} of {req.num_prompt_tokens} tokens from "
                                   f"{req.num_computed_tokens})")
            ids.extend(req.prompt_token_ids)
            lengths.append(n)
            start = req.sampling.pair_start
            types.extend([0] * start + [1] * (n - start) if start else [0] * n)
        if not lengths:
            return StepLogits(logits=torch.empty((0, 0)), requests=[])
        dev = self.device
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev), lengths,
                            self._types(torch.tensor(types, dtype=torch.long, device=dev)))
        return StepLogits(logits=torch.empty((0, 0)), requests=[], embeddings=pool_prefills(out.prefills, hidden))

    def _types(self, types: torch.Tensor) -> torch.Tensor:
        # Models with one token type (RoBERTa) read type 0 for both texts, as HF's tokenizers give them.
        return types if self.model.config.encoder.type_vocab_size > 1 else torch.zeros_like(types)

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """A synthetic step of the start-up profile (raycluster.engine.profiler): its prefill
        chunks as prompts of their lengths (history and decodes as if alone: an encoder keeps
        none), cut to the model's length; the rows `plan.sample_rows` of the result."""
        cap = self.model.config.max_model_len
        lengths = []
        for n in list(plan.prefill_lens) + [1] * len(plan.decode_positions):
            lengths += [cap] * (n // cap) + ([n % cap] if n % cap else [])
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device) % self.model.config.vocab_size
        hidden = self.model(ids, lengths)
        return hidden.index_select(0, torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device))
