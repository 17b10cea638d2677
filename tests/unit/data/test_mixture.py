"""Mixture specs, rates (examples-proportional with cap) and the resumable sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.data.mixture import MixtureSampler, MixtureSpec, mixture_rates
from dynabatch.data.source_spec import SourceSpec


def _spec(rule="examples_proportional", cap=None, rates=None):
    sources = tuple(
        SourceSpec(task=f"t{i}", data_files=(f"f{i}.jsonl",), rate=None if rates is None else rates[i]) for i in range(3)
    )
    return MixtureSpec(sources=sources, rule=rule, cap=cap)


def test_examples_proportional_with_cap():
    rates = mixture_rates(_spec(cap=300), [40, 150, 600])
    np.testing.assert_allclose(rates, np.array([40, 150, 300]) / 490)


def test_fixed_rates_normalised():
    rates = mixture_rates(_spec(rule="fixed", rates=[1.0, 1.0, 2.0]), [40, 150, 600])
    np.testing.assert_allclose(rates, [0.25, 0.25, 0.5])


def test_rates_measured_over_many_draws():
    counts = [40, 150, 600]
    rates = mixture_rates(_spec(cap=300), counts)
    sampler = MixtureSampler(rates=rates, num_examples=counts, seed=3)
    draws = np.array([sampler.draw()[0] for _ in range(40_000)])
    measured = np.bincount(draws, minlength=3) / len(draws)
    # 40k draws: binomial standard error < 0.0025; allow 4 sigma.
    np.testing.assert_allclose(measured, rates, atol=0.01)


def test_sampler_visits_each_row_once_per_epoch():
    sampler = MixtureSampler(rates=np.array([1.0]), num_examples=[97], seed=0)
    first = [sampler.draw()[1] for _ in range(97)]
    second = [sampler.draw()[1] for _ in range(97)]
    assert sorted(first) == list(range(97)) and sorted(second) == list(range(97))
    assert first != second  # a new permutation every epoch


def test_sampler_resume_is_exact():
    rates, counts = np.array([0.2, 0.3, 0.5]), [5, 11, 17]
    a = MixtureSampler(rates=rates, num_examples=counts, seed=11)
    for _ in range(123):
        a.draw()
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
    expected = [a.draw() for _ in range(200)]
    b = MixtureSampler(rates=rates, num_examples=counts, seed=11)
    b.load_state_dict(state)
    assert [b.draw() for _ in range(200)] == expected
    c = MixtureSampler(rates=rates, num_examples=counts, seed=12)
    with pytest.raises(ValueError, match="seed"):
        c.load_state_dict(state)


def test_sampler_deterministic_and_seed_dependent():
    rates, counts = np.array([0.5, 0.5]), [50, 50]
    runs = [[MixtureSampler(rates=rates, num_examples=counts, seed=s).draw() for _ in range(1)] for s in (1, 1)]
    assert runs[0] == runs[1]
    x = MixtureSampler(rates=rates, num_examples=counts, seed=1)
    y = MixtureSampler(rates=rates, num_examples=counts, seed=2)
    assert [x.draw() for _ in range(50)] != [y.draw() for _ in range(50)]


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"sources": []}, "at least one source"),
        ({"sources": [{"task": "a", "data_files": "x.jsonl", "rate": 1.0}]}, "set rule: fixed"),
        ({"rule": "fixed", "sources": [{"task": "a", "data_files": "x.jsonl"}]}, "needs a rate"),
        ({"rule": "fixed", "sources": [{"task": "a", "data_files": "x.jsonl", "rate": 0.0}]}, "sum to zero"),
        ({"rule": "bogus", "sources": [{"task": "a", "data_files": "x.jsonl"}]}, "rule must be one of"),
        ({"sources": [{"task": "a"}]}, "exactly one of"),
        ({"sources": [{"task": "a", "data_files": "x", "colums": {}}]}, "unknown keys"),
        ({"sources": [{"task": "a", "data_files": "x", "columns": {"input": "q"}}]}, "unknown keys in 'columns'"),
        ({"sauces": []}, "'sources' list"),
    ],
)
def test_bad_specs_give_clear_errors(raw, match):
    with pytest.raises(ValueError, match=match):
        MixtureSpec.from_dict(raw)


def test_spec_from_yaml_resolves_relative_paths(tmp_path):
    (tmp_path / "m.yaml").write_text("cap: 10\nsources:\n  - task: a\n    data_files: sub/a.jsonl\n")
    spec = MixtureSpec.from_file(str(tmp_path / "m.yaml"))
    assert spec.sources[0].data_files == (str(tmp_path / "sub" / "a.jsonl"),)
    assert spec.cap == 10
