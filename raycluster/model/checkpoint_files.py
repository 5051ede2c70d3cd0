"""Which files of a checkpoint directory hold which tensors, and reading them: model.safetensors
or the shards a model.safetensors.index.json maps, with errors (`CheckpointError`) naming the file.
The loader (raycluster.model.loader) and the EAGLE / draft readers go through these."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The safetensors weights are missing, corrupt, or do not fit the config."""


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        files = sorted(set(index_map(index).values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise CheckpointError(f"shard {fn!r} listed in {index} does not exist")
        return [os.path.join(path, fn) for fn in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def file_names(path: str) -> dict[str, set[str]] | None:
    """With an index: the tensor names it maps to each file (full path). A file may hold more
    (an hf_overrides classifier's index leaves out the shared files' lm_head): those are not the
    checkpoint's. None without an index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return None
    out: dict[str, set[str]] = {}
    for name, fn in index_map(index).items():
        out.setdefault(os.path.join(path, fn), set()).add(name)
    return out


def index_map(index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            return json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: invalid index file ({e})") from e


def read_tensors(file: str, names: set[str] | None = None, skip: Callable[[str], bool] | None = None):
    """(name, tensor) of each tensor in `file` (only `names` when given; none `skip` says, unread)."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if (names is None or name in names) and (skip is None or not skip(name)):
                    yield name, f.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers/data
        raise CheckpointError(f"cannot read safetensors file {file!r}: {e}") from e


def stored_names(path: str) -> set[str]:
    """Every tensor name of the checkpoint (the index's map, or the file's header)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        return set(index_map(index))
    names: set[str] = set()
    for file in weight_files(path):
        with open_checkpoint(file) as f:
            names.update(f.keys())
    return names


@contextlib.contextmanager
def open_checkpoint(file: str):
    """safe_open, its errors (corrupt header or data) as CheckpointError naming the file."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers/data
        raise CheckpointError(f"cannot read safetensors file {file!r}: {e}") from e


def read_named(path: str, stored: str) -> torch.Tensor | None:
    """Checkpoint tensor `stored`, from whichever file holds it (None: no file does)."""
    mapped = file_names(path)
    files = [f for f, names in mapped.items() if stored in names] if mapped else weight_files(path)
    for file in files:
        with open_checkpoint(file) as f:
            if stored in f.keys():
                return f.get_tensor(stored)
    return None


def read_prefixed(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor whose name starts with `prefix`, under its name without it (each
    file opened once; no other tensor read)."""
    mapped = file_names(path)
    out = {}
    for file in weight_files(path):
        names = mapped.get(file, set()) if mapped is not None else None
        for name, tensor in read_tensors(file, names, skip=lambda n: not n.startswith(prefix)):
            out[name[len(prefix):]] = tensor
    return out


# The tensors a quantized linear layer is stored as (raycluster.model.quant.formats), in place of `weight`.
_QUANTIZED_PARTS = frozenset({"weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
                              "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv"})


def copy_into(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], where: str, dtype: torch.dtype,
              as_stored: tuple[str, ...] = ()) -> None:
    """Each of `tensors` into the parameter (or buffer) of its name, cast to `dtype` (those named
    in `as_stored` kept as stored); CheckpointError naming the tensor and `where` it comes from
    for a name `params` lacks or a shape that differs."""
    for name, tensor in tensors.items():
        p = params.get(name)
        if p is None and name.rsplit(".", 1)[-1] in _QUANTIZED_PARTS:
            raise CheckpointError(f"{where} is stored quantized ({name!r}); only its text model may be: a "
                                  "quantized tower is not served")
        if p is None:
            raise CheckpointError(f"unexpected tensor {name!r} in {where}")
        if tuple(tensor.shape) != tuple(p.shape):
            raise CheckpointError(f"shape mismatch for tensor {name!r} in {where}: checkpoint {tuple(tensor.shape)}, "
                                  f"expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor if name in as_stored else tensor.to(dtype))


def copy_whole(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], path: str, what: str,
               dtype: torch.dtype) -> None:
    """`copy_into`, and a CheckpointError naming the first of `params` the checkpoint at `path`
    did not give (`what`: which tensors these are, e.g. a vision tower's)."""
    copy_into(params, tensors, f"{path} ({what})", dtype)
    missing = sorted(set(params) - set(tensors))
    if missing:
        more = "..." if len(missing) > 4 else ""
        raise CheckpointError(f"{path!r}: missing {what} tensors {missing[:4]}{more}")



def stored_prefixes(path: str, *wanted: tuple[tuple[str, ...], str]) -> tuple[str | None, ...]:
    """For each (candidate prefixes, a tensor name under them), the first prefix under which the
    checkpoint stores that name (None: none does, or no readable weights): where an image-text
    checkpoint keeps its tower and its projector, whichever layout it was saved in."""
    try:
        names = stored_names(path)
    except CheckpointError:
        return (None,) * len(wanted)
    return tuple(next((p for p in prefixes if p + key in names), None) for prefixes, key in wanted)


def tower_and_projector(found: tuple[str | None, str | None], path: str, tower: str) -> tuple[str, str]:
    """`found`, the (tower, projector) prefixes `stored_prefixes` gave; CheckpointError naming the
    one the checkpoint lacks (`tower`: how the tower is called)."""
    if found[0] is None or found[1] is None:
        missing = tower if found[0] is None else "multi_modal_projector"
        raise CheckpointError(f"{path!r}: the checkpoint stores no {missing} tensors")
    return found


def check_projection(name: str, shape: list[int], width: int, text: int, width_field: str,
                     text_first: bool = True) -> None:
    """ValueError naming the config field a stored projection [text, width] (`text_first`; else
    [width, text]) disagrees with: the tower's `width` (config `width_field`) or the text
    model's hidden size."""
    w, t = (1, 0) if text_first else (0, 1)
    if len(shape) == 2 and shape[w] == width and shape[t] != text:
        field = f"config field 'text_config.hidden_size' = {text}"
    elif len(shape) != 2 or shape[w] != width:
        field = f"config field '{width_field}' = {width}"
    else:
        return
    want = [text, width] if text_first else [width, text]
    raise ValueError(f"{name} is {shape}, not {want}: it does not fit {field}")
