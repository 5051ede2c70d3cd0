"""How a model turns a prompt's final hidden states into one embedding vector, as vLLM's pooler
does for an embedding model (`--runner pooling`): the pooling type (LAST token, MEAN over the
prompt, CLS: the first token), whether vectors are L2-normalised, and which shorter (Matryoshka)
vector sizes the model was trained for.

`read_pooler_config(dir, config_json)` builds a `PoolerConfig` from a checkpoint: a
sentence-transformers layout (`modules.json` naming a Pooling module, whose `config.json` gives
the mode in either the current `pooling_mode` or the legacy `pooling_mode_*` booleans: lasttoken,
mean, cls, max, mean_sqrt_len_tokens or weightedmean, one of them; and an optional Normalize
module) decides type and normalisation; without one a decoder pools its LAST
token, normalised (vLLM's defaults for a causal LM served as an embedding model). config.json's
`is_matryoshka` / `matryoshka_dimensions` say which `dimensions` a request may ask for. Modules
that would change the vector otherwise (LayerNorm, ...) are refused rather than silently skipped;
Dense projections after pooling are kept (`DenseSpec`, applied by the engine:
raycluster.model.projector).

The engine (raycluster.engine.model_runner) pools: `pool_chunk` / `pooled` accumulate a request's
rows chunk by chunk (a token-level request, `TOKEN_POOLING`, keeps every row); the raw pooled vector travels to the API, where `finish_vector` truncates to
the requested dimensions and normalises.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

POOLING_TYPES = ("last", "mean", "cls")
# A sentence-transformers Pooling module may also say these (ST's max, mean_sqrt_len_tokens and
# weightedmean: an element-wise max, the sum over sqrt(n), the mean weighted by position 1..n).
ST_ONLY_TYPES = ("max", "mean_sqrt", "weighted_mean")
# A request's token-level pooling (vLLM's token_embed / token_classify): every prompt position's row.
TOKEN_POOLING = "all"

# sentence-transformers' pooling modes (current names and the legacy booleans) -> ours.
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt",
             "weightedmean": "weighted_mean"}
_ST_LEGACY = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


class PoolerConfigError(ValueError):
    """A checkpoint's pooling setup that we cannot reproduce."""


# sentence-transformers Dense activations (their `fullname`) -> torch functions by name.
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh",
                     "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.GELU": "gelu",
                     "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.activation.SiLU": "silu"}


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module: y = act(W x + b) (+ x, or R x, with a residual)."""
    path: str                   # its directory, relative to the checkpoint
    in_features: int
    out_features: int
    bias: bool
    activation: str             # a value of DENSE_ACTIVATIONS
    residual: bool = False


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"          # one of POOLING_TYPES, or from sentence-transformers ST_ONLY_TYPES
    normalize: bool = True              # the default; a request's `normalize` overrides it
    matryoshka: bool = False            # may a request ask for fewer `dimensions`
    matryoshka_dimensions: tuple[int, ...] | None = None   # only these (None: any size <= hidden)
    source: str = "default"             # where it came from: "default" | "sentence-transformers"
    # sentence-transformers Dense modules after pooling, in order (raycluster.model.projector).
    dense: tuple[DenseSpec, ...] = ()

    def output_size(self, hidden_size: int) -> int:
        """The pooled vector's size: the last Dense module's output, else the hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip (LAST reads the last one,
        which is always computed)."""
        return self.pooling_type != "last"


def read_pooler_config(model_dir: str | None, config: dict[str, Any], default_type: str = "last") -> PoolerConfig:
    """The pooler of a checkpoint directory whose config.json holds `config`. Without a
    sentence-transformers layout: `default_type`, normalised (vLLM's defaults: a decoder's last
    token, an encoder's [CLS])."""
    dims = config.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not dims
                             or not all(isinstance(d, int) and d > 0 for d in dims)):
        raise PoolerConfigError(f"config field 'matryoshka_dimensions' must be a list of positive ints, got {dims!r}")
    matryoshka = bool(config.get("is_matryoshka", False)) or dims is not None
    base = dict(matryoshka=matryoshka, matryoshka_dimensions=tuple(sorted(set(dims))) if dims else None)
    st = _sentence_transformers(model_dir) if model_dir else None
    if st is None:
        return PoolerConfig(pooling_type=default_type, **base)
    pooling_type, normalize, dense = st
    return PoolerConfig(pooling_type=pooling_type, normalize=normalize, source="sentence-transformers",
                        dense=dense, **base)


def _sentence_transformers(model_dir: str) -> tuple[str, bool, tuple[DenseSpec, ...]] | None:
    """(pooling type, normalize, Dense modules) from a sentence-transformers `modules.json`, or
    None. The modules must run Transformer, Pooling, any Dense, then Normalize if any."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
    except json.JSONDecodeError as e:
        raise PoolerConfigError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(modules, list):
        raise PoolerConfigError(f"{path}: expected a list of modules")
    pooling_type, normalize, dense = None, False, []
    for m in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind, where = str(m.get("type", "")).rsplit(".", 1)[-1], m.get("path") or m.get("name")
        if kind == "Transformer":
            continue
        if normalize or (kind == "Dense" and pooling_type is None):
            raise PoolerConfigError(f"{path}: module {where!r} ({kind}) comes after a Normalize module or before "
                                    "the Pooling one; only Pooling, Dense modules, then Normalize are supported")
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _st_pooling_mode(os.path.join(model_dir, m.get("path", ""), "config.json"))
        elif kind == "Dense":
            dense.append(_st_dense(model_dir, m.get("path", "")))
        else:
            raise PoolerConfigError(f"{path}: module {where!r} of type {m.get('type')!r} is not supported "
                                    "(only Transformer, Pooling, Dense and Normalize)")
    if pooling_type is None:
        raise PoolerConfigError(f"{path}: no Pooling module")
    for a, b in zip(dense, dense[1:]):
        if a.out_features != b.in_features:
            raise PoolerConfigError(f"{model_dir}: Dense module {b.path!r} takes {b.in_features} features, "
                                    f"{a.path!r} gives {a.out_features}")
    return pooling_type, normalize, tuple(dense)


def _st_dense(model_dir: str, rel: str) -> DenseSpec:
    path = os.path.join(model_dir, rel, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PoolerConfigError(f"{path}: cannot read the Dense module's config: {e}") from e
    act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act not in DENSE_ACTIVATIONS:
        raise PoolerConfigError(f"{path}: activation_function {act!r} is not supported "
                                f"({', '.join(sorted(DENSE_ACTIVATIONS))})")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise PoolerConfigError(f"{path}: {key} {cfg[key]!r} is not supported (only sentence_embedding)")
    try:
        return DenseSpec(rel, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                         DENSE_ACTIVATIONS[act], bool(cfg.get("use_residual", False)))
    except (KeyError, TypeError, ValueError) as e:
        raise PoolerConfigError(f"{path}: in_features and out_features must be ints ({e})") from None


def _st_pooling_mode(path: str) -> str:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PoolerConfigError(f"{path}: cannot read the Pooling module's config: {e}") from e
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY.items() if cfg.get(key)]
        mode = modes[0] if len(modes) == 1 else modes or "mean"
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else mode
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise PoolerConfigError(f"{path}: pooling mode {mode!r} is not supported (one of {', '.join(_ST_MODES)})")
    if cfg.get("include_prompt", True) is False:
        raise PoolerConfigError(f"{path}: include_prompt false is not supported (every prompt token is pooled)")
    return _ST_MODES[mode]


def sentence_transformers_options(model_dir: str) -> dict[str, Any]:
    """The Transformer module's options in a sentence-transformers `sentence_bert_config.json`
    (`max_seq_length`, `do_lower_case`), or {}: what vLLM reads as the model's encoder config."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise PoolerConfigError(f"{path}: invalid JSON: {e}") from e
    out: dict[str, Any] = {}
    n = cfg.get("max_seq_length")
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise PoolerConfigError(f"{path}: max_seq_length must be a positive int, got {n!r}")
        out["max_seq_length"] = n
    if cfg.get("do_lower_case"):
        out["do_lower_case"] = True
    return out


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, hidden_size: int) -> str | None:
    """Why a request's `dimensions` cannot be served (None: it can)."""
    if dimensions is None or dimensions == hidden_size:
        return None
    if not pooler.matryoshka:
        return (f"this model's embeddings have {hidden_size} dimensions and it was not trained for shorter "
                "(Matryoshka) vectors")
    if dimensions > hidden_size:
        return f"must be at most this model's {hidden_size}"
    if pooler.matryoshka_dimensions is not None and dimensions not in pooler.matryoshka_dimensions:
        return f"must be one of this model's Matryoshka sizes {list(pooler.matryoshka_dimensions)}"
    return None


def finish_vector(raw: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A pooled vector as the API returns it: its first `dimensions` values (Matryoshka), then
    L2-normalised if asked (truncating first, as vLLM's pooler head does)."""
    v = torch.tensor(raw, dtype=torch.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.tolist()


def pool_chunk(state, pooling_type: str, rows: torch.Tensor, start: int):
    """A request's pooling state after a prefill chunk of final hidden `rows` [n, H] at positions
    start.. (MEAN, MEAN_SQRT: the running fp32 sum; WEIGHTED_MEAN: the sum weighted by position + 1;
    MAX: the running max; CLS: position 0's row; LAST: the chunk's last row; ALL: the chunks' rows
    so far). A chunk at position 0 starts over (a preempted request recomputes its prompt)."""
    if pooling_type == "last":
        return rows[-1].float()
    if start == 0:
        state = None
    if pooling_type == "cls":
        return rows[0].float() if start == 0 else state
    rows = rows.float()
    if pooling_type == TOKEN_POOLING:
        return [rows] if state is None else state + [rows]
    if pooling_type == "max":
        top = rows.max(0).values
        return top if state is None else torch.maximum(state, top)
    if pooling_type == "weighted_mean":
        weights = torch.arange(start + 1, start + rows.shape[0] + 1, dtype=rows.dtype, device=rows.device)
        total = weights @ rows
    else:
        total = rows.sum(0)
    return total if state is None else state + total


def pooled(state, pooling_type: str, num_prompt_tokens: int) -> torch.Tensor:
    """The raw pooled vector ([H]; ALL: [n, H]) once the whole prompt has been through `pool_chunk`."""
    n = num_prompt_tokens
    if pooling_type == TOKEN_POOLING:
        return torch.cat(state)
    if pooling_type == "mean":
        return state / n
    if pooling_type == "mean_sqrt":
        return state / n ** 0.5
    if pooling_type == "weighted_mean":
        return state / (n * (n + 1) / 2)
    return state
