"""Simulator: exact makespans of GPipe/1F1B, a hand-computed timeline, memory, deadlocks, the CLI command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.core.methods import CAUSAL_ONLY
from dynabatch.data.baselines import BASELINES
from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.policies import gpipe, one_f_one_b
from dynabatch.schedule.simulate import simulate


def equal_costs(num_stages, num_mb, fwd=1.0, bwd=2.0, stored=1.0, peak=0.0) -> StageCosts:
    ones = np.ones((num_stages, num_mb))
    return StageCosts(fwd * ones, bwd * ones, stored * ones, peak * ones, ones)


# Convention: every micro-batch takes fwd f and bwd b on every stage, messages are free (send_time None).
# Then GPipe and 1F1B both take (M + S - 1)(f + b): f and b are dyadic, so float sums are exact.
SHAPES = [(s, m) for s in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8, 13)]


@pytest.mark.parametrize("num_stages, num_mb", SHAPES)
@pytest.mark.parametrize("fwd, bwd", [(1.0, 2.0), (2.0, 1.0), (0.5, 0.5), (3.0, 0.25)])
def test_1f1b_and_gpipe_makespan_is_exact(num_stages, num_mb, fwd, bwd):
    costs = equal_costs(num_stages, num_mb, fwd, bwd)
    for schedule in (one_f_one_b(num_mb, num_stages), gpipe(num_mb, num_stages)):
        r = simulate(schedule, costs)
        assert r.makespan_s == (num_mb + num_stages - 1) * (fwd + bwd)
        assert r.busy_s.tolist() == [num_mb * (fwd + bwd)] * num_stages
        assert r.bubble_fraction == pytest.approx((num_stages - 1) / (num_mb + num_stages - 1), abs=1e-12)


@pytest.mark.parametrize("num_stages, num_mb", [(2, 3), (4, 8), (3, 1)])
def test_gpipe_makespan_with_send_time(num_stages, num_mb):
    """GPipe pays the send time once per stage boundary on the way down and once on the way up."""
    costs = equal_costs(num_stages, num_mb, 1.0, 2.0)
    r = simulate(gpipe(num_mb, num_stages), costs, send_time=0.25)
    assert r.makespan_s == (num_mb + num_stages - 1) * 3.0 + 2 * (num_stages - 1) * 0.25


def test_hand_computed_timeline():
    costs = StageCosts(
        fwd_s=np.array([[1.0, 2.0], [3.0, 1.0]]),
        bwd_s=np.array([[2.0, 4.0], [1.0, 1.0]]),
        stored_bytes=np.array([[10.0, 20.0], [5.0, 5.0]]),
        peak_bytes=np.array([[1.0, 2.0], [0.0, 0.0]]),
        send_bytes=np.zeros((2, 2)),
    )
    schedule = ComputeSchedule.from_str("F0 F1 B0 B1\nF0 B0 F1 B1")
    r = simulate(schedule, costs, send_time=0.5, model_state_bytes=[100.0, 0.0], memory_limit_bytes=131.0)
    assert r.start_s.tolist() == [[0.0, 1.0, 6.0, 8.0], [1.5, 4.5, 5.5, 6.5]]
    assert r.end_s.tolist() == [[1.0, 3.0, 8.0, 12.0], [4.5, 5.5, 6.5, 7.5]]
    assert r.makespan_s == 12.0
    assert r.busy_s.tolist() == [9.0, 6.0]
    assert r.bubble_fraction == pytest.approx(1 - 15 / 24)
    assert r.op_memory_bytes[0].tolist() == [111.0, 132.0, 131.0, 122.0]
    assert r.after_memory_bytes[0].tolist() == [110.0, 130.0, 120.0, 100.0]
    assert r.peak_memory_bytes.tolist() == [132.0, 5.0]
    assert not r.fits_memory  # 132 > 131 on stage 0


def test_memory_of_1f1b_and_gpipe():
    """Stage s of 1F1B holds S - s micro-batches; GPipe holds all M on every stage."""
    s_, m_ = 4, 8
    costs = equal_costs(s_, m_, stored=10.0, peak=1.0)
    r = simulate(one_f_one_b(m_, s_), costs, model_state_bytes=100.0)
    assert r.peak_memory_bytes.tolist() == [100.0 + 10.0 * (s_ - s) + 1.0 for s in range(s_)]
    r = simulate(gpipe(m_, s_), costs, model_state_bytes=100.0, memory_limit_bytes=1000.0)
    assert r.peak_memory_bytes.tolist() == [100.0 + 10.0 * m_ + 1.0] * s_
    assert r.fits_memory


def test_send_time_forms_agree():
    costs = equal_costs(3, 4)
    schedule = one_f_one_b(4, 3)
    by_array = simulate(schedule, costs, send_time=np.full((3, 4), 0.125))
    by_scalar = simulate(schedule, costs, send_time=0.125)
    by_callable = simulate(schedule, costs, send_time=lambda nbytes: 0.125 * nbytes)  # send_bytes are 1
    assert by_array.makespan_s == by_scalar.makespan_s == by_callable.makespan_s > simulate(schedule, costs).makespan_s


def test_deadlock_is_reported():
    # stage 1 wants F1 first, but stage 0 runs F1 only after B0, which needs stage 1's B0.
    schedule = ComputeSchedule.from_str("F0 B0 F1 B1\nF1 F0 B0 B1")
    with pytest.raises(ValueError, match=r"deadlocks: stage 0 waits at B0; stage 1 waits at F1"):
        simulate(schedule, equal_costs(2, 2))


def test_bad_inputs_raise_with_values():
    with pytest.raises(ValueError, match=r"2 stages x 3 micro-batches but costs are 2 x 4"):
        simulate(one_f_one_b(3, 2), equal_costs(2, 4))
    with pytest.raises(ValueError, match=r"send times have shape \(3,\)"):
        simulate(one_f_one_b(3, 2), equal_costs(2, 3), send_time=np.zeros(3))
    with pytest.raises(ValueError, match=r"memory_limit_bytes must be a scalar or have 2 entries"):
        simulate(one_f_one_b(3, 2), equal_costs(2, 3), memory_limit_bytes=[1.0, 2.0, 3.0])
    bad = equal_costs(2, 3)
    bad = StageCosts(bad.fwd_s, -bad.bwd_s, bad.stored_bytes, bad.peak_bytes, bad.send_bytes)
    with pytest.raises(ValueError, match=r"bwd_s must be finite and >= 0, got min -2.0"):
        simulate(one_f_one_b(3, 2), bad)


def test_simulate_is_fast_enough():
    """S = 4, M = 100 (800 ops) in a few ms even on a busy CPU (about 0.5 ms idle)."""
    import time

    rng = np.random.default_rng(0)
    costs = StageCosts(*(rng.random((4, 100)) for _ in range(5)))
    schedule = one_f_one_b(100, 4)
    simulate(schedule, costs)
    start = time.perf_counter()
    for _ in range(10):
        simulate(schedule, costs, send_time=0.01)
    assert (time.perf_counter() - start) / 10 < 0.02


# ----------------------------------------------------------------------------- dynabatch simulate


@pytest.fixture()
def small_lengths(tmp_path) -> str:
    rng = np.random.default_rng(0)
    n = 400
    e = np.clip(rng.lognormal(np.log(200), 0.8, n), 1, 2000).astype(np.int64)
    d = np.clip(rng.lognormal(np.log(8), 1.0, n), 1, 300).astype(np.int64)
    path = tmp_path / "lengths.npz"
    np.savez(path, input_len=e, target_len=d)
    return str(path)


def _main(argv: list[str]) -> int:
    from dynabatch import cli

    if "simulate" not in cli.COMMANDS:  # until cli.py registers the command
        cli.COMMANDS["simulate"] = ("dynabatch.commands.simulate", "simulate")
    return cli.main(argv)


@pytest.mark.parametrize("model", ["t5", "gpt"])
def test_simulate_command_json(small_lengths, tmp_path, capsys, model):
    argv = ["simulate", "--lengths", small_lengths, "--model", model, "--max-input-len", "512",
            "--global-batch-tokens", "16384", "--num-batches", "2", "--search-steps", "4", "--json"]
    if model == "t5":
        argv += ["--trace-dir", str(tmp_path / "traces")]
    assert _main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    every = {"dynamic", "dynamic_sliced", *BASELINES}  # T5: no token slices, no split rows
    assert set(out["methods"]) == (every - CAUSAL_ONLY if model == "t5" else every)
    for row in out["methods"].values():
        for key in ("tokens_per_s", "padding_efficiency", "efficiency", "bubble_fraction", "peak_memory_gib",
                    "fits_memory", "schedule_ms_median", "policies"):
            assert key in row
        assert 0 <= row["bubble_fraction"] < 1 and row["tokens_per_s"] > 0 and 0 < row["padding_efficiency"] <= 1
    assert out["dynamic_throughput_vs_best_baseline"] > 0
    if model == "t5":
        names = sorted(p.name for p in (tmp_path / "traces").iterdir())
        assert names == ["dynamic_step0.json", "dynamic_step0.png", "packing_step0.json", "packing_step0.png"]


def test_simulate_command_table(small_lengths, capsys):
    argv = ["simulate", "--lengths", small_lengths, "--model", "t5", "--max-input-len", "512",
            "--global-batch-tokens", "16384", "--num-batches", "1", "--search-steps", "0"]
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert "dynamic vs best baseline" in out and "bubble" in out and "packing" in out


def test_with_message_buffers_adds_both_links():
    from dynabatch.schedule.simulate import with_message_buffers

    costs = equal_costs(3, 2)
    costs = StageCosts(costs.fwd_s, costs.bwd_s, costs.stored_bytes, costs.peak_bytes,
                       np.array([[10.0, 20.0], [1.0, 2.0], [0.0, 0.0]]))
    out = with_message_buffers(costs)
    assert out.stored_bytes.tolist() == [[1 + 20.0, 1 + 40.0], [1 + 22.0, 1 + 44.0], [1 + 2.0, 1 + 4.0]]
    assert out.fwd_s is costs.fwd_s


def test_a_stage_busy_the_whole_step_has_no_negative_bubble():
    """One stage is busy from its first op to its last: the busy time summed op by op may round a hair above the
    makespan, and the summary printed ``predicted bubble -0.000``."""
    fwd = np.array([[0.194, 0.079, 0.953, 0.183, 0.313]])
    bwd = np.array([[0.408, 0.817, 0.297, 0.157, 0.427]])
    ones = np.ones_like(fwd)
    r = simulate(gpipe(5, 1), StageCosts(fwd, bwd, ones, 0 * ones, ones))
    assert r.bubble_fraction == 0.0
