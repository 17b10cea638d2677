"""The step planner with moving stage boundaries: each replica's costs carry the moves they were priced with, the
prediction with the online fit prices the same moves, and the fit's features are those of the moved micro-batches."""

from __future__ import annotations


import numpy as np
import pytest

from dynabatch.cost.boundary_prices import move_ratios, moved_features
from dynabatch.cost.online import CalibratedStageCostModel, OnlineFit
from dynabatch.training.config import TrainConfig


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_planned_step_carries_its_moves(toy_data):
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.calibration import RunCalibration
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    cfg = TrainConfig(model="gpt2-mini", stages=2, global_batch_tokens=2048, max_input_len=128, max_target_len=32,
                      plan_ahead=1, plan_costs="base", moving_boundaries=True)
    model = build_model("gpt2-mini", vocab_size=384)
    base = planner_cost_model(cfg, model.config, layout_for(model, 2))
    assert base.moving_boundaries  # --moving-boundaries reaches the planner's model
    fit = OnlineFit(2, False)
    fit.theta0[1, :, 0] = 3.0  # the fit predicts the second stage 3x the base: another choice of moves than the base's
    cal = RunCalibration(base, fit, cfg.plan_ahead, -1)
    limits = LengthLimits("causal", max_input_len=128, max_target_len=32, max_seq_len=128)
    planner = StepPlanner(GlobalBatcher(toy_data, limits, token_budget=2048), cfg, base, toy_data.tokens,
                          calibration=cal)
    moved = 0
    for _ in range(2):  # planning step 2 would wait for step 0's measurements (plan_ahead 1)
        planned = planner()
        for costs, predicted, shapes, pairs, x in zip(planned.costs, planned.predicted_costs, planned.shapes,
                                                      planned.pairs, planned.features):
            assert costs.moves is not None and costs.moves.shape == (len(shapes), 1)
            np.testing.assert_array_equal(predicted.moves, costs.moves)  # predicted as it runs
            arr = np.asarray(shapes, dtype=np.float64)
            plain = CalibratedStageCostModel.of(base)
            laid = plain.features(arr[:, 0], arr[:, 1], arr[:, 2], pairs)
            ratios = move_ratios(plain, arr[:, 0], arr[:, 1], arr[:, 2], pairs)
            np.testing.assert_allclose(x, moved_features(laid, ratios, costs.moves), rtol=1e-12)
            moved += int(np.count_nonzero(costs.moves))
    assert moved > 0


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_the_step_runs_the_moves_that_simulate_shortest(toy_data):
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.plan.boundary_choice import MOVE_CHOOSERS
    from dynabatch.plan.slice_costs import piece_costs
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    cfg = TrainConfig(model="gpt2-mini", stages=2, global_batch_tokens=2048, max_input_len=128, max_target_len=32,
                      plan_ahead=1, moving_boundaries=True, full_determinism=True)
    model = build_model("gpt2-mini", vocab_size=384)
    base = planner_cost_model(cfg, model.config, layout_for(model, 2))
    limits = LengthLimits("causal", max_input_len=128, max_target_len=32, max_seq_len=128)
    planner = StepPlanner(GlobalBatcher(toy_data, limits, token_budget=2048), cfg, base, toy_data.tokens)
    for _ in range(3):
        planned = planner()
        shapes, links = planned.shapes, planned.slice_links
        contexts = [np.zeros(len(s)) for s in shapes]
        options = {"cuts": [None] * len(shapes)}
        for name in MOVE_CHOOSERS:
            options[name] = [piece_costs(base, None, s, c, lk, pr, moves=name).moves
                             for s, c, lk, pr in zip(shapes, contexts, links, planned.pairs)]
        predicted = {name: planner._predict(shapes, links, contexts, planned.pairs, moves_in=moves)[2]
                     for name, moves in options.items()}
        assert planned.predicted_makespan_s == pytest.approx(min(predicted.values()), rel=1e-12)
        ran = [c.moves for c in planned.costs]
        runs = [name for name, moves in options.items() if all(
            (m is None or not np.any(m)) if r is None or not np.any(r) else m is not None and np.array_equal(r, m)
            for r, m in zip(ran, moves))]
        assert runs and predicted[runs[0]] == pytest.approx(min(predicted.values()), rel=1e-12)
