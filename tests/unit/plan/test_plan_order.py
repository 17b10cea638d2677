"""Sample orderings: permutations, deterministic (also across processes), kernels vs pure-Python twins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dynabatch.plan import _kernels as K
from dynabatch.plan.order import GPT_ORDERS, T5_ORDERS, order_samples
from reference import plan_reference as ref  # tests/ is on sys.path via its conftest.py

CASES = [("t5", o) for o in ("auto",) + T5_ORDERS] + [("gpt2", o) for o in ("auto",) + GPT_ORDERS]


def lengths(seed, n=200):
    rng = np.random.default_rng(seed)
    e = np.clip(rng.lognormal(np.log(300), 1.0, n), 4, 2048).astype(np.int64)
    d = np.clip(rng.lognormal(np.log(5), 1.2, n), 1, 256).astype(np.int64)
    e[:10] = e[10:20]  # duplicates exercise tie-breaking
    d[:10] = d[10:20]
    return e, d


@pytest.mark.parametrize("family, order", CASES)
def test_orders_are_deterministic_permutations(family, order):
    e, d = lengths(0)
    perm = order_samples(e, d, family, order)
    assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(len(e)))
    assert np.array_equal(perm, order_samples(e.copy(), d.copy(), family, order))


def test_length_and_lex_orders_sort():
    e, d = lengths(1)
    perm = order_samples(e, d, "gpt2", "length")
    assert np.all(np.diff((e + d)[perm]) >= 0)
    perm = order_samples(e, d, "t5", "lex")
    keys = list(zip(e[perm].tolist(), d[perm].tolist(), perm.tolist()))
    assert keys == sorted(keys)


def test_single_sample_and_zero_lengths():
    for family, order in CASES:
        assert order_samples(np.array([0]), np.array([0]), family, order).tolist() == [0]


@pytest.mark.parametrize("seed", range(3))
def test_curve_keys_match_twins(seed):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 2048, 60), rng.integers(0, 300, 60)
    assert K._morton_keys(x, y).tolist() == ref.morton_keys(x, y)
    assert K._hilbert_keys(x, y, 12).tolist() == ref.hilbert_keys(x, y, 12)


def test_hilbert_visits_every_cell_once_through_neighbours():
    side = 16
    x, y = np.divmod(np.arange(side * side, dtype=np.int64), side)
    keys = K._hilbert_keys(x, y, 4)
    assert sorted(keys.tolist()) == list(range(side * side))
    path = np.argsort(keys)
    steps = np.abs(np.diff(x[path])) + np.abs(np.diff(y[path]))
    assert np.all(steps == 1)


@pytest.mark.parametrize("seed", range(3))
def test_nearest_neighbour_and_two_opt_match_twins(seed):
    rng = np.random.default_rng(10 + seed)
    n = int(rng.integers(2, 60))
    x, y = rng.integers(0, 50, n), rng.integers(0, 20, n)
    start = int(rng.integers(0, n))
    path = K._nearest_neighbour_path(x, y, start)
    assert path.tolist() == ref.nearest_neighbour_path(x, y, start)
    shuffled = rng.permutation(n).astype(np.int64)
    want, want_passes = ref.two_opt(shuffled.tolist(), x, y, 7, 5)
    passes = K._two_opt(shuffled, x, y, 7, 5)
    assert shuffled.tolist() == want and passes == want_passes

    def length(p):
        return int(np.sum(np.abs(np.diff(x[p])) + np.abs(np.diff(y[p]))))

    improved = path.copy()
    K._two_opt(improved, x, y, n, 100)
    assert length(improved) <= length(path)
    assert sorted(improved.tolist()) == list(range(n))


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from dynabatch.plan.costs import PolynomialCostModel
    from dynabatch.plan.order import order_samples
    from dynabatch.plan.partition import plan_partition
    rng = np.random.default_rng(0)
    e = np.clip(rng.lognormal(np.log(300), 1.0, 300), 4, 2048).astype(np.int64)
    d = np.clip(rng.lognormal(np.log(5), 1.2, 300), 1, 256).astype(np.int64)
    out = {}
    for family, orders in (("t5", ("lex", "morton", "hilbert", "nn2opt")), ("gpt2", ("length",))):
        for order in orders:
            plan = plan_partition(e, d, PolynomialCostModel(), 4, family=family, order=order)
            out[family + "/" + order] = [plan.order.tolist(), plan.boundaries.tolist(), plan.objective_s]
    json.dump(out, sys.stdout)
    """
)


def test_plans_are_identical_across_processes_and_hash_seeds():
    results = []
    for hash_seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    in_process = {}
    exec(compile(SCRIPT.replace("json.dump(out, sys.stdout)", ""), "<script>", "exec"), in_process)
    assert json.loads(json.dumps(in_process["out"])) == results[0]
