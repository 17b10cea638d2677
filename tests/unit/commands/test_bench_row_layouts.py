"""scripts/bench_row_layouts.py: the three layouts hold the same samples in as many micro-batches, and only the
padded one computes pad."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np

from dynabatch.data.batching import LengthLimits

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "bench_row_layouts.py")
HEAVY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "heavy_tail_1024.npz")


def _script():
    spec = importlib.util.spec_from_file_location("bench_row_layouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layouts_cut_the_same_samples_into_as_many_micro_batches():
    script = _script()
    limits = LengthLimits("t5", max_input_len=1024, max_target_len=256)
    batch = script.global_batch(HEAVY, 8192, limits, 100, seed=3)
    cands = script.layouts(batch, limits)
    counts = {name: len(mbs) for name, mbs in cands.items()}
    assert len(set(counts.values())) == 1 and counts["flat"] > 1, counts
    for name, mbs in cands.items():
        assert sorted(i for mb in mbs for row in mb for i in row) == list(range(len(batch))), name
    e, d = np.asarray(batch.input_lens), np.asarray(batch.target_lens)
    for rows in cands["packing_free"]:  # best-fit rows within the limits
        assert e[rows[0]].sum() <= 1024 and d[rows[0]].sum() <= 256
    assert all(len(mb) == 1 for mb in cands["flat"]) and all(len(row) == 1 for mb in cands["padded"] for row in mb)
    assert [mb[0] for mb in cands["flat"]] == [[row[0] for row in mb] for mb in cands["padded"]]


def test_small_run_reports_every_layout_per_stage(tmp_path, capsys, monkeypatch):
    """The script's ``main`` with these arguments, in this process (no fresh interpreter's imports)."""
    path = tmp_path / "layouts.json"
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--model", "t5-tiny", "--tokens", "1024", "--seeds", "0", "--repeats", "1",
                                      "--json", str(path)])
    _script().main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(path.read_text()) == result
    (row,) = result["results"]
    assert set(row["stage_s"]) == {"packing_free", "flat", "padded"}
    assert all(len(v) == 2 and min(v) > 0 for v in row["stage_s"].values())
