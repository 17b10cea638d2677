"""The start-up choice of the layer split and placement (dynabatch.training.run_layout) and the planner's
prediction of virtual-stage steps.

The torchrun path (rank 0 sends the choice, the other ranks build their chunks from it, a resume chooses the
same) is tests/unit/training/test_placement_train.py's; the startup timeout while rank 0 loads is tests/dist/test_faults.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynabatch.training.config import TrainConfig


def _setup(toy_data, **overrides):
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model

    preset = "t5-tiny" if toy_data.family == "seq2seq" else "gpt2-mini"  # 4 blocks each
    cfg = TrainConfig.of(**{"model": preset, "stages": 2, "global_batch_tokens": 1024, "max_input_len": 128,
                            "max_target_len": 32, **overrides})
    model = build_model(preset, vocab_size=toy_data.tokens.vocab_size)
    limits = LengthLimits(toy_data.family, max_input_len=128, max_target_len=32, max_seq_len=128)
    return cfg, model, GlobalBatcher(toy_data, limits, token_budget=cfg.global_batch_tokens)


def _busiest(layer_model, layout, micro_batches) -> float:
    """The largest per-chunk sum of layer times over ``micro_batches`` (what the split minimises)."""
    from dynabatch.cost.layer_split import layer_times

    kinds = [k for s in layout.stages for k in s]
    times = layer_times(layer_model, kinds, None, micro_batches)
    sums, start = [], 0
    for s in layout.stages:
        sums.append(times[start:start + len(s)].sum())
        start += len(s)
    return max(sums)


def test_run_layout_text_round_trip_and_bad_cover():
    from dynabatch.cost.model_specs import layer_kinds
    from dynabatch.models.families import analytic_spec
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.run_layout import RunLayout
    from dynabatch.schedule.placement import Placement

    model = build_model("t5-tiny", vocab_size=300)
    placement = Placement.parse("cyclic", 2)
    run = RunLayout(placement, layout_for(model, 4, placement), split="data")
    kinds = layer_kinds(analytic_spec(model.config))
    back = RunLayout.decode(run.encode(), kinds, 2)
    assert back == run
    with pytest.raises(ValueError, match="covers"):
        RunLayout.decode(run.encode(), kinds[:-1], 2)


@pytest.mark.parametrize("family, overrides, expected", [
    ("t5", {}, ["linear", "cyclic"]),
    ("gpt", {}, ["linear", "interleaved:2"]),
    ("gpt", {"slice_long": True, "model": "gpt2-tiny"}, ["linear", "interleaved:2"]),  # slices run on chunks too
    ("t5", {"calibrate": "quick"}, ["linear", "cyclic"]),  # virtual stages calibrate too
    ("t5", {"stages": 1}, ["linear"]),
    ("gpt", {"zero": 2, "replicas": 2}, ["linear", "interleaved:2"]),  # replicas share one chunk order (planner)
])
def test_auto_candidates_follow_the_flags(family, overrides, expected):
    from dynabatch.training.run_layout import candidate_placements

    cfg = TrainConfig.of(**{"stages": 2, "placement": "auto", **overrides})
    assert [p.describe() for p in candidate_placements(cfg, family == "t5")] == expected
    explicit = TrainConfig.of(stages=2, placement="interleaved:3")
    assert [p.describe() for p in candidate_placements(explicit, False)] == ["interleaved:3"]


@pytest.mark.parametrize("toy_data", ["t5", "gpt2"], indirect=True)
def test_data_split_is_no_worse_than_reference_over_the_sampled_micro_batches(toy_data):
    from dynabatch.models.split import layout_for
    from dynabatch.training.run_layout import SAMPLED_BATCHES, sampled_run_layout
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    cfg, model, batcher = _setup(toy_data, stages=3)
    chosen = sampled_run_layout(cfg, model, toy_data, batcher)
    assert chosen.split == "data" and chosen.placement.describe() == "linear" and chosen.predicted_step_s == {}
    assert batcher.step == 0  # the training stream did not move
    reference = layout_for(model, 3, split_blocks=cfg.cuts_inside_blocks)  # gpt2: a cut inside a block
    cost = planner_cost_model(cfg, model.config, reference)
    planner = StepPlanner(batcher, cfg, cost, toy_data.tokens)
    planned = [planner() for _ in range(SAMPLED_BATCHES)]  # the run's own first batches
    micro_batches = [(p.shapes[0], p.pairs[0]) for p in planned]
    assert _busiest(cost.model, chosen.layout, micro_batches) <= _busiest(cost.model, reference, micro_batches) + 1e-12
    assert sampled_run_layout(cfg, model, toy_data, batcher) == chosen  # deterministic: a resume chooses alike
    ref = sampled_run_layout(dataclasses.replace(cfg, layer_split="reference"), model, toy_data, batcher)
    assert ref.layout == reference and ref.split == "reference"


@pytest.mark.parametrize("toy_data", ["t5", "gpt2"], indirect=True)
def test_auto_placement_takes_virtual_stages_only_past_the_margin(toy_data):
    from dynabatch.training.run_layout import VIRTUAL_MARGIN, sampled_run_layout

    cfg, model, batcher = _setup(toy_data, placement="auto", calibrate="off")
    chosen = sampled_run_layout(cfg, model, toy_data, batcher)
    virtual = "cyclic" if toy_data.family == "seq2seq" else "interleaved:2"
    assert set(chosen.predicted_step_s) == {"linear", virtual}
    assert all(v > 0 for v in chosen.predicted_step_s.values())
    linear = chosen.predicted_step_s["linear"]
    wins = chosen.predicted_step_s[virtual] < (1 - VIRTUAL_MARGIN) * linear  # virtual stages must beat the margin
    assert chosen.placement.describe() == (virtual if wins else "linear")
    assert chosen.layout.num_stages == chosen.placement.num_stages


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
@pytest.mark.parametrize("virtual_over_linear,expected", [(0.97, "linear"), (0.90, "interleaved:2")])
def test_auto_keeps_linear_unless_virtual_stages_are_predicted_faster_by_the_margin(toy_data, virtual_over_linear,
                                                                                   expected):
    from types import SimpleNamespace

    from dynabatch.training.run_layout import VIRTUAL_MARGIN, choose_run_layout

    assert 1 - virtual_over_linear != VIRTUAL_MARGIN
    cfg, model, _ = _setup(toy_data, placement="auto", layer_split="reference")

    def preview(own, layout):  # every sampled step predicted at 1 s on linear
        seconds = 1.0 if own.placement == "linear" else virtual_over_linear
        return [SimpleNamespace(predicted_makespan_s=seconds)] * 2

    chosen = choose_run_layout(cfg, model, None, preview)
    assert chosen.placement.describe() == expected
    assert chosen.predicted_step_s == {"linear": 2.0, "interleaved:2": 2 * virtual_over_linear}


@pytest.mark.parametrize("toy_data", ["t5"], indirect=True)
def test_planner_predicts_and_plan_step_lowers_the_same_placed_order(toy_data):
    """Virtual stages: the planner's prediction is the list schedule with sends priced, and plan_step lowers
    exactly the device orders the planner predicted (as the linear path runs the planner's schedules)."""
    from dynabatch.models.split import layout_for, pipeline_spec_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.step_score import send_time_of
    from dynabatch.schedule.step import lower_step as plan_step
    from dynabatch.training.trainer import planner_cost_model
    from dynabatch.schedule.ir import Op
    from dynabatch.schedule.placement import Placement
    from dynabatch.schedule.virtual import placed_step

    cfg, model, batcher = _setup(toy_data, placement="cyclic", global_batch_tokens=2048)
    placement = Placement.parse("cyclic", 2)
    layout = layout_for(model, 4, placement)
    cost = planner_cost_model(cfg, model.config, layout)
    planned = StepPlanner(batcher, cfg, cost, toy_data.tokens)()
    costs = planned.costs[0]
    memory = cfg.memory_gib * 2**30
    with_sends = placed_step(costs, placement, cost.model_state_bytes, memory, send_time_of(cost))
    free = placed_step(costs, placement, cost.model_state_bytes, memory)
    assert planned.predicted_makespan_s == pytest.approx(with_sends.makespan_s)
    assert with_sends.makespan_s > free.makespan_s  # the hand-offs between devices cost time
    schedule = planned.schedules[0]
    assert schedule.device_orders == with_sends.order
    plans = plan_step([np.asarray(planned.shapes[0])], pipeline_spec_for(model, layout), costs=[costs],
                      memory_limit_bytes=memory, schedules=[schedule], model_state_bytes=cost.model_state_bytes,
                      placement=placement)
    for device, ops in enumerate(schedule.device_orders):
        computed = [("F" if i.op is Op.FORWARD else "B", i.stage, i.micro_batch) for i in plans[device].instructions
                    if i.op in (Op.FORWARD, Op.BACKWARD)]
        assert computed == [tuple(op[:3]) for op in ops]


@pytest.mark.parametrize("toy_data", ["t5"], indirect=True)
def test_the_planners_score_orders_the_step_on_the_placement(toy_data):
    """plan_step picks among its candidate plans by the simulated step; on virtual stages that is the placed order's
    makespan (as the runtime will run it), not a pipeline with one chunk per device."""
    from dynabatch.models.split import layout_for
    from dynabatch.plan.step import plan_step
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.step_score import simulated_step_time
    from dynabatch.training.trainer import planner_cost_model
    from dynabatch.schedule.placement import Placement

    cfg, model, batcher = _setup(toy_data, placement="cyclic", global_batch_tokens=2048)
    placement = Placement.parse("cyclic", 2)
    cost = planner_cost_model(cfg, model.config, layout_for(model, 4, placement))
    planned = StepPlanner(batcher, cfg, cost, toy_data.tokens)()
    batch = planned.batch
    lengths = (batch.input_lens, batch.target_lens)
    plan = plan_step(batch.input_lens, batch.target_lens, cost, 2, family="seq2seq", segment_pricing=True)
    memory = cfg.memory_gib * 2**30
    placed = simulated_step_time(cost, None, memory, lengths, placement)(plan)
    as_chunks = simulated_step_time(cost, None, memory, lengths)(plan)  # 4 chunks as 4 devices: shorter
    assert placed > as_chunks
    again = plan_step(batch.input_lens, batch.target_lens, cost, 2, family="seq2seq", segment_pricing=True,
                      score=simulated_step_time(cost, None, memory, lengths, placement))
    assert simulated_step_time(cost, None, memory, lengths, placement)(again) <= placed + 1e-12


@pytest.mark.parametrize("second_faster", [True, False])
def test_the_dynamic_planners_split_is_balanced_again_over_the_plan_it_keeps(second_faster):
    """The dynamic planner keeps the DP's plan or a baseline's, whichever is predicted faster on the split, so the
    data split is balanced again over the plans made on it, and the split whose steps are predicted shortest is kept
    (t5-tiny, 2 stages: planned encoder-heavy on the reference split, balanced for it, the planner then cuts
    decoder-heavy micro-batches there, and the split balanced for those is predicted shorter, or not). A baseline's
    micro-batches do not depend on the split: one balancing, one plan."""
    from types import SimpleNamespace

    from dynabatch.cost.layer_split import placement_layout
    from dynabatch.models.families import run_cost_model
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.schedule.placement import Placement
    from dynabatch.training.run_layout import choose_run_layout

    model = build_model("t5-tiny", vocab_size=512)
    layer_model = run_cost_model(model.config)
    linear = Placement.parse("linear", 2)
    shapes = {"encoder-heavy": np.array([[4, 128, 128]], dtype=float), "decoder-heavy": np.array([[4, 8, 512]], dtype=float)}
    reference = layout_for(model, 2, linear, False)
    first, second = (placement_layout(layer_model, linear, [(shapes[k], None)]) for k in ("encoder-heavy", "decoder-heavy"))
    assert len({reference, first, second}) == 3
    plans = {reference: ("encoder-heavy", 1.3), first: ("decoder-heavy", 1.2),
             second: ("decoder-heavy", 1.0 if second_faster else 1.25)}

    def run(method: str):
        planned = []

        def preview(own, layout):
            planned.append(layout)
            kind, seconds = plans[layout]
            return [SimpleNamespace(shapes=[shapes[kind]], pairs=None, predicted_makespan_s=seconds)]

        cfg = TrainConfig.of(model="t5-tiny", stages=2, placement="linear", layer_split="data", split_blocks="off",
                             method=method)
        return choose_run_layout(cfg, model, layer_model, preview), planned

    chosen, planned = run("dynamic")
    assert chosen.layout == (second if second_faster else first) and chosen.split == "data"
    assert planned == [reference, first, second]  # each split planned once
    chosen, planned = run("length_grouped")
    assert chosen.layout == first and planned == [reference]
