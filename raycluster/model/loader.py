"""Checkpoint loading: config.json + model.safetensors (or a sharded index) into
LlamaForCausalLM, with strict checks (every parameter loaded, nothing unexpected, shapes match)
and errors that name the offending tensor or file."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from raycluster.model.config import ModelConfig
from raycluster.model.llama import LlamaForCausalLM

# Buffers some exporters save that we recompute ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The safetensors weights are missing, corrupt, or do not fit the config."""


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: invalid index file ({e})") from e
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise CheckpointError(f"shard {fn!r} listed in {index} does not exist")
        return [os.path.join(path, fn) for fn in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _read_tensors(file: str):
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers/data
        raise CheckpointError(f"cannot read safetensors file {file!r}: {e}") from e


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", backend=None) -> tuple[LlamaForCausalLM, ModelConfig]:
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {path!r} has no config.json")
    config = ModelConfig.from_pretrained(path)
    files = _weight_files(path)

    # Build on the meta device so no memory or time is spent on random init.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend=backend)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        for name, tensor in _read_tensors(file):
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy
            p = params.get(name)
            if p is None:
                raise CheckpointError(f"unexpected tensor {name!r} in {os.path.basename(file)}")
            if tuple(tensor.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"shape mismatch for tensor {name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"model expects {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor.to(dtype))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensors in checkpoint: {', '.join(missing[:5])}{more}")
    model.eval()
    model.requires_grad_(False)  # inference only; avoids autograd bookkeeping outside inference_mode
    return model, config
