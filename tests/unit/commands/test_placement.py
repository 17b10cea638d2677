"""Virtual stages in the simulator (issue 17, item 1, simulated side): placements of chunks on devices,
the cyclic T5 layout, and the list scheduler that orders and replays a step on them."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from dynabatch.commands import simulate
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.stages import StageCosts
from dynabatch.cost.layer_split import cyclic_layout
from dynabatch.schedule.placement import Placement, list_schedule


def _costs(fwd, bwd, stored=0.0, peak=0.0) -> StageCosts:
    fwd = np.asarray(fwd, dtype=np.float64)
    full = lambda x: np.broadcast_to(np.asarray(x, dtype=np.float64), fwd.shape).copy()  # noqa: E731
    return StageCosts(fwd_s=fwd, bwd_s=full(bwd), stored_bytes=full(stored), peak_bytes=full(peak),
                      send_bytes=np.zeros_like(fwd))


def test_placements_deal_chunks_round_robin_and_parse():
    assert [Placement.parse("cyclic", 3).device(v) for v in range(6)] == [0, 1, 2, 0, 1, 2]
    assert Placement.parse("interleaved:3", 2).num_stages == 6 and Placement.parse("linear", 4).num_stages == 4
    for bad in ("interleaved", "interleaved:0", "cyclic:2", "zigzag"):
        with pytest.raises(ValueError):
            Placement.parse(bad, 2)


@pytest.mark.parametrize("S, M", [(2, 4), (4, 8), (3, 1)])
def test_linear_equal_micro_batches_take_the_1f1b_makespan(S, M):
    f, b = 1.0, 2.0
    r = list_schedule(_costs(np.full((S, M), f), b), Placement("linear", S), np.zeros((S, M)), np.zeros(S))
    assert r.makespan_s == pytest.approx((M + S - 1) * (f + b))
    assert r.busy_s == pytest.approx(np.full(S, M * (f + b)))


def test_cyclic_runs_every_op_once_one_at_a_time_per_device_after_its_inputs():
    S, M = 2, 5
    rng = np.random.default_rng(0)
    fwd = rng.uniform(0.5, 2.0, (2 * S, M))
    send = np.full((2 * S, M), 0.25)
    p = Placement.parse("cyclic", S)
    r = list_schedule(_costs(fwd, 2 * fwd), p, send, np.zeros(2 * S))
    ends = {}
    for d, ops in enumerate(r.order):
        times = sorted((start, end) for _, _, _, start, end in ops)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(times, times[1:]))  # one op at a time on a device
        for phase, v, m, start, end in ops:
            assert p.device(v) == d
            ends[phase, v, m] = (start, end)
    assert len(ends) == 2 * (2 * S) * M  # every forward and backward of every chunk, once
    for (phase, v, m), (start, _) in ends.items():
        if phase == "F" and v > 0:
            prev_end = ends["F", v - 1, m][1]
            assert start >= prev_end + (send[v - 1, m] if p.device(v - 1) != p.device(v) else 0) - 1e-12
        if phase == "B":
            after = ends["F", v, m][1] if v == 2 * S - 1 else ends["B", v + 1, m][1] + send[v, m]
            assert start >= after - 1e-12


def test_memory_admission_keeps_the_peak_within_the_limit():
    S, M = 2, 6
    stored = np.ones((2 * S, M))  # each micro-batch keeps 2 bytes on each device (two chunks)
    p = Placement.parse("cyclic", S)
    free = list_schedule(_costs(np.ones((2 * S, M)), 1.0, stored), p, np.zeros((2 * S, M)), np.zeros(2 * S))
    tight = list_schedule(_costs(np.ones((2 * S, M)), 1.0, stored), p, np.zeros((2 * S, M)), np.zeros(2 * S),
                          memory_limit_bytes=4.0)
    assert free.peak_memory_bytes.max() > 4.0  # unlimited, several micro-batches are in flight
    assert tight.fits_memory and tight.peak_memory_bytes.max() <= 4.0 and tight.makespan_s > free.makespan_s


def test_cyclic_t5_layout_puts_an_encoder_and_a_decoder_chunk_on_every_device():
    model = AnalyticCostModel.from_names("t5-large", "a100-40gb")
    layout = cyclic_layout(model, 4)
    assert layout.num_stages == 8
    assert all("t5_decoder" not in s for s in layout.stages[:4]) and all("t5_encoder" not in s for s in layout.stages[4:])
    assert layout.stages[0][0] == "embedding" and layout.stages[4][0] == "decoder_embedding"
    assert layout.stages[-1][-1] == "lm_head"
    with pytest.raises(ValueError, match="no decoder"):
        cyclic_layout(AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb"), 4)


def test_simulate_reports_a_placement(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lengths = tmp_path / "lengths.npz"
    np.savez(lengths, input_len=rng.integers(8, 256, 200), target_len=rng.integers(2, 64, 200))
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--model", "t5", "--lengths", str(lengths), "--num-batches", "1", "--global-batch-tokens", "4096", "--max-input-len", "256",
                         "--max-target-len", "64", "--methods", "dynamic", "--placement", "cyclic", "--json"])
    assert simulate.run(args) == 0
    import json

    row = json.loads(capsys.readouterr().out)["methods"]["dynamic"]
    assert list(row["policies"]) in (["cyclic list"], ["cyclic interleaved_1f1b"], ["cyclic wait_free_cyclic"])  # placement, order
    assert row["layout"].count("|") == 7  # 8 chunks on 4 devices
    assert len(row["stage_busy"]) == 4 and 0 < row["efficiency_balanced"] <= row["efficiency_amortised"]
    # the balanced efficiency splits exactly into the plan's work over the ideal's and the devices' busy share
    assert 0 < row["busy_fraction"] <= 1 and row["work_efficiency"] > 0
    assert row["work_efficiency"] * row["busy_fraction"] == pytest.approx(row["efficiency_balanced"])
