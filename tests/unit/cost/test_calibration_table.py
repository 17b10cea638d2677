"""``dynabatch profile --check``'s table (:func:`dynabatch.cost.calibrate.format_summary`): every row's numbers sit
under their headers, also for long group names such as ``segments:gpt2_block_attention``, which pushed their row's
columns off the header's by the overflow."""

from __future__ import annotations

from dynabatch.cost.calibrate import format_summary


def test_long_group_names_keep_the_columns_aligned():
    row = {"n": 3, "time_median": 0.12, "time_p90": 0.21, "stored_median": 0.0, "stored_p90": 0.0,
           "peak_median": 0.0, "peak_p90": 0.0}
    lines = format_summary({"model": row, "segments:gpt2_block_attention": row, "gpt2_head": row}).splitlines()
    head, rows = lines[0], [ln for ln in lines[2:]]
    assert len(rows) == 3
    for line in rows:
        assert len(line) == len(head)
        assert line.index(" 3 ") + 2 == head.index("n") + 1  # the count sits under "n"
