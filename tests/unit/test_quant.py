"""Quantized checkpoints (raycluster.model.quant): config parsing and its errors, each layout's
tensors against an independent reference (compressed-tensors' own decompressors; AutoGPTQ's and
AutoAWQ's dequantization, written out here as their code does it; DeepSeek's FP8 block
dequantization), the int4 / int8 kernels against the dequantized formula, whole models against
transformers (which reads compressed-tensors and FP8 checkpoints itself), a MoE model's experts,
and the loader's refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kernels.metadata import AttentionMetadata
from raycluster.model.config import ModelConfig, ModelConfigError
from raycluster.model.loader import CheckpointError, load_model
from raycluster.model.quant.config import QuantConfigError, parse_quant_config
from raycluster.model.quant.formats import AWQ_ORDER, IntWeights, checkpoint_tensors, unpack, unpack_words
from raycluster.model.quant.linear import DenseMatmul, Int4Matmul, Int8Matmul, QuantLinear, make_matmul
from raycluster.model.quant.write import SCHEMES, pack_words, quantize_checkpoint, quantize_weight, scheme_config
from raycluster.model.tiny import write_tiny_model

torch.set_num_threads(2)
GROUP = 64


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """scheme -> the tiny checkpoint quantized by it (groups of 64; FP8 blocks of 64 x 64)."""
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for scheme in SCHEMES:
        quantize_checkpoint(str(tiny_model_dir), str(root / scheme), scheme, GROUP)
        out[scheme] = str(root / scheme)
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one prompt prefilled whole through a paged cache."""
    n, bs = len(ids), 16
    table = list(range(-(-n // bs)))[::-1]
    cache = torch.zeros(model.kv_cache_shape(len(table), bs), dtype=model.model.norm.weight.dtype)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    meta = AttentionMetadata(n, 0, [n], [n], [table], [], [], slots, bs)
    return model.compute_logits(model(ids, torch.arange(n), cache, meta)).float()


def _prompt(n: int = 45, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed))


def _matmuls(model) -> set[str]:
    return {type(m.matmul).__name__ for m in model.modules() if isinstance(m, QuantLinear)}


# ---- config -----------------------------------------------------------------------------------------
def test_each_scheme_parses_to_its_layout():
    got = {s: parse_quant_config(scheme_config(s, 128)) for s in SCHEMES}
    assert {s: (q.method, q.layout, q.bits, q.strategy, q.group_size, q.symmetric) for s, q in got.items()} == {
        "w4a16": ("compressed-tensors", "ct-packed", 4, "group", 128, True),
        "w4a16-asym": ("compressed-tensors", "ct-packed", 4, "group", 128, False),
        "w8a16": ("compressed-tensors", "ct-packed", 8, "channel", None, True),
        "w8a8": ("compressed-tensors", "ct-int8", 8, "channel", None, True),
        "fp8": ("compressed-tensors", "ct-fp8", 8, "channel", None, True),
        "fp8-block": ("fp8", "fp8", 8, "block", None, True),
        "gptq": ("gptq", "gptq", 4, "group", 128, True),
        "awq": ("awq", "awq", 4, "group", 128, False),
    }
    assert got["fp8-block"].block == (128, 128) and got["gptq"].gptq_zero_offset == 1
    assert not got["w8a8"].input_scale        # dynamic activations: no stored scale


def test_real_checkpoints_configs_parse():
    # As published: a GPTQ act-order model (v2 zeros), an AWQ one, a static-activation FP8 one.
    gptq = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": False,
                               "checkpoint_format": "gptq_v2", "damp_percent": 0.01, "true_sequential": True})
    assert (gptq.strategy, gptq.group_size, gptq.act_order, gptq.symmetric, gptq.gptq_zero_offset) == \
        ("channel", None, True, False, 0)
    awq = parse_quant_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                              "zero_point": True, "modules_to_not_convert": ["gate"]})
    assert awq.ignore == ("gate",)
    fp8 = parse_quant_config({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})
    assert (fp8.strategy, fp8.input_scale) == ("tensor", True)
    assert set(checkpoint_tensors(fp8, 32, 64)) == {"weight", "weight_scale", "input_scale"}


@pytest.mark.parametrize("raw,field", [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "quantization_config.checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "quantization_config.lm_head"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "quantization_config.version"),
    ({"quant_method": "awq", "bits": 4}, "quantization_config.group_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({**scheme_config("w4a16"), "config_groups": {"a": {}, "b": {}}}, "quantization_config.config_groups"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     "quantization_config.config_groups.group_0.weights.strategy"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "quantization_config.config_groups.group_0.weights.num_bits"),
])
def test_unsupported_configs_are_refused_naming_the_field(raw, field):
    with pytest.raises(QuantConfigError, match=field.replace(".", r"\.")):
        parse_quant_config(raw)
    # ModelConfig turns it into its own error, raised before any weight is read.
    with pytest.raises(ModelConfigError, match="quantization_config"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
                               "vocab_size": 10, "intermediate_size": 64, "num_hidden_layers": 1,
                               "max_position_embeddings": 64, "quantization_config": raw})


def test_which_layers_are_quantized():
    qc = parse_quant_config({**scheme_config("w4a16"), "ignore": ["lm_head", "re:.*self_attn.o_proj$",
                                                                   "model.layers.1.mlp.down_proj"]})
    assert qc.quantizes("model.layers.0.self_attn.q_proj") and qc.quantizes("model.layers.0.mlp.down_proj")
    assert not qc.quantizes("model.layers.3.self_attn.o_proj") and not qc.quantizes("model.layers.1.mlp.down_proj")
    # Routers stay dense whatever the list says, as in vLLM; the output head is never quantized.
    assert not qc.quantizes("model.layers.0.mlp.gate") and not qc.quantizes("model.layers.0.mlp.shared_expert_gate")
    assert not qc.quantizes("model.layers.0.block_sparse_moe.gate") and not qc.quantizes("lm_head")
    assert qc.quantizes("model.layers.0.mlp.shared_expert.gate_proj")


# ---- layouts against independent references -------------------------------------------------------
def test_pack_words_is_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(0)
    for bits, shape in ((4, (24, 64)), (4, (8, 36)), (8, (16, 40))):
        signed = torch.randint(-(1 << bits - 1), 1 << bits - 1, shape, generator=g, dtype=torch.int8)
        ours = pack_words(signed.to(torch.int32) + (1 << bits - 1), bits)
        assert torch.equal(ours, pack_to_int32(signed, bits))
        assert torch.equal(unpack_words(ours, bits, shape[1]) - (1 << bits - 1),
                           unpack_from_int32(ours, bits, torch.Size(shape)).to(torch.int32))


def _ct_reference(raw: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompressor for one layer's tensors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = raw["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.load_from_registry(raw["format"])
    return compressor.decompress(dict(tensors), scheme)["weight"].float()


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8"])
def test_compressed_tensors_layers_unpack_as_compressed_tensors_decompresses_them(scheme):
    raw = scheme_config(scheme, 32)
    qc = parse_quant_config(raw)
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    tensors = quantize_weight(w, qc, torch.float32)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: s.shape for k, s in checkpoint_tensors(qc, 48, 96).items()}
    ours = unpack(qc, tensors, 48, 96)
    dense = ours if isinstance(ours, torch.Tensor) else ours.dense()
    torch.testing.assert_close(dense, _ct_reference(raw, tensors), atol=0, rtol=0)
    assert (dense - w).abs().max() < 0.25 * w.abs().max()        # and it is the weight, roughly


def _gptq_reference(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """AutoGPTQ's dequantization (its torch QuantLinear, v1 format): shift each packed word by
    every bit offset, add one to the zeros and mask, index scales and zeros by g_idx."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    mask = (1 << bits) - 1
    zeros = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    zeros = torch.bitwise_and(zeros + 1, mask).reshape(t["scales"].shape)
    weight = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight, mask).reshape(-1, weight.shape[2])      # [K, N]
    g = t["g_idx"].long()
    return (t["scales"][g] * (weight - zeros[g])).t().float()


def _awq_reference(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """AutoAWQ's reference dequantization: unpack nibbles in order, undo its column order
    (0 4 1 5 2 6 3 7), then (w - z) * s per group."""
    shifts = torch.arange(0, 32, 4)
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack_cols(words):
        vals = torch.bitwise_right_shift(words[:, :, None], shifts[None, None, :]).to(torch.int8).view(words.shape[0], -1)
        order = torch.arange(vals.shape[-1]).view(-1, 8)[:, reverse].view(-1)
        return vals[:, order] & 0xF

    iw, iz = unpack_cols(t["qweight"]), unpack_cols(t["qzeros"])
    iz = iz.repeat_interleave(group, 0)
    s = t["scales"].repeat_interleave(group, 0)
    return ((iw - iz) * s).t().float()


def test_gptq_and_awq_layers_unpack_as_their_reference_code_dequantizes_them():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    for bits in (4, 8):
        qc = parse_quant_config({"quant_method": "gptq", "bits": bits, "group_size": 32, "sym": bits == 4})
        t = quantize_weight(w, qc, torch.float32)
        torch.testing.assert_close(unpack(qc, t, 48, 128).dense(), _gptq_reference(t, bits), atol=0, rtol=0)
    qc = parse_quant_config(scheme_config("awq", 32))
    t = quantize_weight(w, qc, torch.float32)
    assert list(AWQ_ORDER) == [0, 2, 4, 6, 1, 3, 5, 7]
    torch.testing.assert_close(unpack(qc, t, 48, 128).dense(), _awq_reference(t, 32), atol=0, rtol=0)


def test_gptq_act_order_maps_each_column_to_its_group():
    """desc_act: g_idx sends columns to groups out of order; the unpacked weight (and the int4
    kernel, which sorts the columns into runs once) follow it."""
    n, k, group = 32, 128, 32
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)].to(torch.int32)
    t = {"qweight": pack_words(q, 4).t().contiguous(), "qzeros": pack_words((zeros - 1).t() & 15, 4),
         "scales": scales.t().contiguous(), "g_idx": g_idx}
    qc = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": True, "sym": False})
    unpacked = unpack(qc, t, n, k)
    want = _gptq_reference(t, 4)
    torch.testing.assert_close(unpacked.dense(), want, atol=0, rtol=0)
    kernel = make_matmul(unpacked, torch.float32, "quantized")
    assert isinstance(kernel, Int4Matmul) and kernel.perm is not None
    x = torch.randn(5, k, generator=g)
    torch.testing.assert_close(kernel(x), x @ want.t(), atol=1e-5, rtol=1e-5)
    # Without act order in the config such a g_idx is refused rather than misread.
    with pytest.raises(ValueError, match="act order"):
        unpack(parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": group}), t, n, k)


def test_fp8_blocks_dequantize_block_by_block():
    """DeepSeek-V3's weight_dequant: each [bn, bk] block of the FP8 weight times its scale,
    blocks at the edges cut short."""
    qc = parse_quant_config({"quant_method": "fp8", "weight_block_size": [32, 64]})
    w = torch.randn(80, 150, generator=torch.Generator().manual_seed(4))
    t = quantize_weight(w, qc, torch.float32)
    assert t["weight"].dtype == torch.float8_e4m3fn and t["weight_scale_inv"].shape == (3, 3)
    want = torch.empty(80, 150)
    for i in range(3):
        for j in range(3):
            blk = t["weight"][i * 32:(i + 1) * 32, j * 64:(j + 1) * 64].float()
            want[i * 32:(i + 1) * 32, j * 64:(j + 1) * 64] = blk * t["weight_scale_inv"][i, j]
    torch.testing.assert_close(unpack(qc, t, 80, 150), want, atol=0, rtol=0)


# ---- kernels ----------------------------------------------------------------------------------------
def _int_weights(n, k, bits, group, symmetric, seed=5):
    g = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    groups = k // (group or k)
    q = torch.randint(0, top + 1, (n, k), generator=g, dtype=torch.int32)
    zero = (torch.full((n, groups), float(1 << bits - 1)) if symmetric
            else torch.randint(0, top + 1, (n, groups), generator=g).float())
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    return IntWeights(q, scale, zero, group or k, bits)


@pytest.mark.parametrize("bits,group,symmetric,kind", [
    (4, 32, True, Int4Matmul), (4, 128, False, Int4Matmul), (4, None, True, Int4Matmul),   # per row: groups of 256
    (4, 512, False, Int4Matmul), (4, 16, True, DenseMatmul),      # groups of 16: no int4 kernel takes them
    (8, None, True, Int8Matmul), (8, None, False, DenseMatmul), (8, 64, True, DenseMatmul)])
def test_kernels_compute_the_dequantized_product(bits, group, symmetric, kind):
    w = _int_weights(64, 512, bits, group, symmetric)
    dense = w.dense()
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(6))
    mm = make_matmul(w, torch.float32, "quantized")
    assert isinstance(mm, kind)
    torch.testing.assert_close(mm(x), x @ dense.t(), atol=2e-5, rtol=1e-5)
    # bf16 activations (the kernels' fast path, "auto"'s choice): within bf16 rounding.
    mm16 = make_matmul(w, torch.bfloat16, "auto")
    assert isinstance(mm16, kind)
    got = mm16(x.bfloat16()).float()
    assert (got - x @ dense.t()).abs().max() <= 0.02 * (x @ dense.t()).abs().max()
    # fp32 under "auto", and "dense" always: the weight dequantized once.
    assert isinstance(make_matmul(w, torch.float32, "auto"), DenseMatmul)
    assert isinstance(make_matmul(w, torch.bfloat16, "dense"), DenseMatmul)


def test_rows_the_int4_kernel_cannot_pack_fall_back_to_dense():
    w = _int_weights(40, 256, 4, 32, True)        # 40 rows: the CPU kernel packs 16 at a time
    mm = make_matmul(w, torch.bfloat16, "quantized")
    assert isinstance(mm, DenseMatmul)
    assert mm.weight_bytes() == 40 * 256 * 2
    packed = make_matmul(_int_weights(48, 256, 4, 32, True), torch.bfloat16, "quantized")
    assert packed.weight_bytes() < 48 * 256 * 2 / 3          # 4 bits a weight plus a scale and zero per 32


# ---- whole models against transformers ----------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "fp8-block"])
def test_quantized_models_logits_equal_transformers(quantized, scheme):
    """transformers reads these checkpoints itself (compressed-tensors decompresses them, its FP8
    integration dequantizes without a GPU): our quantized kernels give its logits in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(quantized[scheme], dtype=torch.float32)
    ids = _prompt()
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    ours, _ = load_model(quantized[scheme], quant_kernels="quantized")
    assert _matmuls(ours) == {"fp8-block": {"DenseMatmul"}, "w4a16": {"Int4Matmul"}, "w8a16": {"Int8Matmul"}}[scheme]
    torch.testing.assert_close(_logits(ours, ids), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8", "w4a16-asym"])
def test_weights_equal_what_compressed_tensors_decompresses(quantized, scheme):
    """W8A8 schemes: transformers also fake-quantizes activations, which we do not (weight-only),
    so the weights are compared instead; asymmetric W4A16: transformers 5 misreads its packed
    zero points, so compressed-tensors' decompressor is the reference."""
    from safetensors import safe_open

    raw = scheme_config(scheme, GROUP)
    ours, _ = load_model(quantized[scheme], quant_kernels="dense")
    with safe_open(f"{quantized[scheme]}/model.safetensors", "pt") as f:
        for layer, name in ((0, "self_attn.q_proj"), (3, "mlp.down_proj")):
            prefix = f"model.layers.{layer}.{name}"
            tensors = {k[len(prefix) + 1:]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")}
            got = ours.get_submodule(prefix).matmul.weight
            torch.testing.assert_close(got, _ct_reference(raw, tensors), atol=0, rtol=0)


def test_quantized_kernels_and_dense_dequantization_agree(quantized):
    ids = _prompt(seed=1)
    for scheme in ("gptq", "awq", "w4a16-asym", "w8a8"):
        dense, _ = load_model(quantized[scheme], quant_kernels="dense")
        kernel, _ = load_model(quantized[scheme], quant_kernels="quantized")
        assert _matmuls(dense) == {"DenseMatmul"} and _matmuls(kernel) <= {"Int4Matmul", "Int8Matmul"}
        torch.testing.assert_close(_logits(kernel, ids), _logits(dense, ids), atol=1e-4, rtol=1e-5)
    # The same RTN values in two layouts are the same model: GPTQ's symmetric = W4A16's.
    gptq, _ = load_model(quantized["gptq"], quant_kernels="dense")
    w4, _ = load_model(quantized["w4a16"], quant_kernels="dense")
    torch.testing.assert_close(_logits(gptq, ids), _logits(w4, ids), atol=0, rtol=0)


def test_bf16_auto_keeps_weights_packed_and_stays_near_dense(quantized):
    ids = _prompt(seed=2)
    packed, _ = load_model(quantized["w4a16"], dtype=torch.bfloat16)
    dense, _ = load_model(quantized["w4a16"], dtype=torch.bfloat16, quant_kernels="dense")
    assert _matmuls(packed) == {"Int4Matmul"} and _matmuls(dense) == {"DenseMatmul"}
    bytes_packed = sum(m.weight_bytes() for m in packed.modules() if isinstance(m, QuantLinear))
    bytes_dense = sum(m.weight_bytes() for m in dense.modules() if isinstance(m, QuantLinear))
    assert bytes_packed * 3 < bytes_dense
    a, b = _logits(packed, ids), _logits(dense, ids)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_a_moe_models_experts_quantized_equal_transformers(tmp_path):
    """Qwen2-MoE: every expert and the shared expert quantized, the router and the shared
    expert's gate dense (as the checkpoint stores them)."""
    from transformers import AutoModelForCausalLM

    src = write_tiny_model(tmp_path / "moe", seed=1, architectures=["Qwen2MoeForCausalLM"], hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
                           decoder_sparse_step=1, moe_intermediate_size=96, shared_expert_intermediate_size=192)
    dst = str(tmp_path / "moe-w4")
    quantize_checkpoint(str(src), dst, "w4a16", 32)
    ours, _ = load_model(dst, quant_kernels="quantized")
    moe = ours.model.layers[0].mlp
    assert isinstance(moe.experts["0"].down_proj, QuantLinear) and isinstance(moe.shared_expert.up_proj, QuantLinear)
    assert type(moe.gate) is torch.nn.Linear and type(moe.shared_expert_gate) is torch.nn.Linear
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    ids = _prompt(seed=3)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(_logits(ours, ids), want, atol=1e-4, rtol=1e-5)


# ---- loader refusals ------------------------------------------------------------------------------------
def _edit(src: str, dst, config_edit=None, tensor_edit=None) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config_edit:
        with open(f"{dst}/config.json") as f:
            cfg = json.load(f)
        config_edit(cfg)
        with open(f"{dst}/config.json", "w") as f:
            json.dump(cfg, f)
    if tensor_edit:
        tensors = load_file(f"{dst}/model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, f"{dst}/model.safetensors")
    return str(dst)


def test_the_loader_refuses_checkpoints_that_do_not_fit_their_config(quantized, tmp_path):
    src = quantized["w4a16"]
    name = "model.layers.0.self_attn.q_proj"
    # A quantized output head (the config does not ignore lm_head).
    def quant_head(t):
        t.update({f"lm_head.{k}": v for k, v in quantize_weight(t.pop("lm_head.weight"), parse_quant_config(
            scheme_config("w4a16", GROUP)), torch.float32).items()})
    bad = _edit(src, tmp_path / "head", lambda c: c["quantization_config"].update(ignore=[]), quant_head)
    with pytest.raises(CheckpointError, match="quantized lm_head is not supported"):
        load_model(bad)
    # Packed weights stored as floats.
    bad = _edit(src, tmp_path / "float", tensor_edit=lambda t: t.update(
        {f"{name}.weight_packed": t[f"{name}.weight_packed"].float()}))
    with pytest.raises(CheckpointError, match=rf"{name}\.weight_packed.*expects integers"):
        load_model(bad)
    # A group size the tensors were not written with: the scales' shape says so.
    bad = _edit(src, tmp_path / "group", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"]
                .update(group_size=32))
    with pytest.raises(CheckpointError, match=r"shape mismatch for tensor 'model\.layers\.0\.\w+\.\w+\.weight_scale'"):
        load_model(bad)
    # A dense weight beside the packed one.
    with pytest.raises(CheckpointError, match=rf"unexpected tensor '{name}\.weight'"):
        load_model(_edit(src, tmp_path / "dense", tensor_edit=lambda t: t.update({f"{name}.weight": torch.zeros(256, 256)})))
