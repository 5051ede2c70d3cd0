"""Batch-time predictor linear in a few work features (the shape both the CPU profile and a
roofline reduce to).

time = overhead + per_prefill_token * sum(q) + per_attn_pair * sum(q * (kv_before + (q + 1) / 2))
       + per_decode * n_decodes + per_decode_kv * sum(decode_kv) + per_prefill * n_prefills

Decode attention is charged by the KV it reads, sum(decode_kv): paged GPU kernels read exactly
that, and the torch backend groups decodes by KV length so its padding stays near 1.1x.

Built from coefficients (fitted by `raycluster.sched.profile`, or set by hand in tests); the
isolated prefill time of a prompt is a batch with one chunk holding all of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence


def batch_features(prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> list[float]:
    q_sum = float(sum(q for q, _ in prefills))
    attn = float(sum(q * (kv + (q + 1) / 2.0) for q, kv in prefills))
    n_dec = len(decode_kv_lens)
    return [1.0 if (prefills or decode_kv_lens) else 0.0, q_sum, attn,
            float(n_dec), float(sum(decode_kv_lens)), float(len(prefills))]


@dataclass
class LinearBatchPredictor:
    overhead_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_attn_pair_s: float = 0.0
    per_decode_s: float = 0.0
    per_decode_kv_s: float = 0.0
    per_prefill_s: float = 0.0

    def coefficients(self) -> list[float]:
        return [self.overhead_s, self.per_prefill_token_s, self.per_attn_pair_s,
                self.per_decode_s, self.per_decode_kv_s, self.per_prefill_s]

    def batch_time(self, prefills: Sequence[tuple[int, int]], decode_kv_lens: Sequence[int]) -> float:
        return sum(c * f for c, f in zip(self.coefficients(), batch_features(prefills, decode_kv_lens)))

    def prefill_time(self, num_tokens: int, kv_before: int = 0) -> float:
        """Isolated time to prefill `num_tokens` after `kv_before` tokens already in the cache."""
        return self.batch_time([(num_tokens, kv_before)], []) if num_tokens > 0 else 0.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "LinearBatchPredictor":
        return cls(**json.loads(Path(path).read_text()))
