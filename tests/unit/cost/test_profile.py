"""The profiler on tiny real models: a 2x2 grid writes a valid profile that loads into tables; the
saved-tensor accounting matches hand-computed bytes; the CLI profiles and checks."""

from __future__ import annotations

import json

import pytest
import torch

from dynabatch.cost.layers import Step
from dynabatch.cost.measure import MeasureSettings, measure_memory, measure_step, saved_bytes
from dynabatch.cost.profile import ProfileGrid, count_points, run_profile, save_profile
from dynabatch.cost.tables import CostTables
from dynabatch.models.families import layer_builder

TINY_GRID = ProfileGrid(batch_sizes=(1, 2), enc_lengths=(8, 16), dec_lengths=(4, 8), max_tokens=64)
ONE_REPEAT = MeasureSettings(min_repeats=1, max_repeats=1, min_time_s=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("model", ["gpt2-tiny", "t5-tiny", "llama-tiny"])
def test_tiny_profile_round_trips_into_tables(model, tmp_path):
    profile = run_profile(model, TINY_GRID, ONE_REPEAT, num_threads=1, p2p_backend=None, show_progress=False,
                          layer_builder=layer_builder(model))
    path = save_profile(profile, tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["format"] == "dynabatch.profile" and data["version"] == 1
    assert data["num_threads"] == 1 and data["settings"]["clock"] == "thread_cpu"
    assert data["model"]["family"] == model.split("-")[0] and data["versions"]["torch"] == torch.__version__
    assert data["axes"]["b"] == [1, 2] and data["axes"]["E"] == [8, 16]
    for rec in data["layers"].values():
        flat = json.dumps(rec["status"])
        assert "skipped" not in flat and "oom" not in flat
    t = CostTables.from_profile(data)
    stage = t.stage_spec(0, sum(t.num_layers))
    at_grid = t.stage_cost(stage, 2, 16, 8)
    off_grid = t.stage_cost(stage, 1.5, 11, 6)
    assert at_grid.feasible and off_grid.feasible
    assert 0 < at_grid.fwd_s and 0 < at_grid.stored_bytes <= at_grid.peak_bytes
    block = {"gpt2": "gpt2_block", "t5": "t5_encoder_block", "llama": "llama_block"}[model.split("-")[0]]
    assert t.layer_cost(block, 2, 16).stored_bytes > t.layer_cost(block, 1, 8).stored_bytes
    assert t.stage_params(stage) == sum(p.numel() for p in _model_params(model))
    from dynabatch.cost.planner_model import ProfiledLayerModel

    planner_view = ProfiledLayerModel(t)  # the profile's own kind mapping and width, no family name
    kinds = planner_view.layer_kinds()
    assert planner_view.spec(kinds[:2]).counts() and data["model"]["d_model"] == 64
    assert planner_view.send_bytes(kinds[1], 2, 16) == 4 * 2 * 16 * 64  # fp32 hidden states of E tokens


def _model_params(model):
    from dynabatch.models.presets import build_model

    return list(build_model(model).parameters())


def test_linear_saves_its_input_bytes():
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(5, 7, 32, requires_grad=True)
    params = frozenset(p.untyped_storage().data_ptr() for p in lin.parameters())
    n, _ = saved_bytes(lambda: lin(x), params)
    assert n == 5 * 7 * 32 * 4  # the input; the weight is a parameter and is skipped
    step = Step(run=lambda: ((lin(x),), ()), leaves=(x,))
    stored, peak, _ = measure_memory(step, params, torch.device("cpu"))
    assert stored == 5 * 7 * 32 * 4
    assert peak >= stored + 5 * 7 * 16 * 4  # the output is live too


def test_saved_views_of_one_storage_count_once_and_shared_inputs_are_skipped():
    x = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)

    def run():
        y = x * 2.0
        return ((y[:32] * w[:32]).sum() + (y[32:] * w[32:]).sum(),), ()

    n, _ = saved_bytes(lambda: run())
    assert n == 64 * 4 + 64 * 4  # y (two views, one storage) and w (two views, one storage)
    stored, _, _ = measure_memory(Step(run=run, leaves=(x,), shared=(w,)), frozenset(), torch.device("cpu"))
    assert stored == 64 * 4


def test_measure_step_times_are_positive_and_bwd_zero_without_grad():
    torch.set_num_threads(1)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    m = measure_step(Step(run=lambda: ((lin(x),), ()), leaves=(x,)), frozenset(), torch.device("cpu"), ONE_REPEAT)
    assert m.fwd_s > 0 and m.bwd_s > 0
    m = measure_step(Step(run=lambda: ((), (torch.ones(3),))), frozenset(), torch.device("cpu"), ONE_REPEAT)
    assert m.bwd_s == 0 or m.bwd_s < 1e-4
    assert m.stored_bytes == 0


def test_grid_cap_keeps_cells_complete():
    g = ProfileGrid(batch_sizes=(1, 2, 4), enc_lengths=(16, 32, 64), dec_lengths=(16, 32), max_tokens=64)
    # (4, 64) is profiled: its lower neighbour (2, 32) has 64 tokens; so is (2, 64) via (1, 32)
    assert g.included(("b", "E"), (2, 2)) and g.included(("b", "E"), (1, 2))
    g2 = ProfileGrid(batch_sizes=(1, 2, 4), enc_lengths=(16, 32, 64), dec_lengths=(16, 32), max_tokens=32)
    assert not g2.included(("b", "E"), (2, 2)) and g2.included(("b", "E"), (1, 1))
    with pytest.raises(ValueError):
        ProfileGrid(batch_sizes=(2, 1))
    from dynabatch.models.families.gpt2 import GPT2_KINDS

    assert count_points(GPT2_KINDS, g) == 4 * 9


def test_cli_profile_and_check(tmp_path, capsys):
    from dynabatch.cli import main

    out = tmp_path / "g.json"
    rc = main(["profile", "--model", "gpt2-tiny", "--out", str(out), "--batch-sizes", "1,2", "--lengths", "8,16",
               "--max-tokens", "64", "--min-repeats", "1", "--max-repeats", "1", "--min-time", "0", "--p2p", "none",
               "--no-progress"])
    assert rc == 0 and out.exists()
    assert "wrote" in capsys.readouterr().err  # a log line (stderr)
    rc = main(["profile", "--check", str(out), "--num-shapes", "2", "--model-only", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "model" in text and "time med" in text
    assert main(["profile", "--model", "gpt2-tiny", "--kinds", "nope", "--p2p", "none", "--no-progress"]) == 2


def test_p2p_gloo_two_processes():
    from dynabatch.cost.p2p import measure_p2p

    r = measure_p2p("gloo", sizes=(1024, 65536), warmup=1, repeats=3, timeout_s=60)
    assert r.backend == "gloo" and r.sizes_bytes == (1024, 65536)
    assert all(0 < t < 1 for t in r.send_s) and all(m <= t for m, t in zip(r.send_min_s, r.send_s))
    with pytest.raises(ValueError):
        measure_p2p("mpi")


def test_a_bad_grid_is_the_clis_one_error_line(tmp_path, capsys):
    from dynabatch.cli import main

    assert main(["profile", "--model", "gpt2-tiny", "--out", str(tmp_path / "p.json"), "--batch-sizes", "2,1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dynabatch profile: error: --batch-sizes needs at least two strictly increasing values >= 1 "
                   "(e.g. 16,32,64), got 2,1"]
    assert main(["profile", "--model", "gpt2-tiny", "--seq-lengths", "8,x"]) == 2
    assert "--seq-lengths expects comma-separated integers, got '8,x'" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
