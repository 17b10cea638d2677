"""Baseline plans as candidates of the dynamic method (:mod:`dynabatch.plan.candidates`): the plan that runs is
never predicted slower than any baseline's plan of the same global batch at the tuning grid's knob values."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from dynabatch.training.config import TrainConfig
from dynabatch.data.baselines import BASELINES, BaselineOptions, group_shape, make_batcher
from dynabatch.data.batching import LengthLimits
from dynabatch.plan.candidates import (
    DP,
    DP_WHOLE,
    Candidate,
    baseline_candidates,
    candidate_baselines,
    choose,
    deal_to_replicas,
    knob_values,
)
from dynabatch.plan.formula import formula_price, step_lower_bound
from dynabatch.plan.step_plan import StepPlan

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data")
HEAVY = os.path.join(DATA, "heavy_tail_1024.npz")


def _planner(cfg, batches, limits, tokens, fitted: bool = False):
    """A maker of step planners over ``batches``; ``fitted``: each predicts with an online fit unlike the base model
    it plans with (``--plan-costs base`` while calibrating: the schedules are ordered by the base model's costs)."""
    from dynabatch.commands.bench_layouts import ListBatcher
    from dynabatch.core.sequence import is_seq2seq
    from dynabatch.cost.online import CalibratedStageCostModel, prior_coefficients
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    model = build_model(cfg.model, vocab_size=max(tokens.vocab_size, 8))
    cost_model = planner_cost_model(cfg, model.config, layout_for(model, cfg.stages))
    fit = None
    if fitted:  # stages and directions scaled unequally, and a fixed cost per micro-batch, as measured fits are
        theta = prior_coefficients(cost_model.num_stages, is_seq2seq(limits.family))
        theta[:, :, 0] = [[5.0, 6.5], [4.0, 7.5]]
        theta[:, :, 1] = 0.04
        fit = CalibratedStageCostModel.of(cost_model, theta)

    def make(c):
        planner = StepPlanner(ListBatcher(batches, limits), c, cost_model, tokens)
        if fit is not None:
            planner.predict_model = fit
        return planner
    return make


def _builtin_batches(cfg, limits, num):
    from dynabatch.data.batching import GlobalBatcher
    from dynabatch.training.trainer import load_training_data
    from dynabatch.data.tokenize import load_tokenizer

    data = load_training_data(cfg, load_tokenizer("builtin"), limits.family)
    batcher = GlobalBatcher(data, limits, token_budget=cfg.global_batch_tokens)
    return [batcher.next_batch() for _ in range(num)], data.tokens


def _heavy_batches(limits, budget, num, path=HEAVY):
    from dynabatch.data.baselines import GROUPING_TOKENS
    from dynabatch.training.workload import global_batches

    batches = global_batches(path, limits.family, limits, budget, 40)
    step = max(1, len(batches) // num)  # spread over the file: its tail comes in bursts
    return [replace(b, step=k) for k, b in enumerate(batches[::step][:num])], replace(GROUPING_TOKENS, vocab_size=64)


CASES = {
    "builtin-t5": dict(model="t5-tiny", data="builtin", max_input_len=512, max_target_len=128, tokens=8192),
    "heavy-t5": dict(model="t5-tiny", data="heavy", max_input_len=1024, max_target_len=128, tokens=8192),
    "heavy-gpt2": dict(model="gpt2-tiny", data="heavy", max_input_len=1024, max_target_len=128, tokens=8192),
    # predicted with a fit: priced by the schedules the fit would order (not those that run), gpt2-tiny's chosen
    # plans were predicted, as they run, up to 4% slower than packing_free=2's on 4 of 6 batches
    "heavy-t5-fit": dict(model="t5-tiny", data="heavy", max_input_len=2048, max_target_len=128, tokens=8192, fit=True,
                         batches=6),
    "heavy-gpt2-fit": dict(model="gpt2-tiny", data="heavy", max_input_len=2048, max_target_len=128, tokens=8192,
                           fit=True, batches=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chosen_plan_is_never_predicted_slower_than_a_baseline(case):
    """On sampled global batches, the dynamic method's predicted step (the trainer's planner: cost model, the
    run's schedule policy, simulator) is at most that of every candidate baseline run as that baseline, at every
    knob value of its tuning grid, also when the run predicts with an online fit unlike the model it plans
    with (``-fit``: each plan is priced as it runs, its schedule ordered by the planning model); and with candidates off, the DP alone is slower on some batch (the candidates
    are what makes the difference here)."""
    c = CASES[case]
    family = "t5" if c["model"].startswith("t5") else "gpt2"
    cfg = TrainConfig(model=c["model"], stages=2, global_batch_tokens=c["tokens"], max_input_len=c["max_input_len"],
                      max_target_len=c["max_target_len"], memory_gib=4.0, calibrate="off")
    limits = LengthLimits(family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)
    batches, tokens = (_builtin_batches(cfg, limits, 3) if c["data"] == "builtin"
                       else _heavy_batches(limits, cfg.global_batch_tokens, c.get("batches", 3),
                                           os.path.join(DATA, f"heavy_tail_{cfg.max_input_len}.npz")))
    make = _planner(cfg, batches, limits, tokens, fitted=c.get("fit", False))
    dynamic, dp_only = make(cfg), make(replace(cfg, plan_candidates="off"))
    chosen = [dynamic() for _ in batches]
    dp = [dp_only() for _ in batches]
    options = BaselineOptions.of(cfg)
    beaten = 0
    for method in candidate_baselines():
        for value in knob_values(method, options):
            run = make(replace(cfg, method=method, **{BASELINES[method].option: value}))
            for k, batch in enumerate(batches):
                planned = run()
                assert planned.batch is batch
                assert chosen[k].predicted_step_s <= planned.predicted_step_s * (1 + 1e-9), (method, value, k)
                beaten += dp[k].predicted_step_s > planned.predicted_step_s * (1 + 1e-9)
    for planned in chosen:
        rows = [row for mb in planned.replica_micro_batches[0] for row in mb.sample_ids]
        assert sorted(i for row in rows for i in row) == list(range(len(planned.batch)))
        assert planned.candidate == DP or planned.candidate.split("=")[0] in BASELINES
    assert all(p.candidate == DP for p in dp)
    assert beaten > 0 or all(p.candidate == DP for p in chosen)


def test_a_sliced_plan_competes_with_the_whole_plans():
    """With token slices (``--slice-long``) the DP's sliced plan is one candidate among the DP's plan of whole
    samples (``dp_whole``) and the baselines': the step that runs is predicted at most as long as the whole-sample
    dynamic method's and the sliced DP plan alone's, on every sampled batch of the heavy-tailed file; on some batch
    the sliced plan runs, and on another the DP sliced a sample yet a plan of whole samples was predicted faster."""
    cfg = TrainConfig(model="gpt2-tiny", stages=2, global_batch_tokens=8192, max_input_len=2048, max_target_len=128,
                      memory_gib=4.0, calibrate="off", slice_long=True)
    limits = LengthLimits("gpt2", max_input_len=2048, max_target_len=128, max_seq_len=2048)
    batches, tokens = _heavy_batches(limits, cfg.global_batch_tokens, 6, os.path.join(DATA, "heavy_tail_2048.npz"))
    make = _planner(cfg, batches, limits, tokens)
    sliced, whole, dp_sliced = make(cfg), make(replace(cfg, slice_long=False)), make(replace(cfg, plan_candidates="off"))
    ran_sliced = overruled = 0
    for batch in batches:
        chosen, other, alone = sliced(), whole(), dp_sliced()
        assert chosen.batch is batch
        assert chosen.predicted_step_s <= other.predicted_step_s * (1 + 1e-9)
        assert chosen.predicted_step_s <= alone.predicted_step_s * (1 + 1e-9)
        assert chosen.candidate in (DP, DP_WHOLE) or chosen.candidate.split("=")[0] in BASELINES
        assert other.num_sliced_samples == 0 and (chosen.num_sliced_samples == 0) == (chosen.candidate != DP)
        ran_sliced += chosen.num_sliced_samples > 0
        overruled += alone.num_sliced_samples > 0 and chosen.predicted_step_s < alone.predicted_step_s * (1 - 1e-9)
    assert ran_sliced > 0 and overruled > 0


def test_lower_bound_never_exceeds_a_simulated_makespan():
    """:func:`step_lower_bound` is below the makespan of every schedule the simulator replays (random costs,
    every policy, random orders): what lets :func:`choose` skip a candidate without simulating it."""
    from dynabatch.cost.stages import StageCosts
    from dynabatch.schedule.policies import adaptive, gpipe, one_f_one_b
    from dynabatch.schedule.simulate import simulate

    rng = np.random.default_rng(0)
    for _ in range(60):
        S, M = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        fwd = rng.lognormal(0, 1, (S, M))
        bwd = fwd * rng.uniform(1, 3, (S, M))
        zeros = np.zeros((S, M))
        costs = StageCosts(fwd, bwd, zeros, zeros, zeros)
        bound = step_lower_bound(fwd, bwd)
        for schedule in (gpipe(M, S), one_f_one_b(M, S), adaptive(costs), adaptive(costs, order=rng.permutation(M))):
            makespan = simulate(schedule, costs).makespan_s
            assert bound <= makespan * (1 + 1e-12), (S, M, schedule.policy)
        if S == 1:
            assert bound == pytest.approx((fwd + bwd).sum())


def test_choose_prunes_by_bound_yet_keeps_the_cheapest():
    """``choose`` with a bound returns what pricing every candidate returns, prices fewer, and keeps the first
    candidate on ties."""
    plans = [StepPlan("t5", 2, ((),), ()) for _ in range(8)]
    prices = [5.0, 7.0, 3.0, 9.0, 3.0, 8.0, 4.0, 6.0]
    cands = [Candidate(DP if k == 0 else "token_budget", None if k == 0 else k, p) for k, p in enumerate(plans)]
    price_of = {id(p): x for p, x in zip(plans, prices)}
    calls = []

    def price(plan):
        calls.append(plan)
        return price_of[id(plan)]

    full = choose(cands, price)
    assert full.candidate is cands[2] and full.price == 3.0 and full.num_priced == 8
    calls.clear()
    pruned = choose(cands, price, bound=lambda p: 0.9 * price_of[id(p)])
    assert pruned.candidate is cands[2] and pruned.price == 3.0
    assert pruned.num_priced == len(calls) < 8
    assert choose([cands[0], Candidate("padding", 1, plans[0])], lambda p: 1.0).candidate is cands[0]  # ties: first
    with pytest.raises(ValueError, match="at least one candidate"):
        choose([], price)


def test_baseline_candidates_are_the_baselines_own_micro_batches():
    """Each candidate holds exactly the micro-batches its baseline makes at that knob value, dealt to replicas as
    the trainer deals a baseline's; settings with the same micro-batches appear once."""
    from dynabatch.data.baselines import GROUPING_TOKENS

    rng = np.random.default_rng(3)
    e = rng.integers(4, 400, 120)
    d = rng.integers(1, 100, 120)
    limits = LengthLimits("t5", max_input_len=512, max_target_len=128)
    options = BaselineOptions()
    cands = baseline_candidates(e, d, limits, 2, num_replicas=2, options=options)
    assert {c.method for c in cands} == set(candidate_baselines()) and "packing" not in candidate_baselines()
    assert candidate_baselines(padding_free=False) == [m for m in candidate_baselines() if m != "packing_free"]
    keys = [tuple(p.row_samples for r in c.plan.replicas for p in r) for c in cands]
    assert len(set(keys)) == len(keys)

    class Lens:
        input_lens, target_lens = e, d

        def __len__(self):
            return len(e)

    for c in cands:
        groups = make_batcher(c.method, limits, GROUPING_TOKENS, **options.with_value(c.method, c.value).batcher_options(
            c.method, limits)).group(Lens())
        sizes = [b * (E + D) for b, E, D in (group_shape(Lens(), g, "t5") for g in groups)]
        dealt = deal_to_replicas(groups, sizes, 2)
        assert [[p.row_samples for p in r] for r in c.plan.replicas] == [[g.rows for g in r] for r in dealt]
        assert [[p.shape for p in r] for r in c.plan.replicas] == [
            [group_shape(Lens(), g, "t5") for g in r] for r in dealt]
        assert c.label == f"{c.method}={c.value}"


def test_formula_price_matches_the_plan_command_pricing():
    """The price ``dynabatch plan`` chooses with is the step formula over every piece priced per segment."""
    rng = np.random.default_rng(1)
    e, d = rng.integers(4, 300, 60), rng.integers(1, 60, 60)
    limits = LengthLimits("t5", max_input_len=512, max_target_len=128)

    class Linear:  # time = tokens computed + attention pairs; memory free
        memory_budget_bytes = 1e18

        def evaluate(self, b, E, D, pairs=None):
            b, E, D = (np.asarray(x, dtype=np.float64) for x in (b, E, D))
            t = b * (E + D) + (0 if pairs is None else 1e-3 * (pairs.encoder + pairs.decoder + pairs.cross))
            return t, np.zeros_like(t), np.zeros_like(t)

    price = formula_price(Linear(), e, d)
    for c in baseline_candidates(e, d, limits, 3, cost_model=Linear()):
        (pieces,) = c.plan.replicas
        t = np.array([p.time_s for p in pieces])
        assert price(c.plan) == pytest.approx(t.sum() + 2 * t.max())


@pytest.mark.parametrize("padding_free", [True, False])
def test_formula_prices_of_many_plans_are_each_plans_own(padding_free):
    """Pricing every candidate in one cost-model call (what GlobalPlanner.plan does) gives each plan exactly the price it
    gets alone, with two replicas and a memory budget some plans break (inf); so do the baseline candidates'
    piece times, priced together, against one candidate's pieces priced alone."""
    from dynabatch.plan.formula import formula_prices
    from dynabatch.plan.costs import PolynomialCostModel
    from dynabatch.plan.step import plan_step

    rng = np.random.default_rng(4)
    e, d = rng.integers(4, 400, 90), rng.integers(1, 60, 90)
    limits = LengthLimits("t5", max_input_len=512, max_target_len=128)
    cost = PolynomialCostModel(memory_budget_bytes=2.5e9)
    plans = [plan_step(e, d, cost, 3, family="t5", num_replicas=2, pack_rows=p) for p in ("off", "auto")]
    candidates = baseline_candidates(e, d, limits, 3, num_replicas=2, cost_model=cost, padding_free=padding_free)
    plans += [c.plan for c in candidates]
    together = formula_prices(cost, e, d, plans, padding_free)
    alone = [formula_prices(cost, e, d, [p], padding_free)[0] for p in plans]
    assert together == alone
    assert any(np.isinf(together)) and not all(np.isinf(together))
    for c in candidates[:3]:  # piece times as if the candidate were the only one
        (own,) = [x for x in baseline_candidates(e, d, limits, 3, num_replicas=2, cost_model=cost,
                                                 padding_free=padding_free, methods=[c.method])
                  if x.value == c.value]
        assert [p.time_s for r in own.plan.replicas for p in r] == [p.time_s for r in c.plan.replicas for p in r]


def test_micro_batches_priced_once_give_the_same_prices_and_times():
    """GlobalPlanner.plan prices each distinct micro-batch once (price_micro_batches: the baselines' and the DP's in
    one call, then read by formula_prices): every piece time and every plan's price is the one it gets without that
    memo, with two replicas and a budget some plans break."""
    from dynabatch.plan.formula import formula_prices
    from dynabatch.plan.costs import PolynomialCostModel
    from dynabatch.plan.step import plan_step

    rng = np.random.default_rng(9)
    e, d = rng.integers(4, 400, 90), rng.integers(1, 60, 90)
    limits = LengthLimits("t5", max_input_len=512, max_target_len=128)
    cost = PolynomialCostModel(memory_budget_bytes=2.5e9)
    dp = [plan_step(e, d, cost, 3, family="t5", num_replicas=2, pack_rows=p) for p in ("off", "auto")]
    also = [(p.row_samples, p.shape) for plan in dp for r in plan.replicas for p in r if not p.is_slice]
    priced: dict = {}
    memo = baseline_candidates(e, d, limits, 3, num_replicas=2, cost_model=cost, work={}, priced=priced, also=also)
    plain = baseline_candidates(e, d, limits, 3, num_replicas=2, cost_model=cost)
    assert [c.label for c in memo] == [c.label for c in plain] and len(priced) >= len(also)
    for a, b in zip(memo, plain):
        assert a.plan == b.plan
    plans = dp + [c.plan for c in plain]
    with_memo = formula_prices(cost, e, d, plans, True, None, {}, priced)
    assert with_memo == formula_prices(cost, e, d, plans, True)
    assert any(np.isinf(with_memo)) and not all(np.isinf(with_memo))


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_baseline_planned_with_the_dynamic_methods_model_keeps_its_own_recompute(calibrated):
    """``dynabatch bench`` gives every method one base cost model and one online fit, set up for the dynamic method
    (``--recompute auto``); a baseline's planner keeps its own recomputation (none), so at a tight budget its
    micro-batches run as the baseline runs them in ``train``, not recomputed wherever ``auto`` would (they were: 2-4
    recomputed forwards a step here, 0.25-1.4 in the long-tail benches)."""
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model, run_calibration

    cfg = TrainConfig(model="t5-tiny", stages=2, global_batch_tokens=8192, max_input_len=1024, max_target_len=128,
                      memory_gib=0.02, calibrate="online" if calibrated else "off")
    limits = LengthLimits("t5", max_input_len=1024, max_target_len=128, max_seq_len=1024)
    batches, tokens = _heavy_batches(limits, cfg.global_batch_tokens, 3)
    model = build_model(cfg.model, vocab_size=max(tokens.vocab_size, 8))
    layout = layout_for(model, 2)
    auto = planner_cost_model(cfg, model.config, layout)  # the dynamic method's: recompute auto
    calibration = run_calibration(cfg, auto, model.config.to_dict(), layout)[0] if calibrated else None
    assert auto.recompute == "auto"
    grouped = replace(cfg, method="length_grouped", samples_per_micro_batch=16)

    def planner(c):
        from dynabatch.commands.bench_layouts import ListBatcher

        return StepPlanner(ListBatcher(batches, limits), c, auto, tokens, calibration=calibration)

    baseline, dynamic = planner(grouped), planner(cfg)
    steps = [baseline() for _ in batches]
    assert baseline.cost_model.recompute == baseline.predict_model.recompute == "none"
    assert all(s.recompute_counts == {} for s in steps)
    assert dynamic.cost_model is auto  # the dynamic method's own model, untouched
    # the same micro-batches priced by the shared model do recompute: what the baseline ran before
    shared = StepPlanner(baseline.batcher.__class__(batches, limits), grouped, auto, tokens)
    shared.cost_model = shared.predict_model = auto
    assert sum(sum(shared().recompute_counts.values()) for _ in batches) > 0


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_formula_choice_from_arrays_is_the_choice_among_built_plans(family):
    """The step formula's path prices the baseline settings from arrays (settings_prices) and builds only the kept
    plan (formula_choice): every price is exactly formula_prices' of the built candidate plans, the kept candidate
    exactly what choose keeps among them (timed or not), and GlobalPlanner.plan's result the general path's (the
    same formula given as its price); heavy-tailed lengths, one to three replicas, a budget some plans break,
    in_flight."""
    from types import SimpleNamespace

    from dynabatch.plan.candidates import baseline_settings, formula_choice, price_settings, settings_prices
    from dynabatch.plan.formula import formula_prices
    from dynabatch.plan.costs import PolynomialCostModel
    from dynabatch.plan.global_plan import GlobalPlanner
    from dynabatch.plan.step import plan_step

    rng = np.random.default_rng(12)
    limits = LengthLimits(family, max_input_len=512, max_target_len=128, max_seq_len=640)
    kept, broken = set(), 0
    for trial in range(8):
        n = int(rng.integers(2, 160))
        e = np.minimum(rng.lognormal(4, 1.2, n).astype(np.int64) + 1, 512)
        d = np.minimum(rng.lognormal(2.5, 1, n).astype(np.int64) + 1, 128)
        d = d if family == "t5" else np.minimum(d, 640 - e)
        cost = PolynomialCostModel(memory_budget_bytes=(2.5e9, 1e12)[trial % 2])
        replicas, in_flight = 1 + trial % 3, (None, 1)[trial // 4]
        dp = plan_step(e, d, cost, 3, family=limits.family, num_replicas=replicas, segment_pricing=True)
        priced = price_settings(cost, dp, baseline_settings(e, d, limits, num_replicas=replicas), e, d, limits.family)
        candidates = [Candidate(DP, None, dp), *baseline_candidates(e, d, limits, 3, num_replicas=replicas,
                                                                    cost_model=cost)]
        plans = [c.plan for c in candidates]
        prices = formula_prices(cost, e, d, plans, True, in_flight)
        assert settings_prices(priced, cost, in_flight) == prices
        broken += any(np.isinf(prices))
        price_of = dict(zip(map(id, plans), prices))
        want = choose(candidates, lambda plan: price_of[id(plan)]).candidate
        got = formula_choice(priced, cost, in_flight)
        assert (got.label, got.plan) == (want.label, want.plan)
        untimed = formula_choice(priced, cost, in_flight, timed=False)
        assert untimed.label == got.label
        assert untimed.plan == got.plan or all(p.time_s == 0.0 for r in untimed.plan.replicas for p in r)
        planner = GlobalPlanner("dynamic", limits, 3, replicas, cost,
                                planner_options={} if in_flight is None else {"in_flight": in_flight})
        batch = SimpleNamespace(input_lens=e, target_lens=d)
        assert planner.plan(batch) == planner.plan(batch, price=formula_price(cost, e, d, True, in_flight))
        kept.add(got.label == DP)
    assert kept == {True, False} and broken  # the DP's plan and a baseline's both kept; some plans over budget
