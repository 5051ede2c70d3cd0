"""What a pooling request's raw output becomes before it leaves the engine: the pooled vector [H]
(or, token-level, the rows [n, H]) from the model runner, through the checkpoint's head.

A decoder sequence classifier: its `score` head [labels, H] (a group's leader holds none: it is read
from the checkpoint, `PoolingHead.for_runner`); a BERT-style classifier: the encoder's own head
(`model.classify`: pooler or dense, then the classifier); an embedding model with
sentence-transformers Dense modules: those (`Projector`); otherwise the vector as pooled.
"""

from __future__ import annotations

import torch


class PoolingHead:
    def __init__(self, model, dtype: torch.dtype, classifier: torch.Tensor | None = None, projector=None) -> None:
        """`classifier` / `projector` default to the model's own (`model.score`, `model.projector`)."""
        mcfg = model.config
        score = getattr(model, "score", None)
        self.classifier = classifier if classifier is not None else score.weight if score is not None else None
        self.encoder_head = model.classify if mcfg.is_encoder and mcfg.labels else None
        if mcfg.labels and self.classifier is None and self.encoder_head is None:
            raise ValueError("a sequence classifier's engine needs its score head (model.score or `classifier`)")
        self.projector = projector if projector is not None else getattr(model, "projector", None)
        if mcfg.pooler.dense and self.projector is None:
            raise ValueError("the checkpoint's Dense modules were not loaded (model.projector or `projector`)")
        self.dtype = dtype

    @classmethod
    def for_runner(cls, runner, path: str, dtype: torch.dtype, device) -> "PoolingHead":
        """The head of the checkpoint at `path` served by `runner`, reading from the checkpoint
        what a group's leader does not hold (a decoder classifier's score, the Dense modules)."""
        model, mcfg = runner.model, runner.model.config
        classifier = projector = None
        if mcfg.labels and not mcfg.is_encoder and getattr(model, "score", None) is None:
            from raycluster.model.loader import load_tensors
            from raycluster.model.tensor_parts import WHOLE
            classifier = load_tensors(path, mcfg, {"score.weight": WHOLE}, dtype, device)["score.weight"]
        if mcfg.pooler.dense and getattr(model, "projector", None) is None:
            from raycluster.model.loader import checkpoint_projector
            projector = checkpoint_projector(path, mcfg, device)
        return cls(model, dtype, classifier, projector)

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        """fp32 [H] or [n, H] in, the output of the same leading shape out."""
        if self.classifier is not None:
            return torch.nn.functional.linear(vector, self.classifier.to(vector.dtype))
        if self.encoder_head is not None:
            rows = vector.to(self.dtype).reshape(-1, vector.shape[-1])
            return self.encoder_head(rows).float().reshape(*vector.shape[:-1], -1)
        if self.projector is not None:
            return self.projector(vector)
        return vector
