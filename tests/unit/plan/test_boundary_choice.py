"""Moving stage boundaries in the cost model and the planner: what a move costs per stage
(dynabatch.cost.boundary_prices), which moves a replica's micro-batches get (dynabatch.plan.boundary_choice), that
piece_costs is unchanged without them, and that the online fit learns the layout's times from moved observations."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from dynabatch.cost.boundary_moves import DOWN, STAY, UP, BoundaryUnits, boundary_units, run_kinds
from dynabatch.cost.boundary_prices import (
    allowed_moves, move_ratios, move_times, moved_costs, moved_features, stage_move_pairs)
from dynabatch.cost.online import CalibratedStageCostModel, OnlineFit, prior_coefficients
from dynabatch.cost.stages import StageCostModel, StageLayout
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.model_presets import build_config
from dynabatch.models.families import run_cost_model
from dynabatch.plan.boundary_choice import (
    MOVE_CHOOSERS, balance_each, bottleneck, choose_moves, pipeline_leads, stage_sums, with_moves)
from dynabatch.plan.slice_costs import piece_costs

MEMORY = 8 * 2**30


@functools.lru_cache(maxsize=None)
def layer_model(name: str):
    return run_cost_model(build_config(name, vocab_size=384), "cpu")


def stage_model(name: str, stages: int = 2, moving: bool = True, layout: StageLayout | None = None) -> StageCostModel:
    lm = layer_model(name)
    return StageCostModel(lm, layout or balanced_layout(lm, stages), MEMORY, moving_boundaries=moving)


def sample_shapes(seed: int, m: int = 16, seq2seq: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(1, 8, m)
    e = np.where(rng.random(m) < 0.3, rng.integers(256, 1024, m), rng.integers(16, 128, m))
    d = rng.integers(8, 256, m) if seq2seq else np.zeros(m, dtype=np.int64)
    return np.stack([b, e, d], axis=1)


GPT_HALVES = StageLayout((("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt", "gpt", "lm_head")))
CASES = [("gpt2-mini", None, False), ("gpt2-mini", GPT_HALVES, False), ("t5-d256", None, True)]


def every_move(units: BoundaryUnits, m: int) -> np.ndarray:
    """(M, S - 1) moves cycling through every move each boundary allows."""
    return np.array([[allowed_moves(units, s)[(i + s) % len(allowed_moves(units, s))]
                      for s in range(units.num_boundaries)] for i in range(m)], dtype=np.int8)


@pytest.mark.parametrize("name,layout,seq2seq", CASES)
def test_moved_costs_are_the_layer_models_run_kinds(name, layout, seq2seq):
    model = stage_model(name, layout=layout)
    units = boundary_units(model.layout)
    assert units.any
    shapes = sample_shapes(0, 9, seq2seq)
    moves = every_move(units, len(shapes))
    costs = piece_costs(model, None, shapes, [0] * len(shapes), (), moves=moves)
    np.testing.assert_array_equal(costs.moves, moves)
    laid = piece_costs(model, None, shapes, [0] * len(shapes), (), moves=None)
    lm, b, e, d = model.model, *shapes.T.astype(np.float64)
    for m in range(len(shapes)):
        for s in range(model.num_stages):
            lower = int(moves[m, s - 1]) if s > 0 else STAY
            upper = int(moves[m, s]) if s < model.num_stages - 1 else STAY
            want = lm.stage_cost(list(run_kinds(model.layout, s, lower, upper)), b[m], e[m], d[m] if seq2seq else None)
            np.testing.assert_allclose(costs.fwd_s[s, m], want.fwd_time_s, rtol=1e-9)
            np.testing.assert_allclose(costs.bwd_s[s, m], want.bwd_time_s, rtol=1e-9)
            np.testing.assert_allclose(costs.stored_bytes[s, m], want.stored_activation_bytes, rtol=1e-9)
            np.testing.assert_allclose(costs.peak_bytes[s, m], max(want.peak_extra_bytes, laid.peak_bytes[s, m]),
                                       rtol=1e-9)
    np.testing.assert_array_equal(costs.send_bytes, laid.send_bytes)


def test_calibrated_costs_scale_by_the_layer_models_ratio():
    model = stage_model("gpt2-mini")
    theta = prior_coefficients(2, False)
    theta[0, :, 0], theta[1, :, 0] = 2.0, 3.0
    fitted = CalibratedStageCostModel.of(model, theta)
    assert fitted.moving_boundaries and fitted.base.moving_boundaries
    shapes = sample_shapes(1)
    moves = every_move(boundary_units(model.layout), len(shapes))
    base = piece_costs(model, None, shapes, [0] * len(shapes), (), moves=moves)
    scaled = piece_costs(fitted, None, shapes, [0] * len(shapes), (), moves=moves)
    np.testing.assert_allclose(scaled.fwd_s, base.fwd_s * np.array([[2.0], [3.0]]), rtol=1e-9)


def priced_at_the_cut(name, layout, seq2seq: bool, seed: int):
    """A moving-boundaries model, 24 sampled shapes, their costs at the layout's cuts, the move ratios and the
    per-move times the choosers take."""
    model = stage_model(name, layout=layout)
    shapes = sample_shapes(seed, 24, seq2seq)
    laid = piece_costs(model, None, shapes, [0] * len(shapes), (), moves=None)
    ratios = move_ratios(model, *shapes.T.astype(np.float64))
    return model, shapes, laid, ratios, move_times(laid, ratios)


@pytest.mark.parametrize("name,layout,seq2seq", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_choice_is_never_slower_than_the_layout(name, layout, seq2seq, seed):
    model, shapes, laid, ratios, times = priced_at_the_cut(name, layout, seq2seq, seed)
    lead = pipeline_leads(laid)
    moves = choose_moves(times, ratios.units, len(shapes), lead=lead)
    zeros = np.zeros_like(moves)
    assert bottleneck(times, moves, 2, lead) <= bottleneck(times, zeros, 2, lead)
    chosen = piece_costs(model, None, shapes, [0] * len(shapes), ())
    np.testing.assert_array_equal(chosen.moves, moves)
    assert (chosen.fwd_s + chosen.bwd_s).sum(axis=1).max() <= (laid.fwd_s + laid.bwd_s).sum(axis=1).max() * (1 + 1e-12)
    np.testing.assert_array_equal(choose_moves(times, ratios.units, len(shapes), lead=lead), moves)  # deterministic


def slowest_stage(times: dict, moves: np.ndarray) -> np.ndarray:
    """``(M,)`` each micro-batch's time on its slowest stage with ``moves`` (two stages, one boundary)."""
    m = len(moves)
    t0 = np.array([times[(0, 0, int(moves[i, 0]))][i] for i in range(m)])
    t1 = np.array([times[(1, int(moves[i, 0]), 0)][i] for i in range(m)])
    return np.maximum(t0, t1)


@pytest.mark.parametrize("name,layout,seq2seq", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_each_micro_batch_gets_its_own_best_side(name, layout, seq2seq, seed):
    model, shapes, laid, ratios, times = priced_at_the_cut(name, layout, seq2seq, seed)
    moves = balance_each(times, ratios.units, len(shapes))
    allowed = allowed_moves(ratios.units, 0)
    assert set(moves[:, 0].tolist()) <= set(allowed)
    chosen = slowest_stage(times, moves)
    assert np.all(chosen <= slowest_stage(times, np.zeros_like(moves)) * (1 + 1e-12))  # never worse than the cut
    for v in allowed:  # with one boundary the pass is exact: no other side is faster for any micro-batch
        assert np.all(chosen <= slowest_stage(times, np.full_like(moves, v)) * (1 + 1e-12))
    assert bool(np.any(moves)) == bool(np.any(chosen < slowest_stage(times, np.zeros_like(moves))))
    by_name = piece_costs(model, None, shapes, [0] * len(shapes), (), moves="each_micro_batch")
    np.testing.assert_array_equal(by_name.moves, moves)


def test_each_micro_batch_keeps_a_chain_on_one_row_and_the_cut_on_ties():
    m = 8
    times, units = unbalanced_times(m), BoundaryUnits((True,), (True,))
    # stage 0: 3, stage 1: 2 a micro-batch; a down move makes it 2 / 3: the same slowest stage, so each stays
    assert not balance_each(times, units, m).any()
    times[(0, 0, DOWN)] = times[(0, 0, DOWN)] - 0.5  # down now 1.5 / 3 against 3 / 2: still worse, stays
    assert not balance_each(times, units, m).any()
    times[(1, DOWN, 0)] = times[(1, DOWN, 0)] - np.arange(m) * 0.3  # down: 1.5 / (3 - 0.3 i): a tie at i = 0
    moves = balance_each(times, units, m)
    np.testing.assert_array_equal(moves[:, 0], np.where(np.arange(m) > 0, DOWN, STAY))
    links = (-1, 0, 1, -1, 3, -1, -1, -1)  # chains 0 <- 1 <- 2 and 3 <- 4: each chooses by its summed times
    moves = balance_each(times, units, m, links)
    assert moves[0, 0] == moves[1, 0] == moves[2, 0] and moves[3, 0] == moves[4, 0]
    assert moves[0, 0] == DOWN  # 4.5 / (9 - 0.9) down against 9 / 6 at the cut


def test_an_unknown_chooser_is_one_line():
    model = stage_model("gpt2-mini")
    shapes = sample_shapes(0, 4)
    with pytest.raises(ValueError, match="unknown boundary move chooser 'nope'; valid: "
                       + ", ".join(MOVE_CHOOSERS)):
        piece_costs(model, None, shapes, [0] * len(shapes), (), moves="nope")


def unbalanced_times(m: int, unit: float = 1.0) -> dict:
    """Two stages, stage 0 busier by ``m`` units: moving a micro-batch's unit down evens them out."""
    base0, base1 = np.full(m, 3.0 * unit), np.full(m, 2.0 * unit)
    return {(0, 0, 0): base0, (0, 0, DOWN): base0 - unit, (0, 0, UP): base0 + unit,
            (1, 0, 0): base1, (1, DOWN, 0): base1 + unit, (1, UP, 0): base1 - unit}


def test_choice_evens_an_unbalanced_step():
    times, units = unbalanced_times(8), BoundaryUnits((True,), (True,))
    moves = choose_moves(times, units, 8)
    assert bottleneck(times, moves, 2) < bottleneck(times, np.zeros_like(moves), 2)
    assert bottleneck(times, moves, 2) == pytest.approx(20.0)  # 24 + 16 evened out to 20 + 20
    assert set(moves[:, 0].tolist()) <= {STAY, DOWN}


def test_disallowed_moves_never_appear():
    times, units = unbalanced_times(8), BoundaryUnits((False,), (True,))  # stage 0 may not lend its last unit
    assert not (choose_moves(times, units, 8) == DOWN).any()
    units = BoundaryUnits((False,), (False,))
    assert not choose_moves(times, units, 8).any()
    t5 = stage_model("t5-tiny")  # its second stage lends its encoder block up; the first has one block to keep
    assert boundary_units(t5.layout).down == (False,)
    for seed in range(3):
        shapes = sample_shapes(seed, 16, True)
        shapes[:, 1] *= 4  # long inputs: the encoder stage is busier, a down move would help if it were allowed
        costs = piece_costs(t5, None, shapes, [0] * len(shapes), ())
        assert costs.moves is None or not (costs.moves == DOWN).any()


def test_slices_of_a_chain_share_their_moves():
    m = 8
    times, units = unbalanced_times(m), BoundaryUnits((True,), (True,))
    times[(0, 0, DOWN)] = times[(0, 0, DOWN)] - np.arange(m) * 0.01  # different sizes: unequal if chosen alone
    links = (-1, 0, 1, -1, 3, -1, -1, -1)  # chains 0 <- 1 <- 2 and 3 <- 4
    moves = choose_moves(times, units, m, links)
    assert moves[0, 0] == moves[1, 0] == moves[2, 0] and moves[3, 0] == moves[4, 0]
    assert bottleneck(times, moves, 2) < bottleneck(times, np.zeros_like(moves), 2)


def test_off_leaves_piece_costs_unchanged():
    on, off = stage_model("gpt2-mini"), stage_model("gpt2-mini", moving=False)
    shapes = sample_shapes(2)
    costs = piece_costs(off, None, shapes, [0] * len(shapes), ())
    plain = off.per_stage(*shapes.T.astype(np.float64))
    assert costs.moves is None
    for f in dataclasses.fields(costs):
        a, b = getattr(costs, f.name), getattr(plain, f.name)
        assert (a is None and b is None) or np.array_equal(a, b)
    # moving boundaries hold a copy of each movable unit: more model states on both stages
    assert all(a > b for a, b in zip(on.model_state_bytes, off.model_state_bytes))
    # and a layout that allows no move prices as the layout
    single = stage_model("gpt2-tiny")
    assert not boundary_units(single.layout).any
    assert piece_costs(single, None, shapes, [0] * len(shapes), ()).moves is None


def test_with_moves_of_one_replica_keeps_pairs_shape():
    model = stage_model("gpt2-mini")
    shapes = sample_shapes(3, 10)
    laid = piece_costs(model, None, shapes, [0] * len(shapes), (), moves=None)
    moved = with_moves(model, laid, shapes)
    assert moved.moves.shape == (10, 1) and moved.moves.dtype == np.int8
    assert stage_move_pairs(boundary_units(model.layout), 0) == ((STAY, DOWN), (STAY, STAY), (STAY, UP))
    with pytest.raises(ValueError, match="may not run"):
        moved_costs(laid, move_ratios(stage_model("t5-tiny"), *sample_shapes(3, 10, True).T.astype(np.float64)),
                    np.full((10, 1), DOWN))


def test_fit_learns_the_layouts_times_from_moved_observations():
    """Measured times of moved micro-batches (synthetic: the true layout times scaled by their moves' ratios) fit with
    the moved features give back the layout's times; fitted with the layout's features they would not."""
    model = CalibratedStageCostModel.of(stage_model("gpt2-mini"))
    truth = prior_coefficients(2, False)
    truth[:, :, 0] = [[1.8, 2.5], [1.3, 2.0]]  # a scale on the base model
    truth[:, :, 1] = 2e-3  # and a fixed cost per micro-batch
    fits = {"moved": OnlineFit(2, False, prior_weight=1.0), "laid": OnlineFit(2, False, prior_weight=1.0)}
    rows = []
    for step in range(6):
        shapes = sample_shapes(step, 24)
        b, e, d = shapes.T.astype(np.float64)
        x = model.features(b, e, d)  # (S, 2, M, F) as laid out
        laid = np.einsum("sdmf,sdf->sdm", x, truth)
        moved = with_moves(model, piece_costs(model, None, shapes, [0] * len(shapes), (), moves=None), shapes)
        assert moved.moves.any()
        ratios = move_ratios(model, b, e, d)
        r = ratios.of(moved.moves)
        measured = laid * np.stack([r["fwd_s"], r["bwd_s"]], axis=1)  # what the moved micro-batches take
        features = {"moved": moved_features(x, ratios, moved.moves), "laid": x}
        for s in range(2):
            for direction in range(2):
                for name, fit in fits.items():
                    fit.add_times(step, s, direction, features[name][s, direction], measured[s, direction])
        rows.append((x, laid))
    x = np.concatenate([r[0] for r in rows], axis=2)
    want = np.concatenate([r[1] for r in rows], axis=2)
    error = {name: np.abs(np.einsum("sdmf,sdf->sdm", x, fit.coefficients(5)) / want - 1).max()
             for name, fit in fits.items()}
    assert error["moved"] < 0.01 and error["laid"] > 0.05  # 0.5% (the prior's ridge) against 10%


def test_a_lead_keeps_the_later_stage_lighter_by_it():
    """Stage 1 waits 4 s whatever the split (the first forward and last backward on stage 0): the choice evens
    stage 0's sum with stage 1's plus 4, not the sums alone."""
    times, units = unbalanced_times(8), BoundaryUnits((True,), (True,))
    even = choose_moves(times, units, 8)
    led = choose_moves(times, units, 8, lead=np.array([0.0, 4.0]))
    assert list(stage_sums(times, even, 2)) == [20.0, 20.0]  # 24 + 16 evened out
    assert list(stage_sums(times, led, 2)) == [22.0, 18.0]  # 22 against 18 + 4
    assert bottleneck(times, led, 2, np.array([0.0, 4.0])) < bottleneck(times, even, 2, np.array([0.0, 4.0]))
