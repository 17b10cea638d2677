"""Timelines: Chrome-trace events of a simulated step, round trip through JSON, PNG output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.compute import Phase
from dynabatch.schedule.policies import one_f_one_b
from dynabatch.schedule.simulate import simulate
from dynabatch.schedule.trace import (
    TimelineOp,
    plot_timeline,
    read_chrome_trace,
    timeline_ops,
    to_chrome_trace,
    write_chrome_trace,
)


@pytest.fixture()
def result():
    rng = np.random.default_rng(0)
    num_stages, num_mb = 3, 4
    fwd = rng.uniform(0.01, 0.02, (num_stages, num_mb))
    costs = StageCosts(fwd, 2 * fwd, np.full((num_stages, num_mb), 2**30), np.full((num_stages, num_mb), 2**28),
                       np.ones((num_stages, num_mb)))
    return simulate(one_f_one_b(num_mb, num_stages), costs, send_time=0.001, model_state_bytes=2**32,
                    memory_limit_bytes=2**34)


SHAPES = np.array([[4, 128, 16], [2, 512, 8], [8, 64, 4], [1, 1024, 32]])


def test_chrome_trace_events(result):
    trace = to_chrome_trace(result, shapes=SHAPES, pid=7, process_name="sim")
    json.dumps(trace)  # serialisable
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == 2 * 4 * 3
    assert {e["pid"] for e in trace["traceEvents"]} == {7}
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert meta[0]["args"] == {"name": "sim"}
    assert [m["args"]["name"] for m in meta[1:]] == ["stage 0", "stage 1", "stage 2"]
    stage1 = [e for e in ops if e["tid"] == 1]
    assert [e["name"] for e in stage1] == [str(op) for op in result.schedule.stages[1]]
    first = stage1[0]
    assert first["cat"] == "forward" and first["ts"] == pytest.approx(result.start_s[1, 0] * 1e6)
    assert first["dur"] == pytest.approx((result.end_s[1, 0] - result.start_s[1, 0]) * 1e6)
    assert first["args"]["micro_batch"] == 0 and first["args"]["shape"] == [4, 128, 16]
    assert first["args"]["memory_gib"] == pytest.approx(result.op_memory_bytes[1, 0] / 2**30)
    assert {e["cat"] for e in ops} == {"forward", "backward"}
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"memory stage 0", "memory stage 1", "memory stage 2"}
    assert max(e["args"]["GiB"] for e in counters) == pytest.approx(result.peak_memory_bytes.max() / 2**30)
    assert trace["otherData"]["policy"] == "1f1b" and trace["otherData"]["makespan_s"] == result.makespan_s


def test_chrome_trace_round_trip(result, tmp_path):
    path = tmp_path / "step.json"
    write_chrome_trace(result, str(path), shapes=SHAPES)
    back = read_chrome_trace(str(path))
    want = timeline_ops(result)
    assert [(o.stage, o.phase, o.micro_batch) for o in back] == [(o.stage, o.phase, o.micro_batch) for o in want]
    assert np.allclose([o.start_s for o in back], [o.start_s for o in want], atol=1e-12)
    assert np.allclose([o.end_s for o in back], [o.end_s for o in want], atol=1e-12)


def test_measured_timeline_uses_the_same_format(tmp_path):
    """The runtime writes executed steps from TimelineOps with measured times (no memory known)."""
    ops = [TimelineOp(0, Phase.FORWARD, 0, 0.0, 0.01), TimelineOp(0, Phase.BACKWARD, 0, 0.02, 0.04),
           TimelineOp(1, Phase.FORWARD, 0, 0.011, 0.02), TimelineOp(1, Phase.BACKWARD, 0, 0.02, 0.019 + 0.001)]
    trace = to_chrome_trace(ops, process_name="executed step 3", pid=1)
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["F0", "B0", "F0", "B0"]
    assert not [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert read_chrome_trace(trace, pid=1)[1].end_s == pytest.approx(0.04)
    plot_timeline(ops, str(tmp_path / "measured.png"))
    with pytest.raises(ValueError, match="micro-batch 0 has no shape"):
        to_chrome_trace(ops, shapes=np.zeros((0, 3)))


def test_png_is_written(result, tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(result, str(path), title="1F1B, 3 stages")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
