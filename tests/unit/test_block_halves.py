"""Layer splits that cut inside a decoder-only block (``--split-blocks``): the halves ``gpt_attn`` / ``gpt_mlp``.

The analytic halves add up to the block; the split uses them only where the slowest stage gets more than
``SPLIT_GAIN`` faster (GPT-1.3B on 4 stages: its head costs about two blocks); a layout with a cut inside a
block travels between ranks and is checked against the model; token-slice costs price halves like the
analytic model; chained stages cut inside a block equal the unsplit model under full recomputation too
(without recomputation: tests/unit/test_stage_split.py and test_llama_family.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.config import TrainConfig
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.stages import SPLIT_GAIN, StageCostModel, StageLayout, balanced_layout, join_halves, split_halves

FIELDS = ("fwd_time_s", "bwd_time_s", "fwd_flops", "stored_activation_bytes")


@pytest.mark.parametrize("preset", ["gpt-1.3b", "llama3-8b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_analytic_halves_add_up_to_the_block(preset, recompute):
    model = AnalyticCostModel.from_names(preset, "a100-40gb", recompute=recompute)
    b, e = np.array([1.0, 4.0, 16.0]), np.array([2048.0, 512.0, 64.0])
    for pairs in (None, AttentionPairs(b * e * e / 3, 0 * b, 0 * b, calls=(np.array([1.0, 3.0, 9.0]), 0 * b, 0 * b))):
        block = model.layer_cost("gpt", b, e, pairs=pairs)
        attn, mlp = (model.layer_cost(k, b, e, pairs=pairs) for k in ("gpt_attn", "gpt_mlp"))
        for f in FIELDS[:3] + (() if recompute else FIELDS[3:]):
            np.testing.assert_allclose(getattr(attn, f) + getattr(mlp, f), getattr(block, f), rtol=1e-12)
        assert np.all(attn.fwd_time_s > 0.2 * block.fwd_time_s) and np.all(mlp.fwd_time_s > 0.2 * block.fwd_time_s)
        if not recompute:  # the block's transient is the larger of its two halves'
            np.testing.assert_allclose(np.maximum(attn.peak_extra_bytes, mlp.peak_extra_bytes), block.peak_extra_bytes)
    assert model.param_count("gpt_attn") + model.param_count("gpt_mlp") == model.param_count("gpt")
    terms = model.recompute_terms(["gpt_attn", "gpt_mlp"], b, e)
    whole = model.recompute_terms(["gpt"], b, e)
    np.testing.assert_allclose(terms.full_extra_s, whole.full_extra_s, rtol=1e-12)
    np.testing.assert_allclose(terms.selective_extra_s, whole.selective_extra_s, rtol=1e-12)


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
    t5 = AnalyticCostModel.from_names("t5-large", "a100-40gb")  # no halves: the flag changes nothing
    assert balanced_layout(t5, 4, split_blocks=True) == balanced_layout(t5, 4)


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
    from dynabatch.runtime.run_layout import RunLayout
    from dynabatch.schedule.placement import Placement

    kinds = ["embedding", "gpt", "gpt", "gpt", "lm_head"]
    layout = StageLayout((("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
    run = RunLayout(Placement.parse("linear", 3), layout, split="data")
    back = RunLayout.decode(run.encode(), kinds, 3)
    assert back.layout == layout and back.split == "data"
    whole = RunLayout(Placement.parse("linear", 2), StageLayout((("embedding", "gpt", "gpt"), ("gpt", "lm_head"))))
    assert RunLayout.decode(whole.encode(), kinds, 2).layout == whole.layout


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


def test_chained_halves_match_the_unsplit_model_under_full_recompute():
    from dynabatch.data.collate import collate_causal
    from dynabatch.models.presets import PAD_ID
    from dynabatch.models.recompute import recompute_mode
    from test_stage_split import ROWS, _check_chained, _model, _samples

    model = _model("gpt2-tiny")
    layout = StageLayout((("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")))
    with recompute_mode("full"):
        _check_chained(model, layout, collate_causal(_samples(), ROWS["packed"], pad_id=PAD_ID))
    assert torch.is_grad_enabled()
