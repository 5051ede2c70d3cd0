"""The sparse mixture-of-experts feed-forward a config.json describes (`MoEConfig`), read as
transformers reads it for Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2 / V3 and GLM-4.5 (`moe_config`;
gpt-oss's and Llama 4's own readers build theirs: gpt_oss_config, llama4_config). Errors name the
field (`error`, the model config's exception type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MoEConfig:
    """The sparse mixture-of-experts feed-forward of Mixtral / Qwen2-MoE / Qwen3-MoE layers: each
    token runs through the `top_k` of `num_experts` experts its router scores highest (softmax
    over the router's logits; the k weights renormalised to sum to 1 when `norm_topk_prob`), plus,
    in Qwen2-MoE, a shared expert every token runs, scaled by a sigmoid gate. `layers`: the indices
    (in the full model) of the sparse layers; the others keep a dense MLP of `intermediate_size`.
    `mixtral_names`: the checkpoint calls the block `block_sparse_moe` and an expert's
    projections w1 / w3 / w2 (gate / up / down); Qwen's call them `mlp`, gate/up/down_proj."""
    num_experts: int
    top_k: int
    intermediate_size: int             # of each routed expert
    norm_topk_prob: bool
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    mixtral_names: bool = False
    # The experts [first, end) a model built from this config holds (an expert-parallel rank's
    # share, raycluster.parallel.shard); None: every expert.
    local_experts: tuple[int, int] | None = None
    # DeepSeek's routing (raycluster.model.moe): "v3": sigmoid scores, a learnt per-expert bias
    # (`e_score_correction_bias`) added for the choice only, the top `topk_group` of `n_group`
    # expert groups (by each group's two best biased scores) to choose from; "v2": softmax
    # scores, groups by their best score (`topk_method` group_limited_greedy, else one group),
    # never renormalised. Weights times `routed_scaling`; shared experts ungated, named
    # `shared_experts`. None: softmax top k (Mixtral, Qwen).
    deepseek: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    # gpt-oss (raycluster.model.gpt_oss): every layer's experts stacked in three tensors with
    # biases, a router with a bias whose top k logits are softmaxed, each expert's SwiGLU clamped
    # at `swiglu_limit` (the gate above, up both sides) with sigmoid gain `swiglu_alpha`.
    gpt_oss: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # The checkpoint stores the experts' weights as MXFP4 blocks and scales (gpt-oss's released
    # files: raycluster.model.quant.mxfp4), dequantized at load.
    mxfp4: bool = False
    # Llama 4 (raycluster.model.llama4): the top k by router logit, each chosen expert fed the
    # token times sigmoid(its logit); stacked experts, gate / up in halves; a shared expert.
    llama4: bool = False
    # Experts stored stacked (raycluster.model.stacked_experts): gate / up "interleaved" column by
    # column (gpt-oss) or in "halves" (Llama 4, Qwen3-VL-MoE); None: one module per expert.
    stacked: str | None = None
    # Granite's (raycluster.model.granite_moe): stacked output-major as input_linear / output_linear.
    granite: bool = False


def moe_config(arch: str, d: dict[str, Any], layers: int, error: Callable[[str], Exception]) -> MoEConfig:
    """The experts config.json describes, read as transformers does: Mixtral's
    `num_local_experts` experts of `intermediate_size` on every layer, weights always
    renormalised; Qwen's `num_experts` (or `num_local_experts`) of `moe_intermediate_size` on the layers i with
    (i + 1) % `decoder_sparse_step` == 0 and not in `mlp_only_layers`."""
    def count(name: str, default: int | None = None, minimum: int = 1) -> int:
        v = d.get(name, default)
        try:
            v = int(v)
        except (TypeError, ValueError):
            raise error(f"config field {name!r} has invalid value {d.get(name)!r}") from None
        if v < minimum:
            raise error(f"config field {name!r} = {v} must be at least {minimum}")
        return v

    top_k = count("num_experts_per_tok")
    # The hub's Qwen configs say num_experts, transformers 5 writes num_local_experts for both.
    experts_field = next((f for f in ("num_local_experts", "num_experts") if d.get(f) is not None),
                         "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts")
    if arch == "GraniteMoeForCausalLM":      # every layer routed; softmax over the top k logits
        moe = MoEConfig(count("num_local_experts", 8), top_k, count("intermediate_size"), True, tuple(range(layers)),
                        mixtral_names=True, granite=True)
    elif arch == "MixtralForCausalLM":
        experts = count(experts_field)
        moe = MoEConfig(experts, top_k, count("intermediate_size"), True, tuple(range(layers)),
                        mixtral_names=True)
    elif arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"):   # GLM-4.5 routes as V3
        experts = count("n_routed_experts")
        v2 = arch == "DeepseekV2ForCausalLM"
        method = d.get("topk_method", "greedy" if v2 else "noaux_tc")
        if method not in (("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)):
            raise error(f"config field 'topk_method' = {method!r} is not supported for {arch}")
        grouped = method != "greedy"
        n_group = count("n_group", 1) if grouped else 1
        topk_group = count("topk_group", 1) if grouped else 1
        if experts % n_group or topk_group > n_group:
            raise error(f"config fields 'n_group' = {n_group} / 'topk_group' = {topk_group} do not fit "
                                   f"the {experts} experts")
        scaling = d.get("routed_scaling_factor", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
            raise error(f"config field 'routed_scaling_factor' must be a positive number, got {scaling!r}")
        first = count("first_k_dense_replace", 0, 0)
        moe = MoEConfig(experts, top_k, count("moe_intermediate_size"),
                        not v2 and bool(d.get("norm_topk_prob", True)), tuple(range(first, layers)),
                        shared_intermediate_size=count("n_shared_experts", 0, 0) * count("moe_intermediate_size"),
                        deepseek="v2" if v2 else "v3", n_group=n_group, topk_group=topk_group,
                        routed_scaling=float(scaling))
    else:
        experts = count(experts_field)
        step = count("decoder_sparse_step", 1)
        only_dense = d.get("mlp_only_layers") or []
        if not isinstance(only_dense, list) or not all(isinstance(i, int) for i in only_dense):
            raise error(f"config field 'mlp_only_layers' must be a list of layer indices: {only_dense!r}")
        sparse = tuple(i for i in range(layers) if (i + 1) % step == 0 and i not in only_dense)
        shared = count("shared_expert_intermediate_size", 0, 0) if arch == "Qwen2MoeForCausalLM" else 0
        moe = MoEConfig(experts, top_k, count("moe_intermediate_size"), bool(d.get("norm_topk_prob", False)),
                        sparse, shared_intermediate_size=shared)
    if top_k > moe.num_experts:
        raise error(f"config field 'num_experts_per_tok' = {top_k} exceeds the {moe.num_experts} experts")
    return moe
