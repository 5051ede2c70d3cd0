"""vLLM's `--hf-overrides`: serve a checkpoint with some config.json fields changed, without
touching it, including vLLM's conversion of a causal LM into a sequence classifier that scores with
rows of its output head (`classifier_from_token`: Qwen3-Reranker, mxbai-rerank-v2,
bge-reranker-v2-gemma).

`overridden_checkpoint(path, overrides)` returns a directory that reads as the checkpoint with the
overrides applied: under the cache directory, named by a hash of the source and the overrides,
holding the merged config.json (nested dicts merged key by key, as vLLM updates nested configs)
and a link to every other file of the source. With `classifier_from_token` (token strings, looked
up in the vocabulary like transformers' convert_tokens_to_ids) it also holds `score.safetensors`,
the classifier's head cut from the output head, and a safetensors index that maps the source's
tensors but its `lm_head.weight` and adds `score.weight`:
- `method: from_2_way_softmax` (two tokens, false then true; what `is_original_qwen3_reranker`
  means): one label, score = lm_head[true] - lm_head[false], so sigmoid(score) is the softmax
  probability of the true token between the two;
- `method: no_post_processing` (the default): one label per token, its output-head row.
The directory is written once under a temporary name and renamed into place, so processes that
ask at once (Ray actors on one node) all see a whole one. Errors name the override field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

METHODS = ("from_2_way_softmax", "no_post_processing")


class OverrideError(ValueError):
    """hf_overrides that cannot be applied to the checkpoint."""


def merged(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` applied: a dict value updates a dict key by key, anything else replaces."""
    out = dict(config)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def overridden_checkpoint(path: str | os.PathLike, overrides: dict[str, Any], cache: Path) -> Path:
    """The checkpoint at `path` as `overrides` change it (see the module docstring); `path` itself
    when there are none."""
    src = Path(path).resolve()
    if not overrides:
        return src
    config_file = src / "config.json"
    config = json.loads(config_file.read_text())
    key = hashlib.sha256(json.dumps([str(src), config_file.stat().st_mtime_ns, overrides], sort_keys=True)
                         .encode()).hexdigest()[:16]
    target = cache / f"overrides-{key}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".overrides-", dir=cache))
    try:
        _write(src, merged(config, overrides), tmp)
        try:
            os.rename(tmp, target)
        except OSError:             # another process finished first: use its directory
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write(src: Path, config: dict[str, Any], dst: Path) -> None:
    tokens = config.get("classifier_from_token")
    if config.get("is_original_qwen3_reranker"):
        config.setdefault("method", "from_2_way_softmax")
    # With a score head the index is rewritten (`_score_head`); otherwise it is the source's.
    own = ("config.json", "model.safetensors.index.json") if tokens is not None else ("config.json",)
    for entry in src.iterdir():
        if entry.name not in own:
            (dst / entry.name).symlink_to(entry)
    if tokens is not None:
        config.update(_score_head(src, config, tokens, dst))
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _score_head(src: Path, config: dict[str, Any], tokens, dst: Path) -> dict[str, Any]:
    """Write score.safetensors and the index; the config fields the classifier then has."""
    from raycluster.model.tokenizer import Tokenizer

    method = config.get("method", "no_post_processing")
    if method not in METHODS:
        raise OverrideError(f"hf_overrides.method: {method!r} is not one of {', '.join(METHODS)}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise OverrideError(f"hf_overrides.classifier_from_token: a list of token strings, got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise OverrideError("hf_overrides.classifier_from_token: from_2_way_softmax takes two tokens (false, "
                            f"then true), got {len(tokens)}")
    archs = config.get("architectures") or []
    if not archs or not archs[0].endswith("ForSequenceClassification"):
        raise OverrideError("hf_overrides.architectures: classifier_from_token makes a sequence classifier; "
                            f"name one (e.g. Qwen3ForSequenceClassification), got {archs!r}")
    tok = Tokenizer(src)
    ids = []
    for t in tokens:
        i = tok.token_id(t)
        if i is None:
            raise OverrideError(f"hf_overrides.classifier_from_token: {t!r} is not a token of the vocabulary")
        ids.append(i)
    weight_map = _weight_map(src)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if head not in weight_map:
        raise OverrideError(f"hf_overrides.classifier_from_token: the checkpoint has no {head} to take rows from")
    with safe_open(str(src / weight_map[head]), framework="pt") as f:
        sl = f.get_slice(head)
        rows, dtype = torch.stack([sl[i] for i in ids]).float(), sl.get_dtype()
    score = (rows[1] - rows[0])[None] if method == "from_2_way_softmax" else rows
    store = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
    save_file({"score.weight": score.to(store).contiguous()}, str(dst / "score.safetensors"))
    weight_map = {k: v for k, v in weight_map.items() if k != "lm_head.weight"}
    weight_map["score.weight"] = "score.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    labels = ["true"] if method == "from_2_way_softmax" else list(tokens)
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {name: i for i, name in enumerate(labels)}}


def _weight_map(src: Path) -> dict[str, str]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = src / "model.safetensors"
    if not single.is_file():
        raise OverrideError(f"hf_overrides.classifier_from_token: no safetensors weights in {src}")
    with safe_open(str(single), framework="pt") as f:
        return {name: "model.safetensors" for name in f.keys()}
