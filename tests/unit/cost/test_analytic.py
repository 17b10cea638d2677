"""Analytic cost model: hand-counted FLOPs, HF parameter counts, preset sizes, shape behaviour."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.hardware import HARDWARE_PRESETS, hardware_spec
from dynabatch.models.families import analytic_spec
from dynabatch.cost.model_specs import (
    PRESETS,
    TransformerSpec,
    layer_kinds,
    model_spec,
    num_params,
)

A100 = hardware_spec("a100-80gb")
# Small shapes; the T5 one has an attention width (4 x 8 = 32) different from d_model (64).
GPT_SMALL = TransformerSpec("gpt", d_model=64, num_heads=4, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=0,
                            vocab_size=100, max_positions=32)
T5_SMALL = TransformerSpec("t5", d_model=64, num_heads=4, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=3,
                           vocab_size=100)
T5_GATED = TransformerSpec("t5", d_model=64, num_heads=4, d_kv=8, d_ff=96, num_layers=2, num_decoder_layers=2,
                           vocab_size=100, gated_ffn=True, tie_embeddings=False)


def test_gpt_block_flops_match_hand_count():
    b, T, d, h, dkv, f = 2, 8, 64, 4, 16, 256
    qkv = 2 * (b * T) * d * (3 * h * dkv)  # 2*16*64*192 = 393216
    scores = 2 * b * h * T * T * dkv  # QK^T: 2*2*4*8*8*16 = 16384
    context = 2 * b * h * T * T * dkv  # AV: 16384
    out_proj = 2 * (b * T) * (h * dkv) * d  # 131072
    ffn = 2 * (b * T) * d * f + 2 * (b * T) * f * d  # 524288 + 524288
    assert qkv + scores + context + out_proj + ffn == 1_605_632
    cost = AnalyticCostModel(GPT_SMALL, A100).layer_cost("gpt", b, T)
    assert cost.fwd_flops == 1_605_632


def test_t5_decoder_block_flops_match_hand_count():
    b, E, D, d, h, dkv, f = 2, 10, 6, 64, 4, 8, 128
    a = h * dkv  # 32
    self_attn = 2 * (b * D) * d * (3 * a) + 2 * b * h * D * D * dkv * 2 + 2 * (b * D) * a * d
    #         = 147456                      + 4608 * 2                  + 49152            = 205824
    cross_attn = 2 * (b * D) * d * a + 2 * (b * E) * d * (2 * a) + 2 * b * h * D * E * dkv * 2 + 2 * (b * D) * a * d
    #          = 49152                + 163840                     + 7680 * 2                    + 49152   = 277504
    ffn = 2 * (b * D) * d * f * 2  # 393216
    assert (self_attn, cross_attn, ffn) == (205_824, 277_504, 393_216)
    cost = AnalyticCostModel(T5_SMALL, A100).layer_cost("t5_decoder", b, E, D)
    assert cost.fwd_flops == 205_824 + 277_504 + 393_216


def _hf_t5_config(spec: TransformerSpec, is_decoder: bool):
    from transformers import T5Config

    return T5Config(vocab_size=spec.vocab_size, d_model=spec.d_model, d_kv=spec.d_kv, d_ff=spec.d_ff,
                    num_layers=spec.num_layers, num_decoder_layers=spec.num_decoder_layers, num_heads=spec.num_heads,
                    feed_forward_proj="gated-gelu" if spec.gated_ffn else "relu",
                    tie_word_embeddings=spec.tie_embeddings, is_decoder=is_decoder)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("spec", [T5_SMALL, T5_GATED], ids=["relu", "gated"])
def test_t5_param_counts_match_hf(spec):
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    model = AnalyticCostModel(spec, A100)
    assert model.param_count("t5_encoder") == _count(T5Block(_hf_t5_config(spec, is_decoder=False)))
    assert model.param_count("t5_decoder") == _count(T5Block(_hf_t5_config(spec, is_decoder=True)))
    hf_model = T5ForConditionalGeneration(_hf_t5_config(spec, is_decoder=False))
    # transformers 5 always ties T5's head (v1.1 checkpoints included); the spec follows the config.
    hf_spec = analytic_spec(hf_model.config)
    assert hf_spec.ffn_saved == (7.0 if spec.gated_ffn else 1.0)  # gated gelu_new / relu, measured (activation_memory)
    assert replace(hf_spec, ffn_saved=0.0) == replace(spec, tie_embeddings=hf_model.config.tie_word_embeddings)
    assert num_params(hf_spec) == _count(hf_model)
    untied_head = 0 if spec.tie_embeddings or hf_spec.tie_embeddings is False else spec.vocab_size * spec.d_model
    assert model.num_params() == _count(hf_model) + untied_head


def test_gpt_param_counts_match_hf():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=256)
    model = AnalyticCostModel(GPT_SMALL, A100)
    assert model.param_count("gpt") == _count(GPT2Block(config))
    assert model.num_params() == _count(GPT2LMHeadModel(config))
    # HF's gelu_new keeps five FFN-wide tensors; one c_attn projects Q, K and V
    assert analytic_spec(config) == replace(GPT_SMALL, ffn_saved=5.0, fused_qkv=True)


LLAMA_STYLE_CONFIGS = {
    # The HF config.json fields of the published checkpoints (shapes only).
    "llama3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "llama3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)),
    "llama3-70b": ("llama", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                 intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(LLAMA_STYLE_CONFIGS))
def test_llama_style_presets_match_hf_models_on_meta_device(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = LLAMA_STYLE_CONFIGS[name]
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        hf_params = _count(AutoModelForCausalLM.from_config(config))
    assert num_params(model_spec(name)) == pytest.approx(hf_params, rel=0.005)
    assert replace(analytic_spec(config), ffn_saved=0.0) == model_spec(name)  # presets: the textbook count


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)])
def test_llama_style_layer_param_counts_are_exact(model_type, tie):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96, vocab_size=100, tie_word_embeddings=tie)
    hf_model = AutoModelForCausalLM.from_config(config)
    model = AnalyticCostModel(analytic_spec(config), A100)
    assert model.param_count("gpt") == _count(hf_model.model.layers[0])
    assert model.num_params() == _count(hf_model)
    gqa = model.layer_cost("gpt", 2, 64)
    mha = AnalyticCostModel(replace(model.spec, num_kv_heads=4), A100).layer_cost("gpt", 2, 64)
    assert gqa.fwd_flops < mha.fwd_flops and gqa.stored_activation_bytes < mha.stored_activation_bytes


@pytest.mark.parametrize(
    "name, size, rel",
    [("gpt3-175b", 175e9, 0.02), ("gpt3-13b", 13e9, 0.02), ("gpt-6.7b", 6.7e9, 0.02), ("gpt-2.7b", 2.7e9, 0.03),
     ("gpt-1.3b", 1.3e9, 0.03), ("gpt-760m", 760e6, 0.02), ("gpt-350m", 350e6, 0.10), ("t5-11b", 11e9, 0.05),
     ("t5-3b", 2.85e9, 0.02), ("t5-large", 738e6, 0.02), ("t5-base", 223e6, 0.02), ("t5-v1_1-xxl", 11.1e9, 0.02),
     ("t5-v1_1-xl", 2.85e9, 0.02), ("t5-v1_1-large", 783e6, 0.02), ("t5-v1_1-base", 248e6, 0.02)],
)
def test_preset_sizes(name, size, rel):
    assert num_params(model_spec(name)) == pytest.approx(size, rel=rel)


def test_stored_activations_match_korthikanti_formula():
    spec = model_spec("gpt3-175b")
    s, b, h, a = 2048, 4, spec.d_model, spec.num_heads
    cost = AnalyticCostModel(spec, A100).layer_cost("gpt", b, s)
    assert cost.stored_activation_bytes == s * b * h * (34 + 5 * a * s / h)


def _kinds_and_models():
    return [(AnalyticCostModel(spec, A100, **opts), kind) for spec in (GPT_SMALL, T5_GATED)
            for opts in ({}, {"flash_attention": True, "dropout": False}, {"recompute": True})
            for kind in spec.layer_kinds]


@pytest.mark.parametrize("model, kind", _kinds_and_models())
def test_vectorised_equals_scalar_and_monotone(model, kind):
    rng = np.random.default_rng(0)
    b, E, D = rng.integers(1, 64, 20), rng.integers(1, 512, 20), rng.integers(1, 256, 20)
    D_arg = D if model.spec.family == "seq2seq" else None
    vec = model.layer_cost(kind, b, E, D_arg)
    for i in range(len(b)):
        one = model.layer_cost(kind, int(b[i]), int(E[i]), None if D_arg is None else int(D[i]))
        for field in ("fwd_time_s", "bwd_time_s", "fwd_flops", "stored_activation_bytes", "peak_extra_bytes"):
            assert isinstance(getattr(one, field), float)
            assert getattr(vec, field)[i] == pytest.approx(getattr(one, field), rel=1e-12)
    grid = np.array([1, 2, 4, 8, 16, 64, 256])
    t5 = model.spec.family == "seq2seq"
    uses_d = t5 and kind in ("decoder_embedding", "t5_decoder", "lm_head")
    sweeps = {"b": ((grid, 64, 32), True), "E": ((4, grid, 32), not (t5 and kind == "lm_head"))}
    if t5:
        sweeps["D"] = ((4, 64, grid), uses_d)
    for axis, ((bb, ee, dd), strict) in sweeps.items():
        cost = model.layer_cost(kind, bb, ee, dd if t5 else None)
        for field in ("fwd_time_s", "bwd_time_s", "stored_activation_bytes", "peak_extra_bytes"):
            values = getattr(cost, field)
            assert np.all(np.diff(values) >= 0), (axis, field, values)
            # with recomputation a decoder layer stores only its input; the encoder output is per stage
            if strict and not (field == "stored_activation_bytes" and model.recompute and axis == "E"):
                assert np.all(np.diff(values) > 0), (axis, field, values)


def test_attention_flops_grow_quadratically():
    b, a = 3, GPT_SMALL.d_attn
    gpt = AnalyticCostModel(GPT_SMALL, A100)
    F = lambda T: gpt.layer_cost("gpt", b, T).fwd_flops  # noqa: E731
    T = 100  # second difference of alpha T + beta T^2 is 2 beta T^2, beta = 4 b a (QK^T and AV)
    assert F(3 * T) - 2 * F(2 * T) + F(T) == 2 * (4 * b * a) * T**2
    t5 = AnalyticCostModel(T5_SMALL, A100)
    G = lambda D, E: t5.layer_cost("t5_decoder", b, E, D).fwd_flops  # noqa: E731
    D, E, a = 30, 50, T5_SMALL.d_attn
    assert G(3 * D, E) - 2 * G(2 * D, E) + G(D, E) == 2 * (4 * b * a) * D**2  # decoder self-attention
    assert G(2 * D, 2 * E) - G(2 * D, E) - G(D, 2 * E) + G(D, E) == 4 * b * a * D * E  # cross-attention D x E term
    assert G(D, 3 * E) - 2 * G(D, 2 * E) + G(D, E) == 0  # linear in E


def test_flash_attention_and_recompute_change_memory_and_time():
    spec = model_spec("gpt-1.3b")
    eager, flash = AnalyticCostModel(spec, A100), AnalyticCostModel(spec, A100, flash_attention=True)
    recompute = AnalyticCostModel(spec, A100, recompute=True)
    e, f, r = (m.layer_cost("gpt", 2, 4096) for m in (eager, flash, recompute))
    assert f.stored_activation_bytes < e.stored_activation_bytes / 3
    assert f.fwd_time_s < e.fwd_time_s
    assert r.stored_activation_bytes == 2 * 2 * 4096 * spec.d_model
    assert r.bwd_time_s == pytest.approx(e.bwd_time_s + e.fwd_time_s)
    assert r.peak_extra_bytes == pytest.approx(e.peak_extra_bytes + e.stored_activation_bytes)


def test_large_layer_is_compute_bound_and_tiny_layer_launch_bound():
    model = AnalyticCostModel.from_names("gpt3-175b", "a100-80gb")
    big = model.layer_cost("gpt", 8, 2048)
    achieved = big.fwd_flops / big.fwd_time_s / A100.peak_flops
    assert 0.5 < achieved <= A100.matmul_efficiency
    tiny = model.layer_cost("gpt", 1, 1)
    assert tiny.fwd_time_s > 10 * A100.kernel_launch_s
    assert big.bwd_time_s == pytest.approx(2 * big.fwd_time_s)


def test_stage_cost_sums_layers_and_stores_encoder_output_once():
    model = AnalyticCostModel(T5_SMALL, A100)
    kinds = ["decoder_embedding", "t5_decoder", "t5_decoder", "lm_head"]
    b, E, D = np.array([2, 4]), np.array([16, 32]), np.array([8, 8])
    stage = model.stage_cost(kinds, b, E, D)
    layers = [model.layer_cost(k, b, E, D) for k in kinds]
    ctx_fwd, ctx_bwd = model.context_cost(kinds, b, E, D)  # masks and position bias, once per stage
    assert np.all(ctx_fwd > 0) and np.all(ctx_bwd > 0)
    np.testing.assert_allclose(stage.fwd_time_s, sum(c.fwd_time_s for c in layers) + ctx_fwd)
    np.testing.assert_allclose(stage.bwd_time_s, sum(c.bwd_time_s for c in layers) + ctx_bwd)
    np.testing.assert_allclose(stage.fwd_flops, sum(c.fwd_flops for c in layers))
    encoder_output = 2 * b * E * T5_SMALL.d_model
    np.testing.assert_allclose(stage.stored_activation_bytes,
                               sum(c.stored_activation_bytes for c in layers) + encoder_output)
    np.testing.assert_allclose(stage.peak_extra_bytes, np.max([c.peak_extra_bytes for c in layers], axis=0))
    with pytest.raises(ValueError, match="at least one"):
        model.stage_cost([], 1, 1, 1)


def test_send_bytes_and_time():
    model = AnalyticCostModel.from_names("t5-11b", "h100-80gb")
    assert model.send_bytes("t5_encoder", 8, 512, 128) == 2 * 8 * 512 * 1024
    assert model.send_bytes("t5_decoder", 8, 512, 128) == 2 * 8 * (512 + 128) * 1024
    assert model.send_bytes("lm_head", 8, 512, 128) == 0
    hw = model.hardware
    assert model.send_time(1e9, "inter") == pytest.approx(hw.inter_node_latency_s + 1e9 / (50e9 * hw.link_efficiency))
    np.testing.assert_allclose(model.send_time(np.array([0.0, 1e6]), "intra"),
                               [0.0, hw.intra_node_latency_s + 1e6 / (450e9 * hw.link_efficiency)])


def test_model_state_bytes():
    model = AnalyticCostModel.from_names("gpt3-175b", "h200")
    assert model.model_state_bytes(1000) == 16_000  # mixed-precision Adam, ZeRO paper
    assert model.model_state_bytes(1000, optimizer="sgd", mixed_precision=False) == 8_000
    np.testing.assert_array_equal(model.model_state_bytes(np.array([1, 2]), optimizer="momentum"), [12, 24])


def test_whole_model_layer_kinds():
    assert layer_kinds(model_spec("gpt-350m")) == ["embedding"] + ["gpt"] * 24 + ["lm_head"]
    kinds = layer_kinds(model_spec("t5-base"))
    assert kinds[0] == "embedding" and kinds[13] == "decoder_embedding" and kinds[-1] == "lm_head" and len(kinds) == 27


def test_bad_input_raises_with_valid_options():
    with pytest.raises(ValueError, match="gpt3-175b") as info:
        model_spec("gpt-4")
    assert "t5-11b" in str(info.value)
    with pytest.raises(ValueError, match="a100-40gb, a100-80gb, h100-80gb, h200, cpu"):
        hardware_spec("tpu-v4")
    model = AnalyticCostModel(GPT_SMALL, A100)
    with pytest.raises(ValueError, match="valid kinds: embedding, gpt, lm_head"):
        model.layer_cost("t5_encoder", 1, 8)
    with pytest.raises(ValueError, match="valid optimizers"):
        model.model_state_bytes(10, optimizer="adafactor")
    with pytest.raises(ValueError, match="valid links: intra, inter"):
        model.send_time(10, link="ethernet")
    with pytest.raises(ValueError, match="b must be finite and >= 1"):
        model.layer_cost("gpt", 0, 8)
    with pytest.raises(ValueError, match="needs the decoder length D"):
        AnalyticCostModel(T5_SMALL, A100).layer_cost("t5_decoder", 1, 8)
    with pytest.warns(UserWarning, match="no effect"):
        model.layer_cost("gpt", 1, 8, 4)
    with pytest.raises(ValueError, match="num_decoder_layers must be 0"):
        TransformerSpec("gpt", 64, 4, 16, 256, 2, 2, 100)
    with pytest.raises(ValueError, match="model type None is not supported; dynabatch supports the families"):
        analytic_spec(object())


def test_hardware_presets_are_sane():
    for hw in HARDWARE_PRESETS.values():
        assert hw.memory_bytes > 2**30 and hw.intra_node_bandwidth >= hw.inter_node_bandwidth
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"} <= set(HARDWARE_PRESETS)
    assert set(PRESETS) >= {"t5-base", "t5-large", "t5-3b", "t5-11b", "gpt3-13b", "gpt3-175b"}


def test_analytic_model_does_not_import_torch():
    code = "import sys, dynabatch.cost.analytic as m; assert not {'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_t5_context_cost_bias_is_per_micro_batch_not_per_sample():
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.cost.model_specs import model_spec

    model = AnalyticCostModel(model_spec("t5-base"), hardware_spec("cpu"))
    (f1, b1), (f8, b8) = (model.context_cost(["t5_encoder"], b, 2048, None) for b in (1, 8))
    assert b1 == pytest.approx(b8) and b1 > 0  # the bias backward does not grow with the samples
    assert f8 > f1  # the masks do
    # eight micro-batches of one long sample pay the bias eight times: dearer than one of eight samples
    assert 8 * (f1 + b1) > 1.5 * (f8 + b8)
    # a decoder stage pays its own bias (D x D) and masks; GPT stages and stages without blocks pay nothing
    assert model.context_cost(["t5_decoder", "lm_head"], 1, 64, 512)[1] > model.context_cost(["t5_decoder"], 1, 64, 16)[1]
    gpt = AnalyticCostModel(model_spec("gpt-350m"), hardware_spec("cpu"))
    assert gpt.context_cost(["gpt"], 4, 1024, None) == (0.0, 0.0)
    assert model.context_cost(["lm_head"], 4, 64, 16) == (0.0, 0.0)
    off = AnalyticCostModel(model_spec("t5-base"), hardware_spec("cpu"), context_costs=False)
    on = model.stage_cost(["t5_encoder"], 2, 1024, None).fwd_time_s
    assert off.stage_cost(["t5_encoder"], 2, 1024, None).fwd_time_s == pytest.approx(on - model.context_cost(["t5_encoder"], 2, 1024, None)[0])


def test_a_cuda_run_is_priced_with_its_gpus_preset_and_a_cpu_run_with_cpu():
    """Planning the H200 run with the ``cpu`` preset made one-sample micro-batches look cheapest (0.05x
    packing_free measured); a CUDA device now gets its own preset, matched by name, with its memory."""
    from dynabatch.cost.hardware import HARDWARE_PRESETS, device_hardware, gpu_preset

    gib = 2**30
    assert gpu_preset("NVIDIA H200", 140 * gib).name == "h200"
    assert gpu_preset("NVIDIA H100 80GB HBM3", 79 * gib).name == "h100-80gb"
    assert gpu_preset("NVIDIA A100-SXM4-80GB", 79 * gib).name == "a100-80gb"
    assert gpu_preset("NVIDIA A100-SXM4-40GB", 39 * gib).name == "a100-40gb"
    other = gpu_preset("NVIDIA L4", 22 * gib)
    assert other.memory_bytes == 22 * gib and other.peak_flops == HARDWARE_PRESETS["h100-80gb"].peak_flops
    assert "NVIDIA L4" in other.name
    assert device_hardware("cpu") == HARDWARE_PRESETS["cpu"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lm_head_peak_matches_the_cpu_allocator(dtype):
    """The LM head's stored and peak bytes against one measured forward + backward of the final norm, head and
    our fp32 cross-entropy (the CPU allocator's events replayed, as `dynabatch profile` measures): within 10%
    in fp32 and under bf16 autocast, where the backward's two fp32 logit gradients are the peak (the model
    priced ``(p + 4) bT V`` before and was 20% low in bf16; the H200 peaks measured on 2026-12-04)."""
    import torch

    from dynabatch.cost.measure import _PeakCPU, _SavedBytes
    from dynabatch.models.forward import _token_losses

    n, d, vocab = 1024, 128, 8192
    p = 2 if dtype == "bf16" else 4
    spec = replace(GPT_SMALL, d_model=d, vocab_size=vocab, dtype_bytes=p)
    cost = AnalyticCostModel(spec, A100).layer_cost("lm_head", 1, n)
    torch.manual_seed(0)
    norm, head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)
    params = {q.untyped_storage().data_ptr() for m in (norm, head) for q in m.parameters()}
    for q in (*norm.parameters(), *head.parameters()):
        q.grad = torch.zeros_like(q)  # gradients exist before, as in training (model state)
    hidden, targets = torch.randn(1, n, d, requires_grad=True), torch.randint(0, vocab, (1, n))
    with _PeakCPU() as forward, _SavedBytes(frozenset(params)) as saved, \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = _token_losses(head(norm(hidden)), targets).sum()
    with _PeakCPU() as backward:
        loss.backward()
    weight_copy = vocab * d * 2 if dtype == "bf16" else 0  # autocast's bf16 head weight: a model state
    peak = max(forward.peak, forward.end + backward.peak) - weight_copy
    assert saved.total - weight_copy == pytest.approx(cost.stored_activation_bytes, rel=0.10)
    assert peak == pytest.approx(cost.stored_activation_bytes + cost.peak_extra_bytes, rel=0.10)


def test_ffn_saved_tensors_are_counted_from_the_activation():
    """FFN-wide tensors an activation path keeps for backward, counted under saved-tensor hooks: a fused GELU
    or SiLU keeps its input and output, ReLU only its output, HF's Python ``gelu_new`` five; gated, the up
    projection and the product add two. An unknown name is refused with the valid ones."""
    from dynabatch.cost.activation_memory import ffn_saved_tensors

    counts = {a: (ffn_saved_tensors(a, False), ffn_saved_tensors(a, True))
              for a in ("gelu", "gelu_pytorch_tanh", "silu", "relu", "gelu_new")}
    assert counts == {"gelu": (2, 4), "gelu_pytorch_tanh": (2, 4), "silu": (2, 4), "relu": (1, 3), "gelu_new": (5, 7)}
    assert TransformerSpec("gpt", 64, 4, 16, 256, 2, 0, vocab_size=100).ffn_saved_tensors == 2.0  # 0: textbook
    with pytest.raises(ValueError, match="unknown activation 'swishy'; valid: .*gelu"):
        ffn_saved_tensors("swishy", False)


def test_ffn_saved_tensors_do_not_depend_on_the_callers_grad_mode():
    """The count is cached for the process, so a first call under ``no_grad`` (an evaluation or a Trainer's
    ``predict`` planning its batches) must count what training keeps; it counted 0 there, and every later run of the
    process priced T5's FFN at the textbook 2 tensors instead of ReLU's 1 (a T5 stage's stored bytes 11% high).
    Nor does the count draw from torch's random stream."""
    import torch

    from dynabatch.cost.activation_memory import ffn_saved_tensors

    ffn_saved_tensors.cache_clear()
    try:
        rng = torch.get_rng_state()
        assert ffn_saved_tensors("silu", True) == 4
        assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left as it was
        with torch.no_grad():
            assert ffn_saved_tensors("relu", False) == 1 and ffn_saved_tensors("gelu_new", True) == 7
        with torch.inference_mode():
            assert ffn_saved_tensors("gelu", False) == 2
    finally:
        ffn_saved_tensors.cache_clear()


def test_a_stage_cost_without_flops_is_the_same_stage_cost():
    """``stage_cost(flops=False)`` (what ``StageCostModel`` asks, with its memo) leaves the FLOPs out (NaN) and every
    other figure as it is, bit for bit; a shared memo serves the stages after it."""
    model = AnalyticCostModel.from_names("t5-large", "a100-80gb", recompute=False)
    b, E, D = np.array([1.0, 4.0, 16.0]), np.array([512.0, 128.0, 64.0]), np.array([32.0, 64.0, 16.0])
    kinds = ["embedding", "t5_encoder", "t5_encoder", "decoder_embedding", "t5_decoder", "lm_head"]
    full = model.stage_cost(kinds, b, E, D)
    memo: dict = {}
    lean = model.stage_cost(kinds, b, E, D, layers=memo, flops=False)
    assert np.all(np.asarray(full.fwd_flops) > 0) and np.all(np.isnan(lean.fwd_flops))
    for field in ("fwd_time_s", "bwd_time_s", "stored_activation_bytes", "peak_extra_bytes"):
        assert np.array_equal(getattr(lean, field), getattr(full, field)), field
    again = model.stage_cost(kinds[1:3], b, E, D, layers=memo, flops=False)  # priced from the memo
    assert np.array_equal(again.fwd_time_s, model.stage_cost(kinds[1:3], b, E, D).fwd_time_s)
