"""The compiled stage costs (max-plus programs traced from the analytic model) against the model's own methods."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.model_specs import model_spec
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.model_specs import ATTENTION_HALVES, FFN_HALVES
from dynabatch.cost.model_specs import split_halves
from dynabatch.cost.stages import StageCostModel, StageLayout
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.cost.symbolic import NotTraceable, Sym, VARIABLES, compile_forms, maximum

RTOL = 1e-12


def _python(model: StageCostModel) -> StageCostModel:
    """The same model priced by the layer model's methods (no compiled programs)."""
    twin = dataclasses.replace(model)
    object.__setattr__(twin, "programs", None)
    return twin


def _queries(seq2seq: bool, n: int, seed: int, pairs: str):
    rng = np.random.default_rng(seed)
    b = rng.integers(1, 24, n).astype(float)
    E = rng.integers(1, 2048, n).astype(float)  # noqa: N806
    D = rng.integers(1, 512, n).astype(float) if seq2seq else None  # noqa: N806
    if pairs == "none":
        return b, E, D, None
    d = np.zeros(n) if D is None else D
    work = AttentionPairs(b * E * E * rng.uniform(0.2, 1, n), b * d * d * rng.uniform(0.2, 1, n),
                          b * d * E * rng.uniform(0.2, 1, n),
                          calls=tuple(rng.integers(1, 6, n).astype(float) for _ in range(3)) if pairs != "pairs" else None,
                          longest=(E * rng.uniform(0.3, 1, n), d * rng.uniform(0.3, 1, n)) if pairs == "all" else None)
    return b, E, D, work


CASES = [  # (model preset, hardware, stages, analytic options, recompute policy, device GiB)
    ("t5-large", "a100-40gb", 4, {}, "auto", 40),
    ("t5-large", "cpu", 2, {"context_costs": True, "dropout": False}, "none", 24),
    ("t5-base", "a100-40gb", 3, {"cast_copy_bytes": 2, "fused_cross_memory": True}, "selective", 40),
    ("gpt-1.3b", "a100-40gb", 4, {"flash_attention": True}, "auto", 40),
    ("gpt-350m", "a100-80gb", 2, {"dense_masks": True, "recompute": True}, "full", 80),
    ("llama3.2-1b", "h100-80gb", 2, {"flash_memory": True}, "auto", 16),
]


@pytest.mark.parametrize("preset,hardware,stages,options,policy,gib", CASES)
@pytest.mark.parametrize("pairs", ["none", "pairs", "calls", "all"])
def test_compiled_stage_costs_equal_the_layer_model(preset, hardware, stages, options, policy, gib, pairs):
    layer = AnalyticCostModel.from_names(preset, hardware, **options)
    model = StageCostModel(layer, balanced_layout(layer, stages), gib * 2**30, recompute=policy)
    assert model.programs is not None
    reference = _python(model)
    b, E, D, work = _queries(is_seq2seq(model_spec(preset).family), 600, seed=len(preset) + stages, pairs=pairs)  # noqa: N806

    got, want = model.per_stage(b, E, D, work), reference.per_stage(b, E, D, work)
    for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes", "send_bytes", "load_bytes"):
        np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=RTOL, err_msg=f)
    assert (got.recompute is None) == (want.recompute is None)
    if got.recompute is not None:
        assert np.array_equal(got.recompute, want.recompute)

    for compiled, python in zip(model.evaluate(b, E, D, work), reference.evaluate(b, E, D, work)):
        np.testing.assert_allclose(compiled, python, rtol=RTOL)
    traced = model.programs.traced()  # priced by the programs, not by a fallback to the methods
    assert traced and all(traced.values()), traced


@pytest.mark.parametrize("preset", ["t5-base", "gpt-350m"])
def test_compiled_costs_of_a_layout_cut_inside_blocks(preset):
    """Stages cut between a block's attention and feed-forward halves (``--split-blocks``), as the planner's
    balanced splits cut them."""
    layer = AnalyticCostModel.from_names(preset, "a100-40gb")
    kinds = split_halves(layer.layer_kinds())
    cut = [len(kinds) // 3 + 1, 2 * len(kinds) // 3 + 1]  # odd positions: inside blocks
    layout = StageLayout(tuple(tuple(kinds[a:b]) for a, b in zip([0, *cut], [*cut, len(kinds)])))
    assert any(k in ATTENTION_HALVES for k in layout.stages[0]) and any(k in FFN_HALVES for k in layout.stages[1])
    model = StageCostModel(layer, layout, 40 * 2**30, recompute="auto")
    for pairs in ("none", "all"):
        b, E, D, work = _queries(is_seq2seq(layer.spec.family), 500, seed=7, pairs=pairs)  # noqa: N806
        got, want = model.per_stage(b, E, D, work), _python(model).per_stage(b, E, D, work)
        for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes", "send_bytes"):
            np.testing.assert_allclose(getattr(got, f), getattr(want, f), rtol=RTOL, err_msg=f)
        for compiled, python in zip(model.evaluate(b, E, D, work), _python(model).evaluate(b, E, D, work)):
            np.testing.assert_allclose(compiled, python, rtol=RTOL)


def test_auto_recomputes_some_entries_and_keeps_the_others():
    """The case the planner meets: under ``auto`` some runs fit without recomputation and some do not; both kinds
    of entry match the layer model's pricing, and the second kind is really priced with recomputation."""
    layer = AnalyticCostModel.from_names("t5-large", "a100-40gb")
    model = StageCostModel(layer, balanced_layout(layer, 4), 12 * 2**30, recompute="auto")
    b, E, D, work = _queries(True, 2000, seed=3, pairs="all")  # noqa: N806
    modes = _python(model).per_stage(b, E, D, work).recompute
    assert modes is not None and 0.05 < np.mean(modes.any(axis=0)) < 0.95
    for compiled, python in zip(model.evaluate(b, E, D, work), _python(model).evaluate(b, E, D, work)):
        np.testing.assert_allclose(compiled, python, rtol=RTOL)


def test_compiled_inputs_are_checked_as_the_model_checks_them():
    layer = AnalyticCostModel.from_names("gpt-350m", "a100-40gb")
    model = StageCostModel(layer, balanced_layout(layer, 2), 40 * 2**30)
    with pytest.raises(ValueError, match="E must be finite and >= 1"):
        model.evaluate(np.array([1.0, 2.0]), np.array([0.0, 8.0]), None)
    with pytest.raises(ValueError, match="pairs must be an AttentionPairs"):
        model.evaluate(np.array([1.0]), np.array([8.0]), None, pairs=(1.0, 0.0, 0.0))


@pytest.mark.parametrize("preset,policy", [("t5-large", "auto"), ("gpt-1.3b", "auto"), ("t5-base", "full"),
                                           ("gpt-350m", "none")])
def test_variables_as_rows_are_priced_as_evaluate_prices_them(preset, policy):
    """``evaluate_variables`` (the planner's runs, their inputs laid out as the rows of ``VARIABLES`` with no
    per-call check) gives exactly what ``evaluate`` gives; with ``b``, ``E`` or ``D`` below 1 it gives ``None``, and
    ``evaluate`` says why."""
    layer = AnalyticCostModel.from_names(preset, "a100-40gb")
    model = StageCostModel(layer, balanced_layout(layer, 4), 12 * 2**30, recompute=policy)
    seq2seq = is_seq2seq(layer.spec.family)
    for pairs in ("none", "pairs", "calls", "all"):
        b, E, D, work = _queries(seq2seq, 700, seed=len(preset), pairs=pairs)  # noqa: N806
        x = np.zeros((len(VARIABLES), b.size))
        x[0], x[1] = b, E
        if seq2seq:
            x[2] = D
        if work is not None:
            x[3], x[4], x[5] = work.encoder, work.decoder, work.cross
            for r, a in zip((6, 7, 8), work.calls or ()):
                x[r] = a
            for r, a in zip((9, 10), work.longest or ()):
                x[r] = a
        got = model.evaluate_variables(x, pairs=work is not None, calls=pairs in ("calls", "all"),
                                       longest=pairs == "all")
        for rows, evaluated in zip(got, model.evaluate(b, E, D, work)):
            assert np.array_equal(rows, evaluated)
    x[1, 5] = 0.0
    assert model.evaluate_variables(x, pairs=True, calls=True, longest=True) is None
    assert _python(model).evaluate_variables(x[:, :5], pairs=True) is None  # not compiled: evaluate prices it


def test_scalar_and_two_dimensional_queries_keep_their_shape():
    layer = AnalyticCostModel.from_names("t5-base", "a100-40gb")
    model = StageCostModel(layer, balanced_layout(layer, 2), 40 * 2**30, recompute="auto")
    grid = (np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]), np.full((2, 3), 512.0), np.full((2, 3), 128.0))
    for compiled, python in zip(model.evaluate(*grid), _python(model).evaluate(*grid)):
        assert compiled.shape == (2, 3)
        np.testing.assert_allclose(compiled, python, rtol=RTOL)
    t, _, _ = model.evaluate(4, 512, 128)
    assert np.ndim(t) == 0 and float(t) == pytest.approx(float(_python(model).evaluate(4, 512, 128)[0]), rel=RTOL)


def test_forms_sum_distribute_and_flatten_maxima():
    b, E = Sym.variable("b"), Sym.variable("E")  # noqa: N806
    x = np.array([[3.0, 1.0, 2.0], [5.0, 40.0, 0.5]])  # b, E for three entries (other variables unused)
    rows = np.zeros((len(VARIABLES), 3))
    rows[:2] = x
    forms = [2 * b * E + 1, b * maximum(E, 10.0), maximum(maximum(b, E), 3.0) - b, (b + E) ** 2 / 4]
    program = compile_forms(forms)
    bb, ee = x
    want = [2 * bb * ee + 1, bb * np.maximum(ee, 10), np.maximum(np.maximum(bb, ee), 3) - bb, (bb + ee) ** 2 / 4]
    np.testing.assert_allclose(program.run(rows), np.array(want), rtol=RTOL)
    assert program.kinds.tolist().count(1) == 2  # max(b, E, 3) is one node: nested maxima flattened


def test_what_a_form_cannot_express_is_refused():
    b, E = Sym.variable("b"), Sym.variable("E")  # noqa: N806
    with pytest.raises(NotTraceable):
        _ = maximum(b, E) * maximum(b, 2.0)  # a product of maxima
    with pytest.raises(NotTraceable):
        bool(b > E)
    with pytest.raises(NotTraceable):
        _ = 1.0 / b
    with pytest.raises(NotTraceable):
        np.where(b, 1.0, 2.0)


@pytest.mark.parametrize("policy,single_alone", [(0, False), (1, True), (1, False)])
def test_plain_planner_view_equals_the_entry_by_entry_view(policy, single_alone):
    """Where no stage recomputes, the stage-by-stage reduction gives the entry-by-entry kernel's values exactly:
    times, stored and peak bytes (the tightest stage's where the maxima do not fit), and which entries fit."""
    from dynabatch.cost._kernels import _planner_view, _planner_view_plain

    rng = np.random.default_rng(policy + 2 * single_alone)
    S, n = 4, 3000  # noqa: N806
    priced = rng.random((5, S, n)) * np.array([1.0, 2.0, 5e9, 3e9, 1e9])[:, None, None]
    priced[:, :, :40] = priced[:, :1, :40]  # ties between stages
    load, b = rng.random(n) * 1e8, rng.integers(1, 4, n).astype(float)
    outs = []
    for kernel in ("plain", "entries"):
        out = [np.empty(n) for _ in range(3)] + [np.empty(n, dtype=np.bool_)]
        view = (S, single_alone, 25e9, policy, *out)
        if kernel == "plain":
            _planner_view_plain(*priced, load, b, *view)
        else:
            _planner_view(*priced, load, np.arange(n), np.zeros((6, 1, 0)), False, b, *view)
        outs.append(out)
    for got, want in zip(*outs):
        assert np.array_equal(got, want)
    assert 0.1 < outs[0][3].mean() < 0.9  # some fit, some do not
