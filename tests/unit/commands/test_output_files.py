"""Result files of the commands (``--json``, ``profile --out``, ``--trace-dir``): a path that cannot or must not be
written is one line before any work, a file no dynabatch command wrote is never replaced, and a command's own
output is replaced whole on a rerun (:mod:`dynabatch.commands.output_files`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.cli import main
from dynabatch.commands.output_files import WRITTEN_BY

PLAN = ["plan", "--model", "t5", "--num-batches", "1", "--methods", "dynamic,padding"]


def _lengths(tmp_path) -> str:
    path = tmp_path / "lens.npz"
    rng = np.random.default_rng(0)
    np.savez(path, input_len=rng.integers(5, 300, 400), target_len=rng.integers(2, 60, 400))
    return str(path)


def _one_line(capsys, command: str, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if f"dynabatch {command}: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_json_never_replaces_a_file_no_command_wrote(tmp_path, capsys):
    mine = tmp_path / "p.json"
    mine.write_text("keep")
    msg = _one_line(capsys, "plan", main([*PLAN, "--lengths", _lengths(tmp_path), "--json", str(mine)]))
    assert "exists and no dynabatch command wrote it" in msg and mine.read_text() == "keep"
    lens = tmp_path / "lens.jsonl"  # data-report's own input, named as its output by mistake
    lens.write_text("".join(json.dumps({"input_len": 10 + i, "target_len": 3}) + "\n" for i in range(20)))
    before = lens.read_text()
    code = main(["data-report", "--lengths", str(lens), "--json", str(lens)])
    assert "exists and no dynabatch command wrote it" in _one_line(capsys, "data-report", code)
    assert lens.read_text() == before


def test_json_into_new_folders_is_marked_and_replaced_on_a_rerun(tmp_path, capsys):
    out = tmp_path / "results" / "sub" / "plan.json"
    args = [*PLAN, "--lengths", _lengths(tmp_path), "--json", str(out)]
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    first = json.loads(out.read_text())
    assert first[WRITTEN_BY] == "dynabatch plan" and len(first) > 2
    out.write_text(json.dumps({**first, "note": "stale"}))
    assert main(args) == 0, capsys.readouterr().err[-2000:]  # its own earlier output: replaced
    assert "note" not in json.loads(out.read_text())


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_json_to_a_folder_or_under_a_file_is_one_line_before_the_work(tmp_path, capsys, command):
    args = [command, "--model", "t5", "--num-batches", "1", "--lengths", _lengths(tmp_path)]
    assert "is a folder" in _one_line(capsys, command, main([*args, "--json", str(tmp_path)]))
    (tmp_path / "afile").write_text("x")
    msg = _one_line(capsys, command, main([*args, "--json", str(tmp_path / "afile" / "r.json")]))
    assert "is a file, not a folder" in msg


def test_trace_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "traces"
    path.write_text("x")
    code = main(["simulate", "--model", "t5", "--num-batches", "1", "--lengths", _lengths(tmp_path),
                 "--trace-dir", str(path)])
    assert "--trace-dir" in _one_line(capsys, "simulate", code) and path.read_text() == "x"


def test_profile_check_of_a_missing_or_malformed_file_is_one_line(tmp_path, capsys):
    msg = _one_line(capsys, "profile", main(["profile", "--check", str(tmp_path / "nope.json")]))
    assert "cost profile" in msg and "not found" in msg and "dynabatch profile" in msg
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}\n{"b": 2}\n')
    msg = _one_line(capsys, "profile", main(["profile", "--check", str(bad)]))
    assert "cannot be read as a profile" in msg
    assert "--num-shapes must be >= 1" in _one_line(capsys, "profile", main(["profile", "--check", str(bad),
                                                                            "--num-shapes", "0"]))


def test_trace_dir_never_replaces_files_no_command_wrote_and_replaces_its_own(tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    args = ["simulate", "--model", "gpt", "--num-batches", "1", "--methods", "dynamic", "--lengths", _lengths(tmp_path),
            "--trace-dir", str(traces)]
    mine = {"dynamic_step0.json": '{"my": "precious"}\n', "dynamic_step0.png": "notpng\n"}
    for name, text in mine.items():
        (traces / name).write_text(text)
        msg = _one_line(capsys, "simulate", main(args))
        assert f"--trace-dir '{traces / name}' exists and no dynabatch command wrote it" in msg
        assert (traces / name).read_text() == text
        (traces / name).unlink()
    assert main(args) == 0, capsys.readouterr().err[-2000:]
    trace = json.loads((traces / "dynamic_step0.json").read_text())
    assert trace[WRITTEN_BY] == "dynabatch simulate" and trace["traceEvents"]
    png = (traces / "dynamic_step0.png").read_bytes()
    assert png.startswith(b"\x89PNG") and b"tEXtSoftware\x00dynabatch simulate" in png
    (traces / "dynamic_step0.json").write_text(json.dumps({**trace, "note": "stale"}))
    assert main(args) == 0, capsys.readouterr().err[-2000:]  # its own earlier output: replaced
    assert "note" not in json.loads((traces / "dynamic_step0.json").read_text())


def test_trace_dir_without_a_traced_method_is_one_line(tmp_path, capsys):
    """``--trace-dir`` traces dynamic and packing; with --methods naming neither it wrote nothing and said nothing."""
    traces = tmp_path / "traces"
    code = main(["simulate", "--model", "gpt", "--num-batches", "1", "--methods", "packing_free,padding",
                 "--lengths", _lengths(tmp_path), "--trace-dir", str(traces)])
    msg = _one_line(capsys, "simulate", code)
    assert ("--trace-dir writes the first step of dynamic and packing, and --methods packing_free,padding runs neither; "
            "add dynamic or packing to --methods, or drop --trace-dir") in msg
    assert not traces.exists()


def test_trace_dir_draws_only_the_linear_placement_the_table_reports(tmp_path, capsys):
    """A trace draws a step on the linear placement: ``--placement cyclic`` wrote nothing and said nothing, and under
    ``--placement auto`` the linear candidate's trace was written also when another placement was picked and
    reported. Now a virtual placement is one line before any work, and ``auto`` writes the trace only of the linear
    placement it picked (else says on stderr that none was written)."""
    traces = tmp_path / "traces"
    flags = ["simulate", "--model", "t5-d256", "--hardware", "cpu", "--stages", "2", "--num-batches", "1",
             "--methods", "dynamic", "--lengths", _lengths(tmp_path), "--global-batch-tokens", "8192",
             "--search-steps", "2", "--trace-dir", str(traces)]
    msg = _one_line(capsys, "simulate", main([*flags, "--placement", "cyclic"]))
    assert "--trace-dir draws steps on the linear placement" in msg and "--placement cyclic runs none" in msg
    assert not traces.exists()
    assert main([*flags, "--placement", "auto", "--json"]) == 0
    out = capsys.readouterr()
    picked = json.loads(out.out)["methods"]["dynamic"]["placement"]
    assert (traces / "dynamic_step0.json").exists() == (picked == "linear")
    assert ("no trace of it written" in out.err) == (picked != "linear")


def test_output_of_another_command_is_never_replaced(tmp_path, capsys):
    """A bench result (minutes to hours of measurement) named by mistake as ``plan --json`` or ``profile --out`` was
    replaced without a word: any ``written_by: dynabatch ...`` file counted as the command's own. Now a file another
    dynabatch command wrote is one line before any work and is left as it is."""
    bench = tmp_path / "bench.json"
    text = json.dumps({WRITTEN_BY: "dynabatch bench", "methods": {"dynamic": {"tokens_per_s": 1.0}}})
    bench.write_text(text)
    msg = _one_line(capsys, "plan", main([*PLAN, "--lengths", _lengths(tmp_path), "--json", str(bench)]))
    assert "holds the output of `dynabatch bench`, not of `dynabatch plan`" in msg and bench.read_text() == text
    code = main(["profile", "--model", "gpt2-tiny", "--out", str(bench), "--batch-sizes", "1,2", "--seq-lengths",
                 "16,32", "--p2p", "none", "--no-progress"])
    assert "holds the output of `dynabatch bench`" in _one_line(capsys, "profile", code) and bench.read_text() == text
