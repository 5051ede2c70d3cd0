"""Checkpoint loading: config.json + model.safetensors (or a sharded index) into
LlamaForCausalLM (or, for a BERT-style checkpoint, BertEncoderModel: `build_model`), with strict checks (every parameter loaded, nothing unexpected, shapes match)
and errors that name the offending tensor or file.

`load_model` builds the whole model (one process serves it). `load_tensors` reads just the
tensors a caller names, each whole or a part of it (raycluster.model.tensor_parts: a chunk along
one dim, a range of rows padded with zeros, a chunk of each half), read from the file with
`safe_open(...).get_slice`, so the rest of the tensor is never read:
a tensor-parallel or pipeline rank loads only its shard this way (raycluster.parallel.shard).
Both check every checkpoint name against the model the config describes and every shape
against the full tensor's. gpt-oss's MXFP4 expert weights (a blocks and a scales tensor each,
raycluster.model.quant.mxfp4) are read whole after the rest, dequantized, then cut. Which file
holds which tensor: raycluster.model.checkpoint_files."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import torch

from raycluster.model.bert import BertEncoderModel
from raycluster.model.checkpoint_files import (CheckpointError, file_names, open_checkpoint, read_named, read_tensors,
                                               stored_names, weight_files)
from raycluster.model.config import ModelConfig
from raycluster.model.llama import LlamaForCausalLM
from raycluster.model.quant.linear import Kernels, finalize_quantized
from raycluster.model.quant.mxfp4 import packed_param, read_packed
from raycluster.model.tensor_parts import TensorPart

# Buffers some exporters save that we recompute ourselves.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An encoder checkpoint's tensors that serve nothing here: position / token-type id buffers, and
# the pretraining heads of BERT (`cls.*`: masked LM, next sentence), RoBERTa (`lm_head.*`) and
# ModernBERT (`decoder.*`).
_ENCODER_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")
_ENCODER_HEADS = ("cls.", "lm_head.", "decoder.")


def build_model(config: ModelConfig, backend=None):
    """The module `config` describes (uninitialised weights): a decoder or a BERT-style encoder."""
    if not config.is_encoder:
        return LlamaForCausalLM(config, backend=backend)
    if config.encoder.family == "modernbert":
        from raycluster.model.modernbert import ModernBertEncoderModel
        return ModernBertEncoderModel(config)
    return BertEncoderModel(config)


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The checkpoint's ModelConfig, with what its tensor names say (`bare_names`,
    `has_lm_head`: `checkpoint_layout`)."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {path!r} has no config.json")
    return checkpoint_layout(ModelConfig.from_pretrained(path), path)


def checkpoint_layout(config: ModelConfig, path: str) -> ModelConfig:
    """`config` with the layout of the tensors in `path`: stored without the "model." prefix
    (a base model's save: `bare_names`), and then without an output head unless it stores one or
    ties it to the embedding (`has_lm_head` False: a pooling-only model); an image-text
    checkpoint's text model under `text_prefix`. A directory without weights keeps `config` as it
    is (loading it fails later, naming what is missing)."""
    if config.is_encoder:       # its names map both ways by `_param_name`
        return config
    try:
        names = stored_names(path)
    except CheckpointError:
        return config
    if config.multimodal is not None:       # the text model's prefix in an image-text checkpoint
        prefix = next((p for p in _TEXT_PREFIXES if any(n.startswith(p) for n in names)), "")
        return dataclasses.replace(config, text_prefix=prefix)
    bare = bool(names) and not any(n.startswith("model.") for n in names) and \
        any(n.startswith("layers.") for n in names)
    if not bare:
        return config
    head = config.has_lm_head and (config.tie_word_embeddings or "lm_head.weight" in names)
    return dataclasses.replace(config, bare_names=True, has_lm_head=head)


# Where an image-text checkpoint keeps its text model: the released files' `language_model.model.*`
# and `language_model.lm_head.*`, transformers 5's `model.language_model.*` (its head `lm_head.*`);
# neither: plain names (the released Qwen-VL files, their tower under `visual.`).
_TEXT_PREFIXES = ("language_model.", "model.language_model.")


def _param_name(stored: str, config: ModelConfig) -> str:
    """The model's parameter name for a checkpoint tensor name."""
    if config.is_encoder:
        prefix = config.encoder.checkpoint_prefix
        return stored[len(prefix):] if stored.startswith(prefix) else stored
    if config.text_prefix and stored.startswith(config.text_prefix):
        rest = stored[len(config.text_prefix):]
        return rest if config.text_prefix == "language_model." else "model." + rest
    return "model." + stored if config.bare_names and not stored.startswith(("lm_head.", "score.")) else stored


def _stored_name(param: str, config: ModelConfig) -> str:
    """The checkpoint's tensor name for a model parameter name."""
    if config.text_prefix == "language_model.":
        return config.text_prefix + param
    if config.text_prefix and param.startswith("model."):
        return config.text_prefix + param[len("model."):]
    return param[len("model."):] if config.bare_names and param.startswith("model.") else param


def _foreign(stored: str, config: ModelConfig) -> bool:
    """An image-text checkpoint's tensor outside its text model (the vision tower, the
    projector): never read. Without a text prefix (the released Qwen-VL files) the text model
    is the plain `model.` and `lm_head.` beside them."""
    if config.multimodal is None:
        return False
    if config.text_prefix == "language_model.":
        return not stored.startswith(config.text_prefix)
    return not stored.startswith((config.text_prefix or "model.", "lm_head."))


def fused_pieces(name: str, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """A fused checkpoint tensor's pieces (Phi-3's `qkv_proj` = q, k, v rows; `gate_up_proj` =
    gate, up rows), as (parameter name, first row, rows); None for any other tensor."""
    c = config
    if name.endswith(".self_attn.qkv_proj.weight") and "qkv_proj" in c.fused_projections:
        base = name[:-len("qkv_proj.weight")]
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return [(base + "q_proj.weight", 0, q), (base + "k_proj.weight", q, kv), (base + "v_proj.weight", q + kv, kv)]
    if name.endswith(".mlp.gate_up_proj.weight") and "gate_up_proj" in c.fused_projections:
        base, i = name[:-len("gate_up_proj.weight")], c.intermediate_size
        return [(base + "gate_proj.weight", 0, i), (base + "up_proj.weight", i, i)]
    return None


# The fused tensor each split projection of a Phi-3 layer is read from.
_FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _source(param: str, config: ModelConfig) -> tuple[str, int | None]:
    """(checkpoint tensor name, first row) a parameter is read from: its rows of a fused tensor,
    or (first row None) a tensor of its own."""
    parent, _, leaf = param.removesuffix(".weight").rpartition(".")
    if param.endswith(".weight") and _FUSED_INTO.get(leaf) in config.fused_projections:
        whole = f"{parent}.{_FUSED_INTO[leaf]}.weight"
        first = next(off for n, off, _ in fused_pieces(whole, config) if n == param)
        return _stored_name(whole, config), first
    return _stored_name(param, config), None


class _Rows:
    """Rows [first, first + n) of a safetensors slice handle, indexed as the handle is."""

    def __init__(self, handle, first: int, n: int) -> None:
        self.handle, self.first, self.n = handle, first, n

    def __getitem__(self, index):
        head, rest = (index[0], tuple(index[1:])) if isinstance(index, tuple) else (index, ())
        lo, hi, _ = head.indices(self.n)
        return self.handle[(slice(self.first + lo, self.first + hi),) + rest]


def _skipped(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors we never load: recomputed buffers, and the copy of a tied head some
    tied checkpoints still store; an encoder's pretraining heads and id buffers, and the pooler of
    one that does not classify (embeddings pool the final hidden states, not the pooler's output);
    the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 store after their decoder layers
    (`num_nextn_predict_layers`: vLLM too skips them unless it drafts with them)."""
    if _mtp_layer(name, config):
        return True
    if config.is_encoder:
        enc = config.encoder
        return name in _ENCODER_IGNORED or name.startswith(_ENCODER_HEADS) or (
            name.startswith("pooler.") and enc.head != "bert") or (
            # ModernBERT's masked-LM head (its prediction head shares the classifiers' name)
            name.startswith("head.") and enc.family == "modernbert" and not enc.head)
    return name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings)


def _mtp_layer(name: str, config: ModelConfig) -> bool:
    extra = config.raw.get("num_nextn_predict_layers") or 0
    if not extra or not name.startswith("model.layers."):
        return False
    index = name.split(".", 3)[2]
    return index.isdigit() and config.num_hidden_layers <= int(index) < config.num_hidden_layers + extra


def _unexpected(name: str, file: str, config: ModelConfig) -> CheckpointError:
    if config.quant is not None and name.startswith("lm_head.") and name != "lm_head.weight":
        return CheckpointError(f"{os.path.basename(file)} stores the output head quantized ({name!r}); "
                               "a quantized lm_head is not supported")
    return CheckpointError(f"unexpected tensor {name!r} in {os.path.basename(file)}")


def _same_shape(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal shapes; a one-element scale may be stored as a scalar or as [1]."""
    return stored == expected or (expected == (1,) and stored in ((), (1, 1)))


def _checked_value(name: str, tensor: torch.Tensor, expected_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as its parameter holds it: integer tensors (a quantized layer's packed
    weights, zero points, group indices) as stored, float ones (FP8 weights included: their
    values are exact in every float dtype) cast to `dtype`."""
    if expected_dtype.is_floating_point:
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor {name!r} is {tensor.dtype}, the model expects floating point")
        return tensor.to(dtype)
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise CheckpointError(f"tensor {name!r} is {tensor.dtype}, the model expects integers ({expected_dtype})")
    return tensor


def _check_fused(name: str, file: str, config: ModelConfig, shape: tuple[int, ...], pieces,
                 shapes: dict[str, tuple[int, ...]]) -> None:
    """A fused tensor's pieces are the model's, and it holds exactly their rows, as wide as they are."""
    if any(p not in shapes for p, _, _ in pieces):
        raise _unexpected(name, file, config)
    want = (sum(n for _, _, n in pieces),) + tuple(shapes[pieces[0][0]][1:])
    if shape != want:
        raise CheckpointError(f"shape mismatch for tensor {name!r}: checkpoint {shape}, model expects {want} "
                              f"({' + '.join(p.rsplit('.', 2)[-2] for p, _, _ in pieces)})")


def _check_missing(missing: set[str]) -> None:
    if missing:
        names = sorted(missing)
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        raise CheckpointError(f"missing tensors in checkpoint: {', '.join(names[:5])}{more}")


def _packed(name: str, file: str, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether checkpoint tensor `name` is half of an MXFP4 expert weight (gpt-oss: read whole by
    `_unpacked` after the other tensors); the weight must be the model's."""
    if config.moe is None or not config.moe.mxfp4:
        return False
    param = packed_param(name)
    if param is None:
        return False
    if param not in shapes:
        raise _unexpected(name, file, config)
    return True


def _unpacked(path: str, config: ModelConfig, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Parameter `name`, stored as MXFP4 blocks and scales (either in any file), dequantized."""
    try:
        return read_packed(lambda stored: read_named(path, stored), _stored_name(name, config), shape, dtype)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _packed_params(config: ModelConfig, names) -> list[str]:
    """The parameters among `names` a checkpoint stores as MXFP4."""
    if config.moe is None or not config.moe.mxfp4:
        return []
    return [n for n in names if n.endswith(".mlp.experts.gate_up_proj") or n.endswith(".mlp.experts.down_proj")]


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", backend=None,
               quant_kernels: Kernels = "auto") -> tuple[LlamaForCausalLM | BertEncoderModel, ModelConfig]:
    """The whole model from a checkpoint directory, its weights in `dtype` on `device`. A
    quantized checkpoint's layers keep their packed weights or are dequantized as
    `quant_kernels` says (raycluster.model.quant.linear)."""
    path = os.fspath(path)
    config = load_config(path)
    files = weight_files(path)

    # Build on the meta device so no memory or time is spent on random init.
    with torch.device("meta"):
        model = build_model(config, backend)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    loaded: set[str] = set()
    mapped = file_names(path)
    for file in files:
        for stored, tensor in read_tensors(file, None if mapped is None else mapped.get(file, set()),
                                           lambda stored: _foreign(stored, config)):
            name = _param_name(stored, config)
            if _skipped(name, config) or _packed(name, file, config, shapes):
                continue
            pieces = fused_pieces(name, config)
            if pieces is not None:
                _check_fused(name, file, config, tuple(tensor.shape), pieces, shapes)
            for piece, first, rows in pieces or [(name, 0, None)]:
                p = params.get(piece)
                if p is None:
                    raise _unexpected(name, file, config)
                part = tensor if rows is None else tensor[first:first + rows]
                if not _same_shape(tuple(part.shape), tuple(p.shape)):
                    raise CheckpointError(
                        f"shape mismatch for tensor {name!r}: checkpoint {tuple(tensor.shape)}, "
                        f"model expects {tuple(p.shape)}")
                with torch.no_grad():
                    p.copy_(_checked_value(name, part, p.dtype, dtype).reshape(p.shape))
                loaded.add(piece)
    for name in _packed_params(config, params):
        with torch.no_grad():
            params[name].copy_(_unpacked(path, config, name, shapes[name], dtype))
        loaded.add(name)
    _check_missing(set(params) - loaded)
    finalize_quantized(model, quant_kernels)
    model.projector = checkpoint_projector(path, config, device)
    model.eval()
    model.requires_grad_(False)  # inference only; avoids autograd bookkeeping outside inference_mode
    return model, config


def checkpoint_projector(path: str, config: ModelConfig, device):
    """The checkpoint's sentence-transformers Dense modules (None without any), as CheckpointError."""
    from raycluster.model.projector import load_projector
    try:
        return load_projector(path, config.pooler, device=device)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def model_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the full model `config` describes, and its shape (built on the
    meta device: nothing is allocated)."""
    return {name: tuple(p.shape) for name, p in _meta_params(config).items()}


def _meta_params(config: ModelConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = build_model(config)
    return dict(model.named_parameters())


def load_tensors(path: str | os.PathLike, config: ModelConfig, wanted: Mapping[str, TensorPart],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The checkpoint tensors named in `wanted` (full-model parameter names), each cut to its
    part, cast to `dtype` and placed on `device`; nothing else is read. Strict as `load_model`:
    every wanted tensor present, every name in the checkpoint one the model has, each full shape
    the model's; errors name the tensor (and file)."""
    path = os.fspath(path)
    params = _meta_params(config)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    unknown = sorted(set(wanted) - set(shapes))
    if unknown:
        raise ValueError(f"not parameters of this model: {', '.join(unknown)}")
    out: dict[str, torch.Tensor] = {}
    mapped = file_names(path)
    for file in weight_files(path):
        only = None if mapped is None else mapped.get(file, set())
        for batch in _batches(_checked_names(file, config, shapes, wanted, only)):
            with open_checkpoint(file) as f:
                for name in batch:
                    # The slice is a view into the mapped file (safetensors maps it; only the
                    # pages the slice covers are read): copy it out so the parameter owns
                    # exactly its part, contiguous, and holds no reference to the mapping.
                    part = wanted[name]
                    stored, first = _source(name, config)
                    handle = _sliceable(f, stored, shapes[name]) if first is None else \
                        _Rows(f.get_slice(stored), first, shapes[name][0])
                    view = part.read(handle, shapes[name])
                    view = _checked_value(name, view, params[name].dtype, dtype)
                    shape = part.out_shape(shapes[name])
                    if tuple(view.shape) == shape:
                        out[name] = torch.empty(shape, dtype=view.dtype, device=device).copy_(view)
                    else:       # a padded part (`RowsPart`): the rows read, then zeros
                        out[name] = torch.zeros(shape, dtype=view.dtype, device=device)
                        out[name][:view.shape[0]].copy_(view)
    for name in _packed_params(config, wanted):     # read whole, then cut
        part = wanted[name].take(_unpacked(path, config, name, shapes[name], dtype))
        out[name] = torch.empty(part.shape, dtype=dtype, device=device).copy_(part)
    _check_missing(set(wanted) - set(out))
    return out


def _sliceable(f, name: str, shape: tuple[int, ...]):
    """A `get_slice` handle, or for a one-element scale stored as a scalar, the tensor as [1]."""
    sl = f.get_slice(name)
    if tuple(sl.get_shape()) == shape:
        return sl
    return f.get_tensor(name).reshape(shape)


def _checked_names(file: str, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                   wanted: Mapping[str, TensorPart], only: set[str] | None = None) -> list[str]:
    """The wanted tensors in `file`, after checking every name in it (in `only`, the index's for
    it, when given) is the model's and every wanted one has the model's shape (the header only:
    no tensor data is read)."""
    names = []
    with open_checkpoint(file) as f:
        for stored in f.keys():
            if (only is not None and stored not in only) or _foreign(stored, config):
                continue
            name = _param_name(stored, config)
            if _skipped(name, config) or _packed(name, file, config, shapes):
                continue
            pieces = fused_pieces(name, config)
            if pieces is not None:
                _check_fused(name, file, config, tuple(f.get_slice(stored).get_shape()), pieces, shapes)
                if any(p in wanted for p, _, _ in pieces):
                    names += [p for p, _, _ in pieces if p in wanted]
                continue
            if name not in shapes:
                raise _unexpected(name, file, config)
            if name in wanted:
                shape = tuple(f.get_slice(stored).get_shape())
                if not _same_shape(shape, shapes[name]):
                    raise CheckpointError(
                        f"shape mismatch for tensor {name!r}: checkpoint {shape}, model expects {shapes[name]}")
                names.append(name)
    return names


def _batches(names: list[str]) -> list[list[str]]:
    """The names grouped by decoder layer (other tensors one by one). Each batch is read with
    the file opened afresh: the checkpoint pages a batch touched leave this process's RSS when
    the mapping closes, so at most one layer's are mapped at a time."""
    groups: dict[str, list[str]] = {}
    for name in names:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())
