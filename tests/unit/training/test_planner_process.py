"""``--planner process``: the child process plans exactly the thread planner's steps (their lowered, validated
plans included), with and without online calibration; a crash in the child is the thread planner's one-line
error; nothing waits forever."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from dynabatch.training.config import TrainConfig
from dynabatch.training.plan_ahead import PlanAhead
from dynabatch.training.planner_process import ProcessPlanAhead
from dynabatch.schedule.step import lower_step as plan_step


def _planner(toy_data, calibrated: bool = False, plan_costs: str = "auto"):
    from dynabatch.cost.online import OnlineFit
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for, pipeline_spec_for
    from dynabatch.training.calibration import RunCalibration
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    cfg = TrainConfig(model="gpt2-tiny", stages=2, global_batch_tokens=1024, max_input_len=128, max_target_len=32,
                      plan_ahead=1, plan_costs=plan_costs)
    model = build_model("gpt2-tiny", vocab_size=toy_data.tokens.vocab_size)
    base = planner_cost_model(cfg, model.config, layout_for(model, 2))
    limits = LengthLimits(toy_data.family, max_input_len=128, max_target_len=32, max_seq_len=128)
    cal = RunCalibration(base, OnlineFit(2, False) if calibrated else None, cfg.plan_ahead, -1)
    spec = pipeline_spec_for(model, layout_for(model, 2), "float32")
    return StepPlanner(GlobalBatcher(toy_data, limits, token_budget=1024), cfg, base, toy_data.tokens, calibration=cal,
                       spec=spec)


class _Ctx:  # one replica of two stages
    num_stages = 2

    @staticmethod
    def rank_of(r, s):
        return s


def _measured(planned):
    """Deterministic 'measurements': 3x the base forward/backward features' first column plus 2 ms."""
    out = []
    for s in range(2):
        x = planned.features[0][s]
        out.append({op: {(s, m): float(3 * x[d, m, 0] + 2e-3) for m in range(x.shape[1])} for d, op in enumerate("FB")}
                   | {"saved_peak": 1000})
    return out


def _run(ahead, planner, steps: int, calibrated: bool):
    got = []
    try:
        for _ in range(steps):
            p, _ = ahead.get(timeout_s=60)
            if calibrated:
                planner.calibration.record(_Ctx, p, _measured(p), p.predicted_makespan_s * 1.1 + 0.01)
            got.append(p)
    finally:
        planner.calibration.close()
        ahead.close(timeout_s=30)
    return got


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
@pytest.mark.parametrize("calibrated, plan_costs", [(False, "auto"), (True, "auto"), (True, "scaled")])
def test_process_planner_delivers_the_thread_planners_steps(toy_data, calibrated, plan_costs):
    steps = 4  # plan_ahead 1: steps 2 and 3 are planned with the fit of steps 0 and 1 (scaled: the base model scaled to it)
    thread_planner, process_planner = _planner(toy_data, calibrated, plan_costs), _planner(toy_data, calibrated, plan_costs)
    want = _run(PlanAhead(thread_planner, steps, 2), thread_planner, steps, calibrated)
    got = _run(ProcessPlanAhead(process_planner, steps, 2), process_planner, steps, calibrated)
    for w, g in zip(want, got, strict=True):
        assert (w.step, w.shapes, w.schedules, w.slice_links) == (g.step, g.shapes, g.schedules, g.slice_links)
        assert w.predicted_step_s == g.predicted_step_s and w.batcher_state_after == g.batcher_state_after
        for c_w, c_g in zip(w.costs, g.costs):
            np.testing.assert_array_equal(c_w.fwd_s, c_g.fwd_s)
        one = (np.array([2.0]), np.array([64.0]), np.array([0.0]))  # the model each step was planned with
        np.testing.assert_array_equal(w.plan_model.per_stage(*one).fwd_s, g.plan_model.per_stage(*one).fwd_s)
        for mbs_w, mbs_g in zip(w.replica_micro_batches, g.replica_micro_batches):
            assert [m.sample_ids for m in mbs_w] == [m.sample_ids for m in mbs_g]
            assert all((a.input_ids == b.input_ids).all() for a, b in zip(mbs_w, mbs_g))
    if calibrated:
        assert want[-1].predicted_step_s != want[0].predicted_step_s  # the fit moved the predictions
    for w, g in zip(want, got):  # the lowered plans too: what train_step lowers itself without them
        again = plan_step([list(s) for s in w.shapes], process_planner.spec, policy=process_planner.cfg.policy,
                          step=w.step, costs=w.costs, memory_limit_bytes=process_planner.cfg.memory_gib * 2**30,
                          schedules=w.schedules, slice_links=w.slice_links, model_state_bytes=w.model_state_bytes)
        assert sorted(w.plans) == sorted(g.plans) == sorted(again) == [0, 1]
        assert all(w.plans[r].to_bytes() == g.plans[r].to_bytes() == again[r].to_bytes() for r in again)


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_a_crash_in_the_child_is_the_thread_planners_one_line_error(toy_data, monkeypatch):
    monkeypatch.setenv("DYNABATCH_PLANNER_CRASH_AT", "1")  # the spawned child inherits the environment
    planner = _planner(toy_data)
    ahead = ProcessPlanAhead(planner, 3, 2)
    try:
        assert ahead.get(timeout_s=60)[0].step == 0
        with pytest.raises(RuntimeError, match=r"^the background planner failed: RuntimeError: injected planner "
                                               r"crash at step 1 \(DYNABATCH_PLANNER_CRASH_AT\)$"):
            ahead.get(timeout_s=60)
    finally:
        ahead.close(timeout_s=30)


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_nothing_waits_forever(toy_data):
    """A calibrated child waiting for a fit the loop never records: ``get`` times out with a clear error, and
    ``close`` stops the child (it also terminates one that does not stop, and a killed child is reported)."""
    planner = _planner(toy_data, calibrated=True)
    planner.calibration.recorded_through = -2  # as before a start-up calibration that never comes
    ahead = ProcessPlanAhead(planner, 3, 2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="produced no step within 2 s"):
        ahead.get(timeout_s=2)
    ahead.close(timeout_s=5)
    assert not ahead._process.is_alive() and time.monotonic() - start < 20
    ahead = ProcessPlanAhead(_planner(toy_data), 3, 1)
    ahead._process.kill()
    with pytest.raises(RuntimeError, match=r"process died \(exit code -9\)"):
        ahead.get(timeout_s=30)
    ahead.close(timeout_s=5)


def test_steps_travel_with_their_tensors_as_numpy_and_come_back_equal():
    import pickle

    import torch

    from dynabatch.training.planner_process import _dumps

    x = {"view": torch.arange(6).reshape(2, 3)[:, 1:], "bf16": torch.ones(3, dtype=torch.bfloat16),
         "mask": torch.tensor([True, False])}
    y = pickle.loads(_dumps(x))
    for k in x:
        assert y[k].dtype == x[k].dtype and torch.equal(y[k], x[k])
    assert y["view"].is_contiguous()  # rebuilt from numpy: a compact copy of the view


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_planner_child_does_not_outlive_its_rank(tmp_path):
    """A rank that dies hard (``os._exit``, as DYNABATCH_CRASH_AT does; SIGKILL) takes its planner child with it:
    an orphan would keep the rank's inherited output pipes open and hang whoever waits for them."""
    import subprocess
    import textwrap

    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import multiprocessing as mp, os, time
        from dynabatch.training.planner_process import _die_with_parent

        def child(path):
            _die_with_parent()
            open(path, "w").write(str(os.getpid()))
            time.sleep(60)

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child, args=({str(pid_file)!r},))
            p.start()
            while not os.path.exists({str(pid_file)!r}):
                time.sleep(0.05)
            time.sleep(0.2)
            os._exit(17)
    """)
    path = tmp_path / "rank.py"  # a file: a spawned child imports its target from the parent's __main__
    path.write_text(script)
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 17, res.stderr[-2000:]
    child = int(pid_file.read_text())

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie awaiting its reaper is gone
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(), "the planner child outlived its parent"
