"""LoRA adapters (PEFT format) served beside the base weights, many in one batch (vLLM's
--enable-lora / --lora-modules).

`load_adapter(path, config, name)` reads a PEFT directory (adapter_config.json and
adapter_model.safetensors: per target projection of each layer, `lora_A` [r, in] and `lora_B`
[out, r]) and checks it against the base model's shapes; the scaling (lora_alpha / r, or / sqrt(r)
with rsLoRA) is folded into B. `LoRASet` holds the adapters of one engine by name. Each step,
`LoRASet.for_step(runs, num_tokens)` turns the plan's runs of tokens that use an adapter into a `StepLoRA`:
per adapter, the token rows using it. The model calls `StepLoRA.add(layer, module, x, y)` after
each targeted projection y = x W^T: y[rows] += (x[rows] A^T) B^T for each adapter in the step,
so the base weights are never changed and requests on different adapters (or none) share a
batch. A step mixing adapters runs them all at once (`StackedStepLoRA`, a dense stand-in for
punica's SGMV): the set keeps every adapter's A rows and B columns side by side in one stack
per projection, and y[rows] += ((x[rows] A_all^T) * M) B_all^T, M masking each token to its own
adapter's columns: a handful of tensor ops per projection however many adapters the step mixes. Projections a LoRA can target: q/k/v/o_proj and gate/up/down_proj (a dense layer's: not
the experts of a mixture-of-experts layer); an adapter for anything else (embeddings, lm_head,
experts, an image-text model's vision tower), with DoRA, biases or fan_in_fan_out is refused.
An image-text checkpoint's adapter names the text model's layers as its wrapper does
(`model.language_model.layers...`, `language_model.model.layers...`, Qwen-VL's `model.layers...`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from raycluster.model.config import ModelConfig

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# A fused checkpoint's projections (Phi-3) and the split ones they hold, in row order. An adapter
# on one is served as adapters on its pieces: the same A, B's rows for each (B A x, row by row).
FUSED_TARGETS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
                 "gate_up_proj": ("mlp", ("gate_proj", "up_proj"))}
# The text model's layers under an image-text wrapper's names too: transformers 5's
# `model.language_model.layers`, the released LLaVA / Gemma 3 files' `language_model.model.layers`.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.)layers\.(\d+)\."
                  r"(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$")
# An image-text model's tower and projector: LoRA is served on the text model only.
_VISION = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:visual|vision_tower|vision_model|multi_modal_projector)\.")


class AdapterError(ValueError):
    """An adapter directory that cannot be served on this model; the message names the problem."""


class AdapterNotFound(AdapterError):
    """No adapter directory at the path given, or no adapter of the name given."""


class AdapterBusy(AdapterError):
    """The name is being loaded or unloaded right now; the same call may succeed once that ends."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # (layer, module) -> (A [r, in], B [out, r] with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection a LoRA may target (a fused model's fused ones too)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    if cfg.ungated_mlp:         # Arcee's, Apertus': no gate
        shapes.update(up_proj=(i, h), down_proj=(h, i))
    elif not cfg.plain_mlp:     # StarCoder2's c_fc / c_proj take no adapter
        shapes.update(gate_proj=(i, h), up_proj=(i, h), down_proj=(h, i))
    fused = {"qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}
    shapes.update({name: fused[name] for name in cfg.fused_projections})
    return shapes


def target_group(module: str) -> str | None:
    """The layer block ("self_attn" / "mlp") projection `module` belongs to."""
    return TARGETS.get(module) or FUSED_TARGETS.get(module, (None,))[0]


def load_adapter(path: str | os.PathLike, cfg: ModelConfig, name: str, dtype: torch.dtype = torch.float32,
                 max_rank: int = 256) -> LoRAAdapter:
    path = os.fspath(path)
    if cfg.mla is not None:
        raise AdapterError(f"{name}: LoRA adapters on a model with latent attention (DeepSeek) are not supported")
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            acfg = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        raise AdapterNotFound(f"{name}: no adapter found at {path} (no adapter_config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{name}: cannot read {path}/adapter_config.json: {e}") from None
    if not isinstance(acfg, dict):
        raise AdapterError(f"{name}: {path}/adapter_config.json is not a JSON object")
    if str(acfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{name}: peft_type {acfg.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(acfg.get(key, False)) != ok:
            raise AdapterError(f"{name}: {key} is not supported")
    if acfg.get("bias", "none") != "none":
        raise AdapterError(f"{name}: bias {acfg.get('bias')!r} is not supported (only 'none')")
    if acfg.get("rank_pattern") or acfg.get("alpha_pattern") or acfg.get("modules_to_save"):
        raise AdapterError(f"{name}: rank_pattern, alpha_pattern and modules_to_save are not supported")
    rank, alpha = int(acfg.get("r", 8)), float(acfg.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{name}: rank {rank} outside [1, {max_rank}]")
    scaling = alpha / math.sqrt(rank) if acfg.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise AdapterError(f"{name}: no adapter_model.safetensors in {path}")
    shapes, parts = _shapes(cfg), {}
    for key, tensor in load_file(file).items():
        m = _KEY.match(key)
        if m is None and _VISION.match(key):
            raise AdapterError(f"{name}: tensor {key!r} targets the vision tower or projector; LoRA is served on "
                               "the text model's projections only (train the adapter with target_modules limited "
                               "to the language model)")
        if m is None:
            raise AdapterError(f"{name}: tensor {key!r} is not a LoRA A/B of a q/k/v/o or gate/up/down projection")
        layer, group, module, ab = int(m[1]), m[2], m[3], m[4]
        if target_group(module) != group or module not in shapes or not 0 <= layer < cfg.num_hidden_layers:
            raise AdapterError(f"{name}: tensor {key!r} targets no projection of this model")
        if group == "mlp" and cfg.is_moe_layer(layer):
            raise AdapterError(f"{name}: tensor {key!r} targets the MLP of layer {layer}, a mixture-of-experts "
                               "layer (adapters on experts are not supported; attention projections are)")
        out_dim, in_dim = shapes[module]
        want = (rank, in_dim) if ab == "A" else (out_dim, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"{name}: tensor {key!r} has shape {tuple(tensor.shape)}, this model needs {want}")
        parts[(layer, module, ab)] = tensor.float()
    adapter = LoRAAdapter(name, path, rank)
    pairs = 0
    for (layer, module, ab), a in parts.items():
        if ab != "A":
            continue
        pairs += 1
        b = parts.get((layer, module, "B"))
        if b is None:
            raise AdapterError(f"{name}: layer {layer} {module} has lora_A but no lora_B")
        a = a.to(dtype).contiguous()
        first = 0
        for piece in FUSED_TARGETS[module][1] if module in FUSED_TARGETS else (module,):
            rows = shapes[piece][0] if module in FUSED_TARGETS else b.shape[0]
            adapter.weights[(layer, piece)] = (a, (b[first:first + rows] * scaling).to(dtype).contiguous())
            first += rows
    if pairs * 2 != len(parts):
        raise AdapterError(f"{name}: a lora_B without its lora_A")
    if not adapter.weights:
        raise AdapterError(f"{name}: no LoRA weights in {file}")
    return adapter


def parse_modules(specs: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules entries, "name=path" each, as {name: path} (ValueError on a bad one)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {spec!r} is not name=path")
        if name in out:
            raise ValueError(f"lora_modules: {name!r} is given twice")
        out[name.strip()] = path.strip()
    return out


class StepLoRA:
    """The adapters of one step: per adapter, the rows of the step's tokens that use it."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (= x W^T for `module` of `layer`) plus each adapter's x A^T B^T on its rows."""
        for adapter, rows in self.groups:
            ab = adapter.weights.get((layer, module))
            if ab is None:
                continue
            a, b = ab
            if rows.numel() == x.shape[0]:          # every token on this adapter: no gather
                y.add_((x @ a.t()) @ b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y


class AdapterStack:
    """Adapters side by side: per (layer, module) A_all [S, in] (each adapter's A rows, in
    order) and B_all^T [S, out] (its B columns), zero rows where an adapter skips the module;
    `cols[name]` = its (first, end) columns, `col_owner` [S] = the adapter index of each column."""

    def __init__(self, adapters: list[LoRAAdapter]) -> None:
        self.cols: dict[str, tuple[int, int]] = {}
        self.index: dict[str, int] = {}
        width = 0
        for i, ad in enumerate(adapters):
            self.cols[ad.name], self.index[ad.name] = (width, width + ad.rank), i
            width += ad.rank
        self.width = width
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        owners = [i for i, ad in enumerate(adapters) for _ in range(ad.rank)]
        for key in sorted({k for ad in adapters for k in ad.weights}):
            some_a, some_b = next(ad.weights[key] for ad in adapters if key in ad.weights)
            a_all = some_a.new_zeros((width, some_a.shape[1]))
            bt_all = some_b.new_zeros((width, some_b.shape[0]))
            for ad in adapters:
                if key in ad.weights:
                    lo, hi = self.cols[ad.name]
                    a, b = ad.weights[key]
                    a_all[lo:hi], bt_all[lo:hi] = a, b.t()
            self.weights[key] = (a_all, bt_all)
        first = next(iter(adapters[0].weights.values()))[0] if adapters else torch.empty(0)
        self.dtype = first.dtype
        self.col_owner = torch.tensor(owners, dtype=torch.long, device=first.device)
        # Each adapter's weights become views of the stack: its weights are held once.
        for ad in adapters:
            lo, hi = self.cols[ad.name]
            ad.weights = {k: (self.weights[k][0][lo:hi], self.weights[k][1][lo:hi].t()) for k in ad.weights}


class StackedStepLoRA:
    """A step's adapters through the set's stack: per projection one x A_all^T, one mask, one
    product with B_all^T, added to the rows using any adapter."""

    def __init__(self, stack: AdapterStack, rows: torch.Tensor | None, mask: torch.Tensor) -> None:
        self.stack = stack
        self.rows = rows          # the adapter rows; None: every row of the step (base rows masked out)
        self.mask = mask          # [rows, S]: 1 on the columns of the row's adapter, 0 elsewhere

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ab = self.stack.weights.get((layer, module))
        if ab is None:
            return y
        a_all, bt_all = ab
        xs = x if self.rows is None else x.index_select(0, self.rows)
        h = (xs @ a_all.t()).mul_(self.mask)
        if self.rows is None:
            return y.addmm_(h, bt_all)
        return y.index_add_(0, self.rows, h @ bt_all)


class LoRASet:
    """The adapters an engine serves, by name, and those it is unloading.

    An adapter is loaded at start (`load`) or at run time (`add`); `retire` stops serving it to
    new requests, and `collect` drops it once no request uses it, so running requests finish on
    it (vLLM's unload). A name loaded again after an unload gets another prefix-cache root
    (`root_key`): the KV the old weights made is never matched to the new ones."""

    def __init__(self, adapters: list[LoRAAdapter] = (), on_change=None) -> None:
        """`on_change(name, path or None)`: told of each adapter served and finally dropped (a
        group runner's `change_lora`, which gives each rank its shard)."""
        self.on_change = on_change
        self.adapters: dict[str, LoRAAdapter] = {}
        self.retiring: set[str] = set()
        self._loads: dict[str, int] = {}          # name -> times loaded, ever
        self.roots: dict[str, str] = {}           # name -> `root_key` (the prefix cache reads it)
        self._stack: AdapterStack | None = None
        self._stack_key: tuple[int, ...] | None = None
        for a in adapters:
            self.add(a)

    def __contains__(self, name: str) -> bool:
        """Whether new requests may use `name`."""
        return name in self.adapters and name not in self.retiring

    def names(self) -> list[str]:
        return [n for n in self.adapters if n not in self.retiring]

    def paths(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items() if n not in self.retiring}

    def add(self, adapter: LoRAAdapter) -> None:
        name = adapter.name
        if name in self.retiring:
            raise AdapterBusy(f"the LoRA adapter {name!r} is still being unloaded (requests are running on "
                               "it); load it again once they finish")
        if name in self.adapters:
            raise AdapterError(f"the LoRA adapter {name!r} has already been loaded")
        self.adapters[name] = adapter
        self._loads[name] = self._loads.get(name, 0) + 1
        self.roots[name] = self.root_key(name)
        if self.on_change is not None:
            self.on_change(name, adapter.path)

    def root_key(self, name: str) -> str:
        """What the prefix cache roots this adapter's chains at: its name, and for a second or
        later load of the name, which load."""
        n = self._loads.get(name, 1)
        return name if n <= 1 else f"{name}#{n}"

    def retire(self, name: str) -> None:
        if name not in self:
            raise AdapterNotFound(f"the LoRA adapter {name!r} cannot be found")
        self.retiring.add(name)

    def collect(self, in_use: set[str]) -> list[str]:
        """Drop the retiring adapters no request uses any more; returns their names."""
        gone = [n for n in self.retiring if n not in in_use]
        for n in gone:
            self.retiring.discard(n)
            del self.adapters[n]
            if self.on_change is not None:
                self.on_change(n, None)
        return gone

    # The stack's extra columns cost FLOPs on every adapter row; past this many per used column
    # they outweigh the per-adapter tensor ops it saves, and the step loops over its adapters.
    MAX_STACK_WIDTH_PER_USED_COLUMN = 4

    def stack(self) -> AdapterStack:
        """Every adapter held (served or retiring) in one stack, rebuilt when the set changed."""
        key = tuple(map(id, self.adapters.values()))
        if self._stack_key != key:
            self._stack, self._stack_key = AdapterStack(list(self.adapters.values())), key
        return self._stack

    def for_step(self, runs: list[tuple[str, int, int]], num_tokens: int,
                 device: torch.device | str = "cpu") -> StepLoRA | StackedStepLoRA:
        """`runs`: (adapter name, first token, count) of the step's tokens that use an adapter;
        `num_tokens`: the step's tokens in all."""
        rows: dict[str, list[int]] = {}
        for name, first, count in runs:
            rows.setdefault(name, []).extend(range(first, first + count))
        used = sum(self.adapters[name].rank for name in rows)
        width = sum(a.rank for a in self.adapters.values())
        if len(rows) >= 2 and width <= self.MAX_STACK_WIDTH_PER_USED_COLUMN * used:
            return self._stacked(runs, num_tokens, device)
        return StepLoRA([(self.adapters[name], torch.tensor(r, dtype=torch.long, device=device))
                         for name, r in rows.items()])

    def _stacked(self, runs: list[tuple[str, int, int]], num_tokens: int, device) -> StackedStepLoRA:
        stack = self.stack()
        covered = sum(count for _, _, count in runs)
        if 2 * covered >= num_tokens:
            # Mostly adapter rows: every row through the stack, base rows masked out entirely;
            # cheaper than gathering the adapter rows and adding them back.
            owner = [-1] * num_tokens
            for name, first, count in runs:
                owner[first:first + count] = [stack.index[name]] * count
            rows = None
        else:
            owner = [stack.index[name] for name, _, count in runs for _ in range(count)]
            rows = torch.tensor([t for _, first, count in runs for t in range(first, first + count)],
                                dtype=torch.long, device=device)
        owner_t = torch.tensor(owner, dtype=torch.long, device=device)
        mask = (owner_t[:, None] == stack.col_owner[None, :]).to(stack.dtype)
        return StackedStepLoRA(stack, rows, mask)
