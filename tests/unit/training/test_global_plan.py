"""The one planning path (:mod:`dynabatch.plan.global_plan`): ``train``'s step planner, ``plan`` / ``simulate``
(:func:`dynabatch.training.workload.method_micro_batches`) and :class:`~dynabatch.integrations.dataloader.DynaBatchDataLoader`
cut the same global batch into the same micro-batches on every replica, for the dynamic method and every baseline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynabatch.training.config import TrainConfig
from dynabatch.core.methods import METHODS, methods_for
from dynabatch.data.baselines import BaselineOptions, group_shape, make_batcher
from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.integrations.dataloader import DynaBatchDataLoader
from dynabatch.plan.candidates import deal_to_replicas
from dynabatch.plan.global_plan import GlobalPlanner
from dynabatch.engine.step import micro_batch_shape
from dynabatch.training.workload import method_micro_batches

NUM_BATCHES = 3


def _rows(ids) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in row) for row in ids)


def _shape(shape) -> tuple[int, ...]:
    return tuple(int(x) for x in shape)


@pytest.fixture(scope="module")
def setup(toy_data):
    """A run of the toy mixture at one stage: its config, length limits, first global batches and the planner's
    stage cost model (what ``train`` builds, :func:`~dynabatch.training.trainer.planner_cost_model`)."""
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.trainer import planner_cost_model

    model_name = "t5-tiny" if toy_data.family == "seq2seq" else "gpt2-tiny"
    cfg = TrainConfig(model=model_name, stages=1, max_input_len=128, max_target_len=64, global_batch_tokens=3000)
    limits = LengthLimits(toy_data.family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)
    batcher = GlobalBatcher(toy_data, limits, token_budget=cfg.global_batch_tokens)
    batches = [batcher.next_batch() for _ in range(NUM_BATCHES)]
    model = build_model(model_name, vocab_size=max(toy_data.tokens.vocab_size, 8))
    return cfg, limits, batches, planner_cost_model(cfg, model.config, layout_for(model, 1))


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_train_plan_and_dataloader_cut_the_same_micro_batches(toy_data, setup, method, replicas):
    from dynabatch.commands.bench_layouts import ListBatcher
    from dynabatch.training.planner import StepPlanner

    cfg, limits, batches, cost_model = setup
    # packing_free_split at rows shorter than the longest samples, so that it cuts some
    cfg = replace(cfg, method=method, replicas=replicas, packing_free_split_tokens=96)
    options = BaselineOptions.of(cfg)
    dynamic = method == "dynamic"
    if method not in methods_for(toy_data.family, METHODS):  # split rows cut decoder-only sequences only
        with pytest.raises(ValueError, match="decoder-only"):
            method_micro_batches(method, batches[0], limits, None, cfg.stages, options, num_replicas=replicas)
        return
    planner = StepPlanner(ListBatcher(batches, limits), cfg, cost_model, toy_data.tokens)
    loader_options = (dict(cost_model=cost_model) if dynamic
                      else dict(method_options=options.batcher_options(method, limits)))
    loaders = [DynaBatchDataLoader(toy_data, limits, token_budget=cfg.global_batch_tokens, method=method,
                                   num_replicas=replicas, replica_index=r, **loader_options) for r in range(replicas)]
    candidates = set()
    for batch in batches:
        trained = planner.preview(batch)
        if not dynamic:  # the samples the baseline's groups index (packing_free_split: long ones cut into chunks)
            batch = make_batcher(method, limits, toy_data.tokens, **options.batcher_options(method, limits)).prepare(batch)
        train = [[(_rows(mb.sample_ids), _shape(micro_batch_shape(mb))) for mb in mbs]
                 for mbs in trained.replica_micro_batches]
        planned = method_micro_batches(method, batch, limits, cost_model if dynamic else None, cfg.stages, options,
                                       num_replicas=replicas)
        plan = [[(_rows(g.rows), _shape(group_shape(batch, g, limits.family))) for g in groups]
                for groups in planned.replica_groups]
        loader = [[(_rows(mb.sample_ids), _shape(micro_batch_shape(mb))) for mb in ld.step_batch(batch).micro_batches]
                  for ld in loaders]
        assert len(train) == replicas and all(train), "every replica runs micro-batches"
        assert plan == train, f"step {batch.step}: plan/simulate's micro-batches differ from train's"
        assert loader == train, f"step {batch.step}: the DataLoader's micro-batches differ from train's"
        assert planned.candidate == trained.candidate
        assert sorted(i for mbs in train for ids, _ in mbs for row in ids for i in row) == list(range(len(batch)))
        candidates.add(trained.candidate)
    if dynamic:
        assert candidates and all(candidates), "the dynamic method names the plan it kept"


def test_baselines_are_dealt_longest_first(toy_data, setup):
    """A baseline's micro-batches go to replicas by the one rule (largest padded tokens first to the least-loaded
    replica, each keeping the baseline's order), the rule of the dynamic method's baseline candidates."""
    cfg, limits, batches, _ = setup
    batch = batches[0]
    planned = GlobalPlanner("token_budget", limits, num_replicas=2, options=BaselineOptions(token_budget_tokens=512))
    replicas = planned.plan(batch).plan.replicas
    from dynabatch.data.baselines import make_batcher, GROUPING_TOKENS

    groups = make_batcher("token_budget", limits, GROUPING_TOKENS, max_tokens=512).group(batch)
    sizes = [b * (e + d) for b, e, d in (group_shape(batch, g, limits.family) for g in groups)]
    want = deal_to_replicas([g.rows for g in groups], sizes, 2)
    assert [[p.row_samples for p in pieces] for pieces in replicas] == want
    round_robin = [[g.rows for g in groups[r::2]] for r in range(2)]
    assert want != round_robin, "this batch tells the rule from dealing round-robin"


def test_fewer_micro_batches_than_replicas_is_one_clear_error(toy_data, setup):
    _, limits, batches, _ = setup
    planner = GlobalPlanner("padding", limits, num_replicas=2, options=BaselineOptions(samples_per_micro_batch=10**6))
    with pytest.raises(ValueError, match=r"padding: this global batch of \d+ samples makes 1 micro-batch\(es\), fewer "
                                         r"than the 2 replicas; lower samples_per_micro_batch, or use the dynamic"):
        planner.plan(batches[0])


def test_dynamic_needs_a_cost_model_and_a_known_method(setup):
    _, limits, _, _ = setup
    with pytest.raises(ValueError, match="needs a cost model"):
        GlobalPlanner("dynamic", limits)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        GlobalPlanner("nope", limits)


@pytest.mark.parametrize("pack_rows", ["off", "auto"])
def test_plan_prices_the_dp_per_segment_as_train_does_and_is_never_predicted_slower(pack_rows):
    """``plan``/``simulate`` cut a padding-free run's batches with the DP priced per segment (``segment_pricing``),
    as ``train`` plans them; on the heavy-tailed file's 65,536-token batches (T5, 4 stages) that plan is predicted
    no slower, by the per-segment step formula, than the plan of the DP priced dense (what ``plan`` ran before
    the one planning path)."""
    import argparse
    import os

    from dynabatch.commands.common import add_workload_arguments, resolve
    from dynabatch.plan.formula import formula_price
    from dynabatch.training.workload import global_batches

    heavy = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "heavy_tail_1024.npz")
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    w = resolve(p.parse_args(["--model", "t5", "--lengths", heavy]))
    S = w.cost_model.num_stages
    for batch in global_batches(w.path, w.family, w.limits, 65_536, 2, "builtin"):
        price = formula_price(w.cost_model, batch.input_lens, batch.target_lens, True)
        plans = {seg: GlobalPlanner("dynamic", w.limits, S, 1, w.cost_model, w.options,
                                    planner_options={"pack_rows": pack_rows, "segment_pricing": seg}).plan(batch)
                 for seg in (True, False)}
        default = GlobalPlanner("dynamic", w.limits, S, 1, w.cost_model, w.options,
                                planner_options={"pack_rows": pack_rows}).plan(batch)
        assert default.plan.replicas == plans[True].plan.replicas, "padding-free: per segment by default"
        assert price(plans[True].plan) <= price(plans[False].plan) * (1 + 1e-9)
