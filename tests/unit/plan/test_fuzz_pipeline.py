"""Fuzz: random global batches through plan_step -> stage costs -> schedule -> lower -> validate.

The case generator lives in ``scripts/fuzz_plans.py`` (run it with ``--cases 5000`` for a larger
sweep); here a fixed slice of seeds runs in the default suite (about 10 s).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from dynabatch.plan.costs import PolynomialCostModel
from dynabatch.plan.step import plan_step

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "fuzz_plans.py")
_spec = importlib.util.spec_from_file_location("fuzz_plans", _PATH)
fuzz_plans = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fuzz_plans", fuzz_plans)  # dataclasses look their module up
_spec.loader.exec_module(fuzz_plans)

NUM_CASES = 300


def test_fuzz_pipeline_no_crash_no_deadlock_every_sample_once():
    counts, failures, seconds = fuzz_plans.fuzz(NUM_CASES, first_seed=0, stop_on_failure=False)
    assert not failures, f"{len(failures)} failing seeds; first:\n{failures[0][1]}"
    assert counts["ok"] > NUM_CASES // 2, counts  # most cases plan and validate
    assert counts["clear_error"] > 0, counts  # the too-small-memory path is exercised too


def test_fuzz_cases_are_deterministic():
    for seed in (3, 17, 101):
        a, b = fuzz_plans.run_case(seed), fuzz_plans.run_case(seed)
        assert a == b


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_memory_too_small_is_the_documented_error(family):
    rng = np.random.default_rng(0)
    e = rng.integers(10, 300, 40)
    d = rng.integers(1, 30, 40) if family == "t5" else np.zeros(40, dtype=np.int64)
    e[7] = 2000  # the sample that cannot fit
    with pytest.raises(ValueError, match=r"sample 7 \(input_len=2000, target_len=\d+\) alone needs .* "
                                         r"smallest budget that fits every sample is [\d.]+ GiB \(\d+ bytes\)"):
        plan_step(e, d, PolynomialCostModel(memory_budget_bytes=2**30), 4, family=family, num_replicas=2)
