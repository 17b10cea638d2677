"""The whole-step planner (slicing + partition + replicas) and the `dynabatch plan` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.cli import main
from dynabatch.core.methods import CAUSAL_ONLY
from dynabatch.data.baselines import BASELINES
from dynabatch.plan.costs import PolynomialCostModel
from dynabatch.plan.partition import plan_partition
from dynabatch.plan.slice_costs import PolynomialSliceCostModel
from dynabatch.plan.step import plan_step


def _lengths(seed: int, n: int = 150):
    rng = np.random.default_rng(seed)
    e = rng.integers(5, 400, n)
    d = rng.integers(1, 30, n)
    return e, d


def _check_cover(step, e, d):
    """Whole samples appear once; a sliced sample's slices tile [0, L) in order on one replica."""
    whole, slices = [], {}
    for r, pieces in enumerate(step.replicas):
        for p in pieces:
            if p.is_slice:
                slices.setdefault(p.sample_ids[0], []).append((r, p.token_range))
            else:
                whole.extend(p.sample_ids)
    assert sorted(whole + list(slices)) == list(range(len(e)))
    for i, parts in slices.items():
        assert len({r for r, _ in parts}) == 1
        ranges = [rng for _, rng in parts]
        assert ranges[0][0] == 0 and ranges[-1][1] == e[i] + d[i]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_sample_once_across_replicas(replicas):
    e, d = _lengths(replicas)
    step = plan_step(e, d, PolynomialCostModel(), 4, family="t5", num_replicas=replicas)
    _check_cover(step, e, d)
    assert len(step.replicas) == replicas and not step.sliced_samples


def test_single_replica_matches_partition():
    e, d = _lengths(7)
    cost = PolynomialCostModel()
    step = plan_step(e, d, cost, 4, family="gpt2")
    part = plan_partition(e, d, cost, 4, family="gpt2")
    assert sorted(p.sample_ids for p in step.replicas[0]) == sorted(part.micro_batches)
    assert step.objective_s == pytest.approx(part.objective_s)


def test_slicing_rescues_a_sample_too_long_for_memory():
    e, d = _lengths(3)
    e[5] = 4000
    cost = PolynomialCostModel(memory_budget_bytes=4 * 2**30)
    with pytest.raises(ValueError, match="do not fit alone"):
        plan_step(e, d, cost, 4, family="gpt2")
    step = plan_step(e, d, cost, 4, family="gpt2", num_replicas=2,
                     slice_cost_model=PolynomialSliceCostModel(memory_budget_bytes=4 * 2**30))
    assert 5 in step.sliced_samples
    _check_cover(step, e, d)
    assert sum(1 for p in step.replicas[0] + step.replicas[1] if p.is_slice) >= 2


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_sample_the_partition_cannot_run_whole_is_sliced(recompute):
    """The slice model prices one stage's blocks; the partition's memory test prices every stage as a whole
    micro-batch. Where they disagree (under ``--recompute full`` the slice model's whole gpt2-tiny sample of 279
    tokens needed 26.5 MiB, the partition's 28.4 MiB, at a 27.4 MiB budget) the sample was left whole for the
    slicer and refused by the partition: ``train --slice-long --recompute full --memory-gib 0.04`` stopped with
    "do not fit alone". A sample the partition cannot run whole must be sliced."""
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.models.families import run_cost_model
    from dynabatch.models.presets import build_config
    from dynabatch.plan.slice_costs import AnalyticSliceCostModel
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import planner_cost_model

    config = build_config("gpt2-tiny", vocab_size=8192)  # the builtin tokenizer's vocabulary
    cfg = TrainConfig(model="gpt2-tiny", memory_gib=0.04, recompute=recompute, slice_long=True)
    stage_model = planner_cost_model(cfg, config, balanced_layout(run_cost_model(config, "cpu"), 1))
    slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=512, attention="causal")
    e, d = np.array([40, 60, 90, 273, 120]), np.array([6, 3, 8, 6, 2])
    _, stored, peak = stage_model.evaluate(np.ones(5), (e + d).astype(float), np.zeros(5))
    whole = stored + peak <= stage_model.memory_budget_bytes
    assert whole.tolist() == [True, True, True, False, True]
    step = plan_step(e, d, stage_model, 1, family="gpt2", slice_cost_model=slicer)
    assert 3 in step.sliced_samples
    assert sum(p.is_slice for p in step.replicas[0]) >= 2  # a chain, not the whole sample as one slice
    _check_cover(step, e, d)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_every_sample_sliced_still_fills_every_replica(replicas):
    """All samples too long to run whole: no unsliced sample is left for the DP, and with fewer unsliced
    samples than replicas the sliced ones fill the empty replicas (this used to raise)."""
    e, d = np.full(4, 4000), np.zeros(4, dtype=np.int64)
    e[0] = 30  # one short sample: fewer unsliced samples than replicas when replicas > 1
    cost = PolynomialCostModel(memory_budget_bytes=4 * 2**30)
    step = plan_step(e, d, cost, 4, family="gpt2", num_replicas=replicas,
                     slice_cost_model=PolynomialSliceCostModel(memory_budget_bytes=4 * 2**30))
    assert sorted(step.sliced_samples) == [1, 2, 3]
    _check_cover(step, e, d)
    assert len(step.replicas) == replicas and all(step.replicas)
    step = plan_step(e[1:], d[1:], cost, 4, family="gpt2", num_replicas=replicas,
                     slice_cost_model=PolynomialSliceCostModel(memory_budget_bytes=4 * 2**30))
    assert sorted(step.sliced_samples) == [0, 1, 2] and all(step.replicas)
    _check_cover(step, e[1:], d[1:])


def test_slicing_is_for_decoder_only():
    e, d = _lengths(1)
    with pytest.raises(ValueError, match="decoder-only"):
        plan_step(e, d, PolynomialCostModel(), 4, family="t5", slice_cost_model=PolynomialSliceCostModel())


def test_plan_command_json(tmp_path, capsys):
    rng = np.random.default_rng(0)
    n = 3000
    path = tmp_path / "lens.npz"
    np.savez(path, input_len=rng.lognormal(np.log(200), 1.0, n).astype(int) + 1,
             target_len=rng.lognormal(np.log(6), 1.2, n).astype(int) + 1)
    code = main(["plan", "--lengths", str(path), "--model", "t5", "--num-batches", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    methods = out["methods"]
    assert set(methods) == {"dynamic", *BASELINES} - CAUSAL_ONLY  # T5: no token slices, no split rows
    for r in methods.values():
        assert r["real_tokens"] == methods["dynamic"]["real_tokens"]
        assert 0 < r["efficiency"] <= 1 and r["predicted_step_s"] > 0
    assert methods["dynamic"]["predicted_step_s"] < methods["padding"]["predicted_step_s"]
    assert methods["dynamic"]["efficiency"] > methods["padding"]["efficiency"]


def test_plan_command_bad_lengths_file(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_len": 3, "target_len": 2}\n{"input_len": "x"}\n')
    assert main(["plan", "--lengths", str(path), "--num-batches", "1"]) == 2
    assert 'bad.jsonl, line 2: input_len must be a whole number of tokens, got "x"' in capsys.readouterr().err
    path.write_text('{"input_len": 3, "target_len": 2}\n{"input_len": 3}\n')
    assert main(["plan", "--lengths", str(path), "--num-batches", "1"]) == 2
    assert "bad.jsonl, line 2: need integer fields input_len and target_len" in capsys.readouterr().err


def test_fill_scales_keep_the_best_scoring_partition():
    """With a score, plan_step plans under every fill-and-drain weight and keeps the best-scoring plan; a
    smaller weight on (S - 1) max(t) never gives fewer micro-batches (it charges large ones less)."""
    e, d = _lengths(11, 300)
    cost = PolynomialCostModel()
    fill = 5 * max(p.time_s for p in plan_step(e, d, cost, 4, family="t5").replicas[0])

    def score(plan):  # a pipeline whose fill and drain cost a fixed time, not the largest micro-batch's
        return sum(p.time_s for p in plan.replicas[0]) + fill

    plain = plan_step(e, d, cost, 4, family="t5", fill_scales=(1.0,))
    counts = [len(plan_step(e, d, cost, 4, family="t5", fill_scales=(s,)).replicas[0]) for s in (1.0, 0.5, 0.25, 0.0)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    best = plan_step(e, d, cost, 4, family="t5", score=score)  # default: FILL_SCALES
    _check_cover(best, e, d)
    assert score(best) < score(plain)
    assert score(best) == min(score(plan_step(e, d, cost, 4, family="t5", fill_scales=(s,))) for s in (1.0, 0.5, 0.25))
