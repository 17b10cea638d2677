"""Llama-style decoders (Llama, Qwen2, Qwen3, Mistral), Flan-T5 / T5 v1.1 and mT5 through the family registry.

Chained stages equal the unsplit HF model (loss and every gradient, fp32 defaults) for GQA configs
with untied and tied heads on 1-3 stages, padded and packed; packing equals one sample per row (the
rotary positions restart in every packed sample); the registry refuses unsupported models by name.
"""

from __future__ import annotations

import pytest
import torch

from dynabatch.cost.stages import StageLayout
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.models.families import check_length_limit, family_for_config, get_family
from dynabatch.models.forward import forward_loss, per_sample_losses
from dynabatch.models.presets import PAD_ID
from dynabatch.models.split import build_stages, layout_for, pipeline_spec_for
from family_configs import build, decoder_config, t5_config
from test_stage_split import ROWS, _check_chained, _samples

DECODER_CASES = [
    ("llama", 1, False), ("llama", 2, False), ("llama", 3, True),
    ("qwen2", 2, False), ("qwen2", 3, True), ("qwen3", 2, False), ("mistral", 2, False),
]


@pytest.mark.parametrize("packing", ["padded", "packed"])
@pytest.mark.parametrize("model_type,num_stages,tie", DECODER_CASES)
def test_decoder_stages_match_unsplit_model(model_type, num_stages, tie, packing):
    model = build(decoder_config(model_type, tie=tie))
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tie
    layout = layout_for(model, num_stages)
    _check_chained(model, layout, collate_causal(_samples(), ROWS[packing], pad_id=PAD_ID))


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True)])
def test_decoder_stages_cut_inside_a_layer_match_unsplit_model(model_type, tie):
    """A stage boundary between a decoder layer's attention and MLP halves (``gpt_attn`` / ``gpt_mlp``)."""
    model = build(decoder_config(model_type, tie=tie, num_layers=2))
    layout = StageLayout((("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
    _check_chained(model, layout, collate_causal(_samples(), ROWS["packed"], pad_id=PAD_ID))


@pytest.mark.parametrize("variant", ["gated", "mt5"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_flan_t5_and_mt5_stages_match_unsplit_model(variant, num_stages):
    model = build(t5_config(variant))
    assert type(model).__name__ == ("MT5ForConditionalGeneration" if variant == "mt5" else "T5ForConditionalGeneration")
    mb = collate_seq2seq(_samples(), ROWS["packed"], pad_id=PAD_ID, decoder_start_id=PAD_ID)
    _check_chained(model, layout_for(model, num_stages), mb)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packing_restarts_rotary_positions(model_type):
    model = build(decoder_config(model_type)).eval()
    samples = _samples()
    packed = collate_causal(samples, ROWS["packed"], pad_id=PAD_ID)
    alone = collate_causal(samples, ROWS["padded"], pad_id=PAD_ID)
    assert int(packed.position_ids[0].max()) < packed.segment_ids[0].bool().sum() - 1  # positions restart
    with torch.no_grad():
        got = per_sample_losses(packed, forward_loss(model, packed))
        want = per_sample_losses(alone, forward_loss(model, alone))
    assert got.keys() == want.keys() and len(got) == len(samples)
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-5)


def test_every_llama_stage_loads_position_ids():
    model = build(decoder_config("llama"))
    spec = pipeline_spec_for(model, layout_for(model, 3))
    assert all("position_ids" in [t.name for t in spec.load_tensors(s, 2, 8, 0)] for s in range(3))
    stages = build_stages(model, layout_for(model, 3))
    assert {n for s in stages for n in s.parameter_map.values()} == {n for n, _ in model.named_parameters()}


def test_registry_names_unsupported_models_and_checks_lengths():
    from transformers import AutoConfig, GPT2Config

    with pytest.raises(ValueError, match=r"model type 'bart' is not supported.*gpt2 \(GPT2LMHeadModel\).*llama"):
        family_for_config(AutoConfig.for_model("bart"))
    cfg = decoder_config("llama", architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification is not supported"):
        family_for_config(cfg)
    assert family_for_config(decoder_config("mistral")) is get_family("llama")
    with pytest.raises(ValueError, match="has only 1024 positions"):
        check_length_limit(GPT2Config(n_positions=1024), 2048)
    with pytest.warns(UserWarning, match="trained for 512 positions"):
        check_length_limit(decoder_config("qwen2"), 1024)
    with pytest.raises(ValueError, match="sliding-window attention over 256 tokens"):
        check_length_limit(decoder_config("mistral", sliding_window=256, max_position_embeddings=4096), 1024)


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True)])
def test_decoder_stages_cut_inside_a_layer_match_unsplit_model(model_type, tie):
    """A stage boundary between a decoder layer's attention and MLP halves (``gpt_attn`` / ``gpt_mlp``)."""
    model = build(decoder_config(model_type, tie=tie, num_layers=2))
    layout = StageLayout((("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
    _check_chained(model, layout, collate_causal(_samples(), ROWS["packed"], pad_id=PAD_ID))


@pytest.mark.parametrize("variant", ["gated", "mt5"])
def test_seq2seq_forward_equals_hf_loss_for_flan_t5_and_mt5(variant):
    model = build(t5_config(variant)).eval()
    mb = collate_seq2seq(_samples()[:1], [[0]], pad_id=PAD_ID, decoder_start_id=PAD_ID)
    with torch.no_grad():
        out = forward_loss(model, mb)
        hf = model(input_ids=mb.input_ids, labels=mb.labels).loss
    torch.testing.assert_close(out.loss_sum / out.num_loss_tokens, hf)


def test_lower_floors_do_not_import_models():
    """cost/, data/, plan/, schedule/ and the presets work without dynabatch.models (one-way imports)."""
    import subprocess
    import sys

    modules = ("dynabatch.cost.profile", "dynabatch.cost.calibrate", "dynabatch.cost.planner_model",
               "dynabatch.data.pipeline", "dynabatch.data.baselines", "dynabatch.plan.step", "dynabatch.schedule.lower",
               "dynabatch.model_presets", "dynabatch.training.workload")
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith('dynabatch.models')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
