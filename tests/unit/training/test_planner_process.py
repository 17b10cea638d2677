"""``--planner process``: the child process plans exactly the thread planner's steps (their lowered, validated
plans included), with and without online calibration, and sends plans only (no tensors, no token ids); a crash in the child is the thread planner's one-line
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


def _integer_arrays(obj, seen=None):
    """Every integer array reachable from ``obj`` (tensors as numpy), flattened to int64."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        obj = obj.numpy()
    if isinstance(obj, np.ndarray):
        return [obj.astype(np.int64).ravel()] if obj.dtype.kind in "iu" else []
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [a for x in items for a in _integer_arrays(x, seen)]


def _token_runs(obj, samples) -> int:
    """How many of ``samples``' token sequences (inputs + targets, 8 tokens or more) appear whole in an integer
    array reachable from ``obj``."""
    arrays = [a.tobytes() for a in _integer_arrays(obj)]
    runs = [np.concatenate([s.input_ids, s.target_ids]).astype(np.int64).tobytes() for s in samples if s.num_tokens >= 8]
    assert runs, "the batch has no sample long enough to look for"
    return sum(any(r in a for a in arrays) for r in runs)


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_the_planner_process_sends_plans_only(toy_data):
    """What the child puts on its queue per step: no tensor, no tokenized sample or micro-batch (no class of
    torch's or of the data's unpickles from it) and no token ids in any integer array; the parent rebuilds the
    batch and collates the thread planner's micro-batches from it. The same probes find the tokens in a step
    that carries its data, and the child's pickler refuses such a step."""
    import pickle

    from dynabatch.training.planner_process import _dumps

    classes = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            classes.append((module, name))
            return super().find_class(module, name)

    planner, reference = _planner(toy_data), _planner(toy_data)
    ahead = ProcessPlanAhead(planner, 3, 2)
    try:
        for step in range(3):
            raw = ahead._out.get(timeout=60)
            sent = Recording(__import__("io").BytesIO(raw)).load()
            assert sent.step == step and "replica_micro_batches" not in vars(sent)  # nothing collated
            planned = planner.with_data(sent)
            want = reference()
            assert _token_runs(sent, planned.batch.samples) == 0
            assert [s.row_index for s in planned.batch.samples] == [s.row_index for s in want.batch.samples]
            for mbs_w, mbs_g in zip(want.replica_micro_batches, planned.replica_micro_batches, strict=True):
                assert [m.sample_ids for m in mbs_w] == [m.sample_ids for m in mbs_g]
                assert all((a.input_ids == b.input_ids).all() for a, b in zip(mbs_w, mbs_g))
                assert all((a.target_ids == b.target_ids).all() for a, b in zip(mbs_w, mbs_g))
    finally:
        ahead.close(timeout_s=30)
    assert not [c for c in classes if c[0].split(".")[0] == "torch"], classes
    data_classes = {"TokenizedSample", "GlobalBatch", "CausalMicroBatch", "Seq2SeqMicroBatch"}
    assert not [c for c in classes if c[1] in data_classes], classes
    assert ("dynabatch.data.sample", "BatchRows") in classes
    # the probes can fail: a step that carries its data shows its tokens, and the child would refuse to send it
    assert _token_runs(want, want.batch.samples) > 0  # its batch, and its micro-batches, collated above
    assert _token_runs(want.replica_micro_batches, want.batch.samples) > 0
    with pytest.raises(TypeError, match="sends plans only, not a"):
        _dumps(want)
    assert _token_runs(pickle.loads(_dumps(want.without_data())), want.batch.samples) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_planner_child_does_not_outlive_its_rank(tmp_path):
    """A rank that dies hard (``os._exit``, as DYNABATCH_CRASH_AT does; SIGKILL) takes its planner child with it:
    an orphan would keep the rank's inherited output pipes open and hang whoever waits for them."""
    import subprocess
    import textwrap

    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import multiprocessing as mp, os, time
        from dynabatch.engine.faults import die_with_parent

        def child(path):
            die_with_parent()
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
