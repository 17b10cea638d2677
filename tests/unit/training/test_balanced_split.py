"""Issue 17 (items 3 and 4): a layer split balanced over the run's own micro-batches, and
``efficiency_balanced`` (the whole model's work over all devices) next to ``efficiency_amortised``."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

from dynabatch.commands import simulate
from dynabatch.commands.common import resolve, split_from_data
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.training.workload import global_batches, method_micro_batches


@pytest.fixture(scope="module")
def lengths(tmp_path_factory) -> str:
    """Heavy-tailed FLAN-like lengths: most inputs short, a few long; short targets."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("lengths") / "lengths.npz")
    np.savez(path, input_len=np.minimum(8 + rng.pareto(1.2, 600) * 40, 1024).astype(int),
             target_len=rng.integers(2, 128, 600))
    return path


def _workload(lengths: str, *extra: str):
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--model", "t5", "--lengths", lengths, "--num-batches", "2", "--global-batch-tokens", "8192",
                         *extra])
    w = resolve(args)
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches, args.tokenizer)
    return w, batches


def _stage_totals(cm: StageCostModel, plans) -> np.ndarray:
    """Every stage's fwd + bwd seconds summed over the planned micro-batches."""
    total = np.zeros(cm.num_stages)
    for p in plans:
        c = cm.per_stage(*p.shapes.T, p.pairs)
        total += (np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum(axis=1)
    return total


def test_the_data_split_balances_the_planned_micro_batches_better_than_the_reference_shape(lengths):
    w, batches = _workload(lengths)
    cm = w.cost_model
    plans = [method_micro_batches("dynamic", b, w.limits, cm, cm.num_stages, w.options) for b in batches]
    data = balanced_layout(cm.model, cm.num_stages, micro_batches=[(p.shapes, p.pairs) for p in plans])
    assert data != cm.layout  # T5's reference shape (4 x 512 / 128) is not the mixture's
    reference = _stage_totals(cm, plans)
    balanced = _stage_totals(StageCostModel(cm.model, data, cm.device_memory_bytes), plans)
    assert np.isclose(balanced.sum(), reference.sum(), rtol=1e-2)  # the same work, cut elsewhere (per-stage costs)
    assert balanced.max() < reference.max()
    # a baseline's micro-batches do not depend on the split: one balancing over them
    grouped = [method_micro_batches("length_grouped", b, w.limits, cm, cm.num_stages, w.options) for b in batches]
    assert split_from_data(w, batches, "length_grouped").cost_model.layout == balanced_layout(
        cm.model, cm.num_stages, micro_batches=[(p.shapes, p.pairs) for p in grouped], split_blocks=w.split_blocks)
    # the dynamic planner's do: the kept split is the first balanced one or a later one its plans are faster under
    kept = split_from_data(w, batches).cost_model
    assert _predicted_steps(kept, w, batches) <= _predicted_steps(replace(cm, layout=data), w, batches)


def _predicted_steps(cm: StageCostModel, w, batches) -> float:
    """The dynamic planner's predicted steps ``sum(t) + (S - 1) max(t)`` under ``cm``, summed over ``batches``."""
    plans = [method_micro_batches("dynamic", b, w.limits, cm, cm.num_stages, w.options) for b in batches]
    return sum(float(p.predicted_times_s.sum() + (cm.num_stages - 1) * p.predicted_times_s.max()) for p in plans)


def test_efficiency_balanced_is_the_whole_models_work_over_all_stages(lengths):
    w, batches = _workload(lengths, "--layer-split", "reference")
    w = simulate.simulation_workload(w)
    r = simulate.simulate_method("dynamic", batches, w)
    assert 0 < r.efficiency_balanced <= r.efficiency_amortised  # sum over stages / S <= the slowest stage
    assert len(r.stage_busy) == w.cost_model.num_stages and all(0 < b <= 1 for b in r.stage_busy)
    # the bubble is what the stages do not fill
    assert np.isclose(1 - np.mean(r.stage_busy), r.bubble_fraction, atol=0.02)
    cm = w.cost_model
    one = batches[0]
    whole = simulate.ideal_step_time(one, cm, w.family, amortise_tokens=8192, balanced=True)
    slowest = simulate.ideal_step_time(one, cm, w.family, amortise_tokens=8192)
    assert whole < slowest
