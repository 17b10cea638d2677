"""Layer splits that cut inside a decoder-only block (``--split-blocks``): the halves ``gpt_attn`` / ``gpt_mlp``.

The analytic halves add up to the block; the split uses them only where the slowest stage gets more than
``SPLIT_GAIN`` faster (GPT-1.3B on 4 stages: its head costs about two blocks); a layout with a cut inside a
block travels between ranks and is checked against the model; token-slice costs price halves like the
analytic model; chained stages cut inside a block equal the unsplit model under full recomputation too
(without recomputation: tests/unit/models/test_stage_split.py and test_llama_family.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.training.config import TrainConfig
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.models.families import run_cost_model
from dynabatch.cost.hardware import hardware_spec
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.model_specs import join_halves, split_halves
from dynabatch.cost.stages import StageCostModel, StageLayout
from dynabatch.cost.layer_split import SPLIT_GAIN, balanced_layout

FIELDS = ("fwd_time_s", "bwd_time_s", "fwd_flops", "stored_activation_bytes")


HALVES = {"gpt-1.3b": ("gpt", "gpt_attn", "gpt_mlp"), "llama3-8b": ("gpt", "gpt_attn", "gpt_mlp"),
          "t5-large": ("t5_encoder", "t5_enc_attn", "t5_enc_ffn")}


@pytest.mark.parametrize("preset", sorted(HALVES))
@pytest.mark.parametrize("recompute", [False, True])
def test_analytic_halves_add_up_to_the_block(preset, recompute):
    model = AnalyticCostModel.from_names(preset, "a100-40gb", recompute=recompute)
    whole, first, second = HALVES[preset]
    b, e = np.array([1.0, 4.0, 16.0]), np.array([2048.0, 512.0, 64.0])
    d = e / 4 if whole == "t5_encoder" else None
    for pairs in (None, AttentionPairs(b * e * e / 3, 0 * b, 0 * b, calls=(np.array([1.0, 3.0, 9.0]), 0 * b, 0 * b))):
        block = model.layer_cost(whole, b, e, d, pairs=pairs)
        attn, mlp = (model.layer_cost(k, b, e, d, pairs=pairs) for k in (first, second))
        for f in FIELDS[:3] + (() if recompute else FIELDS[3:]):
            np.testing.assert_allclose(getattr(attn, f) + getattr(mlp, f), getattr(block, f), rtol=1e-12)
        assert np.all(attn.fwd_time_s > 0.2 * block.fwd_time_s) and np.all(mlp.fwd_time_s > 0.2 * block.fwd_time_s)
        if not recompute:  # the block's transient is the larger of its two halves'
            np.testing.assert_allclose(np.maximum(attn.peak_extra_bytes, mlp.peak_extra_bytes), block.peak_extra_bytes)
    assert model.param_count(first) + model.param_count(second) == model.param_count(whole)
    terms = model.recompute_terms([first, second], b, e, d)
    block_terms = model.recompute_terms([whole], b, e, d)
    for f in ("full_extra_s", "selective_extra_s", "selective_freed_bytes"):
        np.testing.assert_allclose(getattr(terms, f), getattr(block_terms, f), rtol=1e-12)
    residual = model._residual_bytes() * b * e * model.spec.d_model  # each checkpointed half keeps its own input
    np.testing.assert_allclose(terms.full_freed_bytes, block_terms.full_freed_bytes - residual, rtol=1e-12)
    if whole == "t5_encoder":  # the encoder's mask and bias: built by a stage with an attention half, not an FFN half
        np.testing.assert_allclose(model.context_cost([first], b, e, d), model.context_cost([whole], b, e, d))
        assert model.context_cost([second], b, e, d) == (0.0, 0.0)
        alone = model.recompute_terms([second], b, e, d)  # an FFN half keeps no position-bias window
        np.testing.assert_allclose(alone.full_freed_bytes, model._stored(second, b, e, d)
                                   - model._residual_bytes() * b * e * model.spec.d_model)


def _slowest(model, layout) -> float:
    costs = StageCostModel(model, layout, 40 * 2**30).per_stage(4.0, 512.0, None)
    return float((costs.fwd_s + costs.bwd_s).max())


def test_split_cuts_inside_a_block_where_whole_blocks_balance_badly():
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    whole = balanced_layout(model, 4)
    halved = balanced_layout(model, 4, split_blocks=True)
    assert whole.describe() == "embedding+gptx6 | gptx7 | gptx7 | gptx4+lm_head"
    assert any(k in ("gpt_attn", "gpt_mlp") for s in halved.stages for k in s)
    assert split_halves([k for s in halved.stages for k in s]) == split_halves(model.layer_kinds())
    assert all(join_halves(s) == s for s in halved.stages)  # a half only where a cut falls
    assert _slowest(model, halved) < (1 - 0.04) * _slowest(model, whole)  # 7 block-times -> about 6.6


def test_split_keeps_whole_blocks_when_halves_gain_too_little():
    gpt = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    whole, halved = balanced_layout(gpt, 2), balanced_layout(gpt, 2, split_blocks=True)
    assert halved == whole
    assert _slowest(gpt, balanced_layout(gpt, 2)) <= _slowest(gpt, whole) * (1 + SPLIT_GAIN)
    t5 = AnalyticCostModel.from_names("t5-large", "a100-40gb")  # 24 + 24 blocks on 4 stages: whole blocks suffice
    assert balanced_layout(t5, 4, split_blocks=True) == balanced_layout(t5, 4)


def test_t5_split_cuts_an_encoder_block_where_long_inputs_make_attention_dominate():
    """t5-d256 on 2 stages with 2,048-token inputs: attention is most of an encoder block, so whole blocks put
    3 of 4 encoder blocks before the decoder stage's (measured 2.09 / 1.60 s in the 2026-12-05
    benchmark); moving the third block's FFN half over balances them better."""
    from dynabatch.models.families import analytic_spec
    from dynabatch.models.presets import build_model

    model = AnalyticCostModel(analytic_spec(build_model("t5-d256", vocab_size=8192).config), hardware_spec("cpu"))
    shape = (1, 2048, 512)
    whole, halved = balanced_layout(model, 2, shape), balanced_layout(model, 2, shape, split_blocks=True)
    assert whole.stages[0] == ("embedding", "t5_encoder", "t5_encoder", "t5_encoder")
    assert halved.stages[0][-1] == "t5_enc_attn" and halved.stages[1][0] == "t5_enc_ffn"
    assert split_halves([k for s in halved.stages for k in s]) == split_halves(model.layer_kinds())

    def slowest(layout):
        costs = StageCostModel(model, layout, 40 * 2**30).per_stage(*map(float, shape))
        return float((costs.fwd_s + costs.bwd_s).max())

    assert slowest(halved) < (1 - SPLIT_GAIN) * slowest(whole)


def test_split_needs_a_layer_model_that_prices_halves():
    class WholeBlocksOnly:  # a layer model that knows whole blocks alone, as profiled tables do
        def __init__(self):
            self.inner = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")

        def layer_kinds(self):
            return self.inner.layer_kinds()

        def stage_cost(self, kinds, *args, **kwargs):
            return self.inner.stage_cost(kinds, *args, **kwargs)

    with pytest.raises(ValueError, match="does not price block halves"):
        balanced_layout(WholeBlocksOnly(), 4, split_blocks=True)
    with pytest.raises(ValueError, match="split_blocks on cuts inside blocks.*drop cost_profile or use split_blocks auto"):
        TrainConfig.of(model="gpt2-tiny", split_blocks="on", cost_profile="profile.json")
    resolved = {(s, p): TrainConfig.of(model="gpt2-tiny", split_blocks=s, cost_profile=p).cuts_inside_blocks
                for s in ("auto", "off") for p in (None, "profile.json")}
    assert resolved == {("auto", None): True, ("auto", "profile.json"): False, ("off", None): False,
                        ("off", "profile.json"): False}


def test_run_layout_with_a_cut_inside_a_block_round_trips():
    from dynabatch.training.run_layout import RunLayout
    from dynabatch.schedule.placement import Placement

    kinds = ["embedding", "gpt", "gpt", "gpt", "lm_head"]
    layout = StageLayout((("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
    run = RunLayout(Placement.parse("linear", 3), layout, split="data")
    back = RunLayout.decode(run.encode(), kinds, 3)
    assert back.layout == layout and back.split == "data"
    whole = RunLayout(Placement.parse("linear", 2), StageLayout((("embedding", "gpt", "gpt"), ("gpt", "lm_head"))))
    assert RunLayout.decode(whole.encode(), kinds, 2).layout == whole.layout
    t5 = ["embedding", "t5_encoder", "t5_encoder", "decoder_embedding", "t5_decoder", "t5_decoder", "lm_head"]
    for stages in ((("embedding", "t5_encoder", "t5_enc_attn"), ("t5_enc_ffn", *t5[3:])),
                   (tuple(t5[:3]), tuple(t5[3:]))):
        run = RunLayout(Placement.parse("linear", 2), StageLayout(stages))
        assert RunLayout.decode(run.encode(), t5, 2).layout == run.layout


def test_stage_with_a_half_inside_is_refused():
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import build_stage

    model = build_model("gpt2-tiny", vocab_size=512)
    for stages in ((("embedding", "gpt_attn", "gpt_mlp"), ("gpt", "lm_head")),  # halves not joined
                   (("embedding", "gpt_attn"), ("gpt", "lm_head"))):  # a block's MLP half missing
        with pytest.raises(ValueError, match="does not cover"):
            build_stage(model, StageLayout(stages), 0)


def test_slice_costs_price_halves_like_the_analytic_model():
    from dynabatch.plan.slice_costs import AnalyticSliceCostModel

    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    b, s = np.array([1.0, 2.0]), np.array([512.0, 256.0])
    for kinds in (("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt", "lm_head")):
        slices = AnalyticSliceCostModel(model, kinds, 40 * 2**30)
        time, stored, peak = slices.evaluate(b, s, np.zeros(2))
        want = model.stage_cost(list(kinds), b, s)
        np.testing.assert_allclose(time, want.fwd_time_s + want.bwd_time_s, rtol=1e-12)
        np.testing.assert_allclose(stored, want.stored_activation_bytes, rtol=1e-12)
        np.testing.assert_allclose(peak, want.peak_extra_bytes, rtol=1e-12)
    split = AnalyticSliceCostModel(model, ("gpt_attn", "gpt_mlp"), 40 * 2**30)
    block = AnalyticSliceCostModel(model, ("gpt",), 40 * 2**30)
    c = np.array([1024.0, 3000.0])  # with context keys, the halves still add up to the block
    np.testing.assert_allclose(split.evaluate(b, s, c)[0], block.evaluate(b, s, c)[0], rtol=1e-12)
    np.testing.assert_allclose(split.fwd_flops(b, s, c), block.fwd_flops(b, s, c), rtol=1e-12)
    np.testing.assert_allclose(split.context_kv_bytes(b, c), block.context_kv_bytes(b, c))


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_chained_halves_match_the_unsplit_model_under_full_recompute(name):
    from dynabatch.data.collate import collate_causal, collate_seq2seq
    from dynabatch.models.presets import PAD_ID
    from dynabatch.models.recompute import recompute_mode
    from test_stage_split import ROWS, _check_chained, _model, _samples

    model = _model(name)
    if name == "t5-tiny":
        layout = StageLayout((("embedding", "t5_enc_attn"), ("t5_enc_ffn", "t5_enc_attn"),
                              ("t5_enc_ffn", "decoder_embedding", "t5_decoder", "t5_decoder", "lm_head")))
        mb = collate_seq2seq(_samples(), ROWS["packed"], pad_id=PAD_ID, decoder_start_id=PAD_ID)
    else:
        layout = StageLayout((("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
        mb = collate_causal(_samples(), ROWS["packed"], pad_id=PAD_ID)
    with recompute_mode("full"):
        _check_chained(model, layout, mb)
    assert torch.is_grad_enabled()


def test_t5_halves_keep_what_the_model_prices():
    """Saved activations per stage, measured by the executor's meter, for t5-tiny cut between its encoder blocks
    and inside the second one: the cut moves what the analytic model prices for the FFN half (its norm input and
    FFN tensors) from the first stage to the second, and the total stays (the hand-off is the tensor the FFN's
    norm kept inside the whole block)."""
    from dynabatch.data.collate import collate_seq2seq
    from dynabatch.models.families import analytic_spec
    from dynabatch.models.presets import PAD_ID
    from dynabatch.models.split import build_stages, micro_batch_inputs, pipeline_spec_for
    from dynabatch.engine.memory import SavedActivationMeter
    from test_stage_split import _model, _samples

    model = _model("t5-tiny")
    mb = collate_seq2seq(_samples(), [[i] for i in range(5)], pad_id=PAD_ID, decoder_start_id=PAD_ID)
    decoder = ("decoder_embedding", "t5_decoder", "t5_decoder", "lm_head")
    layouts = {"whole": StageLayout((("embedding", "t5_encoder", "t5_encoder"), decoder)),
               "halves": StageLayout((("embedding", "t5_encoder", "t5_enc_attn"), ("t5_enc_ffn", *decoder)))}
    measured = {}
    for name, layout in layouts.items():
        spec, received, kept = pipeline_spec_for(model, layout), {}, []
        for s, stage in enumerate(build_stages(model, layout)):
            recv = {k: v.detach().requires_grad_() for k, v in received.items()}
            with SavedActivationMeter(exclude=stage.parameters()) as meter:
                out = stage(recv, micro_batch_inputs(mb, spec, s))
            kept.append(meter.live_bytes)
            received = out.sends
        measured[name] = kept
    b, e = mb.input_ids.shape
    cost = run_cost_model(model.config)
    moved = cost.layer_cost("t5_enc_ffn", b, e, mb.decoder_input_ids.shape[1]).stored_activation_bytes
    assert measured["whole"][0] - measured["halves"][0] == pytest.approx(moved, rel=0.1)
    assert measured["halves"][1] - measured["whole"][1] == pytest.approx(moved, rel=0.1)
    assert sum(measured["halves"]) == pytest.approx(sum(measured["whole"]), rel=0.01)
    assert analytic_spec(model.config).num_layers == 2


@pytest.mark.parametrize("halves_faster", [True, False])
def test_the_data_split_cuts_inside_a_block_only_where_the_planned_steps_are_shorter(halves_faster):
    """Balancing summed compute can bring out a bubble the lighter stage hid (T5 at 2,048 tokens on this CPU), so
    the start-up choice plans the whole-block split too and keeps the cut only when its predicted steps are
    shorter (gpt2-mini on 3 stages: the data split cuts its third block)."""
    from types import SimpleNamespace

    from dynabatch.models.presets import build_model
    from dynabatch.training.run_layout import choose_run_layout

    model = build_model("gpt2-mini", vocab_size=512)
    cfg = TrainConfig.of(model="gpt2-mini", stages=3, placement="linear", layer_split="data", split_blocks="auto")
    shapes = np.array([[4, 512, 0], [16, 128, 0], [1, 1024, 0]], dtype=float)
    planned = []

    def cut(layout) -> bool:
        return any(k in ("gpt_attn", "gpt_mlp") for s in layout.stages for k in s)

    def preview(own, layout):
        planned.append(layout)
        seconds = 1.0 if cut(layout) == halves_faster else 1.1
        return [SimpleNamespace(shapes=[shapes], pairs=None, predicted_makespan_s=seconds)]

    run = choose_run_layout(cfg, model, run_cost_model(model.config), preview)
    assert cut(run.layout) == halves_faster and run.split == "data"
    # both the whole-block split and the cut one were planned (the reference split here is the cut one), each once
    assert {cut(layout) for layout in planned} == {False, True} and len(planned) == len(set(planned))


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_an_attention_half_hands_the_slice_cache_under_its_attention_s_keyword(preset):
    """A block's KV-cache keyword is resolved against the module that receives it (:mod:`dynabatch.models.hf_compat`).
    An attention half forwards its keywords to the block's attention, but the keyword was resolved against the half,
    whose ``forward(hidden, **kwargs)`` names none: it got ``past_key_values``, which transformers 5.25's attention
    takes only as a deprecated alias (a FutureWarning on every stage cut inside a block) and 5.40 drops (the slice's
    context silently unused)."""
    import warnings

    from transformers import AutoModelForCausalLM

    from dynabatch.models.block_parts import ATTENTION_HALF, block_parts
    from dynabatch.models.families.llama import LLAMA_BLOCK
    from dynabatch.models.gpt2_stages import GPT2_BLOCK
    from dynabatch.models.hf_compat import cache_kwargs
    from dynabatch.models.presets import build_config
    from dynabatch.models.slice_kv import SliceCache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(preset, vocab_size=64))
    llama = preset.startswith("llama")
    blocks = model.model.layers if llama else model.transformer.h
    (half,) = block_parts(blocks, StageLayout(((ATTENTION_HALF,),)), 0, LLAMA_BLOCK if llama else GPT2_BLOCK)
    hidden = torch.randn(1, 5, model.config.hidden_size)
    extra = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(5)[None])} if llama else {}
    cache = SliceCache(None, [0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        half(hidden, attention_mask=None, **extra, **cache_kwargs(half, cache))
    assert cache.own_keys[0] is not None  # the attention called the cache's update hook
