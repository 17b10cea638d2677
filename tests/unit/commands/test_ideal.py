"""``efficiency_balanced`` of a measured step (:mod:`dynabatch.plan.ideal`): the unitless ratio of the amortised
whole-model ideal to the plan's predicted work, times the devices' mean busy fraction. In a simulated step it is
``dynabatch simulate``'s ``ideal_step_time(balanced=True) / step``."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from dynabatch.commands import simulate
from dynabatch.commands.common import resolve
from dynabatch.plan.ideal import (AMORTISED_TOKENS, balanced_efficiency, busy_fractions, ideal_step_time, ideal_work,
                                  measured_efficiency, planned_work)
from dynabatch.training.workload import global_batches


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """T5 (analytic A100 preset, 4 stages, no recomputation) on one global batch of heavy-tailed lengths."""
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("lengths") / "lengths.npz")
    np.savez(path, input_len=np.minimum(8 + rng.pareto(1.2, 300) * 40, 1024).astype(int),
             target_len=rng.integers(2, 128, 300))
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--model", "t5", "--lengths", path, "--num-batches", "1", "--global-batch-tokens", "8192",
                         "--layer-split", "reference", "--recompute", "none"])
    w = simulate.simulation_workload(resolve(args))
    return w, global_batches(w.path, w.family, w.limits, 8192, 1, args.tokenizer)[0]


def test_hand_computed_two_samples(workload):
    w, _ = workload
    cm = w.cost_model
    batch = SimpleNamespace(input_lens=np.array([100, 3000]), target_lens=np.array([20, 60]))
    whole = []  # each sample directly: k = ceil(8192 / (e + d)) copies, every stage's fwd + bwd, / k
    for e, d in ((100, 20), (3000, 60)):
        k = -(-AMORTISED_TOKENS // (e + d))
        c = cm.per_stage(np.array([k]), np.array([e]), np.array([d]))
        whole.append(float((np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum()) / k)
    assert ideal_work(batch, cm, w.family) == pytest.approx(sum(whole), rel=1e-12)
    assert ideal_step_time(batch, cm, w.family, AMORTISED_TOKENS, balanced=True) == pytest.approx(
        sum(whole) / cm.num_stages, rel=1e-12)
    # a plan of the two as one padded micro-batch (2 x 3000 x 60): its work, then 2 devices measured 3 s and 1 s
    costs = cm.per_stage(np.array([2]), np.array([3000]), np.array([60]))
    plan = planned_work([costs])
    assert plan == pytest.approx(float((np.asarray(costs.fwd_s) + np.asarray(costs.bwd_s)).sum()))
    assert plan > sum(whole)  # padding the short sample to 3000 x 60 costs work
    eff = balanced_efficiency(sum(whole), plan, [3.0, 1.0], 4.0)
    assert eff == pytest.approx(sum(whole) / plan * (3.0 + 1.0) / (2 * 4.0))
    assert busy_fractions([3.0, 1.0], 4.0) == [0.75, 0.25]
    # the cost model's absolute scale cancels: a model 10x optimistic gives the same figure
    assert balanced_efficiency(sum(whole) / 10, plan / 10, [3.0, 1.0], 4.0) == pytest.approx(eff)
    assert measured_efficiency(sum(whole) / 2, plan, [3.0, 1.0], 4.0) == pytest.approx(eff)


def test_a_simulated_step_gives_simulates_efficiency_balanced(workload):
    """With the simulator's busy times in place of measured ones the measured definition is exactly
    ``ideal_step_time(balanced=True) / step`` (the devices are busy for exactly the plan's predicted work)."""
    from dynabatch.schedule.simulate import with_message_buffers

    w, batch = workload
    cm = w.cost_model
    plan, _, result, _, _ = simulate.simulate_step("dynamic", batch, w)
    costs = with_message_buffers(cm.per_stage(*plan.shapes.T, plan.pairs))
    assert float(result.busy_s.sum()) == pytest.approx(planned_work([costs]), rel=1e-9)
    eff = balanced_efficiency(ideal_work(batch, cm, w.family), planned_work([costs]), result.busy_s, result.makespan_s)
    expected = ideal_step_time(batch, cm, w.family, AMORTISED_TOKENS, balanced=True) / result.makespan_s
    assert eff == pytest.approx(expected, rel=1e-9)
    assert simulate.simulate_method("dynamic", [batch], w).efficiency_balanced == pytest.approx(expected, rel=1e-9)
    assert 0 < eff < 1
