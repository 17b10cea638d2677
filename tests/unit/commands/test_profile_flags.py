"""``dynabatch profile``: every bad flag is one line naming the flag, before anything is profiled (a bad ``--p2p``
used to surface after the whole grid had been measured)."""

from __future__ import annotations

import pytest

from dynabatch.cli import main


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.mark.parametrize("flags, expected", [
    (["--p2p", "foo"], "choose from 'auto', 'gloo', 'nccl', 'none'"),
    (["--seq-lengths", "-5"], "--seq-lengths needs at least two strictly increasing values >= 1"),
    (["--seq-lengths", "16"], "--seq-lengths needs at least two"),
    (["--dec-lengths", "x"], "--dec-lengths expects comma-separated integers"),
    # plan / simulate / bench --lengths is a lengths file; profile's is the grid's older flag name
    (["--lengths", "data/heavy_tail_1024.npz"], "profile times layers on a grid and reads no lengths file"),
    (["--max-tokens", "1"], "--max-tokens 1 is below the smallest grid point"),
    (["--min-repeats", "0"], "--min-repeats must be >= 1"),
    (["--max-repeats", "1"], "--max-repeats 1 is below --min-repeats 3"),
    (["--min-time", "-1"], "--min-time must be a number of seconds >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--kinds", "foo", "--p2p", "none"], "unknown layer kinds ['foo']"),
])
def test_a_bad_flag_is_one_line_and_nothing_is_profiled(tmp_path, capsys, flags, expected):
    out = tmp_path / "pp.json"
    code = main(["profile", "--model", "gpt2-tiny", "--out", str(out), "--no-progress", *flags])
    assert expected in _one_line(capsys, code)
    assert not out.exists()


def test_nccl_without_two_cuda_devices_is_refused_before_profiling(tmp_path, capsys):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two CUDA devices: nccl can be measured here")
    out = tmp_path / "pp.json"
    code = main(["profile", "--model", "gpt2-tiny", "--device", "cpu", "--out", str(out), "--p2p", "nccl"])
    assert "p2p backend nccl needs two CUDA devices" in _one_line(capsys, code)
    assert not out.exists()


def test_default_out_of_a_model_folder_is_its_name(tmp_path, monkeypatch):
    """Without ``--out`` a local model folder's profile was named after the whole path given: ``./models/my-gpt/``
    wrote the hidden ``runs/profiles/._models_my-gpt_.cpu.json`` and the absolute path another file for the same
    folder. Now both are ``runs/profiles/my-gpt.cpu.json``; a preset keeps its name."""
    from dynabatch.commands.profile import default_out

    (tmp_path / "models" / "my-gpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for given in ("./models/my-gpt/", "models/my-gpt", str(tmp_path / "models" / "my-gpt")):
        assert default_out(given, "cpu") == "runs/profiles/my-gpt.cpu.json"
    assert default_out("gpt2-tiny", "cuda:1") == "runs/profiles/gpt2-tiny.cuda1.json"
