"""The run summary's planning overlap (issue 17, item 5): how much of the background planner's time the
steps did not wait for."""

from __future__ import annotations

import pytest

from dynabatch.training.metrics import format_summary, planning_overlap, summarize


def _record(step: int, plan_s: float, wait_s: float) -> dict:
    return {"step": step, "loss": 1.0, "real_tokens": 100, "computed_tokens": 120, "step_time_s": 1.0,
            "bubble_fraction_predicted": 0.1, "predicted_step_s": 1.0, "plan_time_s": plan_s, "plan_wait_s": wait_s,
            "num_micro_batches": 4, "peak_rss_bytes": 1}


def test_planning_overlap_is_the_share_of_planning_not_waited_for():
    assert planning_overlap([_record(0, 0.4, 0.1), _record(1, 0.6, 0.15)]) == pytest.approx(0.75)
    assert planning_overlap([_record(0, 0.5, 0.0)]) == 1.0
    assert planning_overlap([_record(0, 0.5, 0.9)]) == 0.0  # waits longer than the planning: nothing hidden
    assert planning_overlap([_record(0, 0.0, 0.0)]) == 1.0
    s = summarize([_record(0, 9.0, 9.0), _record(1, 0.4, 0.1), _record(2, 0.6, 0.15)], "dynamic")
    assert s["plan_overlap"] == pytest.approx(0.75)  # step 0 (warm-up) is left out, as for throughput
    assert "75% of planning overlapped with training" in format_summary(s)


def test_summary_has_the_steady_medians_of_the_measured_efficiencies():
    records = [{**_record(k, 0.1, 0.0), "efficiency_balanced": e, "efficiency_amortised": 2 * e,
                "device_busy_fraction": [b, b / 2]}
               for k, (e, b) in enumerate([(0.9, 0.9), (0.2, 0.4), (0.4, 0.8), (0.3, 0.6)])]
    s = summarize(records, "dynamic")  # step 0 (warm-up) is left out
    assert s["efficiency_balanced_median"] == pytest.approx(0.3)
    assert s["efficiency_amortised_median"] == pytest.approx(0.6)
    assert s["device_busy_fraction_median"] == pytest.approx([0.6, 0.3])
    assert "efficiency balanced 0.300 (amortised 0.600), device busy 0.60/0.30" in format_summary(s)
    plain = summarize([_record(0, 0.1, 0.0)], "dynamic")  # records without them (older runs): no such part
    assert plain["efficiency_balanced_median"] is None and "efficiency balanced" not in format_summary(plain)


def test_summary_counts_the_candidate_plans_that_ran():
    """The dynamic method's steps say which candidate plan ran (the DP's, or a baseline's at a knob value); the
    summary counts them, most frequent first, and says so in its line; a baseline method's records have none."""
    labels = ["dp", "packing_free=4", "dp", "token_budget=2048", "packing_free=4", "packing_free=4"]
    s = summarize([{**_record(k, 0.1, 0.0), "candidate": c} for k, c in enumerate(labels)], "dynamic")
    assert s["candidates"] == {"packing_free=4": 3, "dp": 2, "token_budget=2048": 1}
    assert list(s["candidates"]) == ["packing_free=4", "dp", "token_budget=2048"]
    assert "plans run: packing_free=4 3, dp 2, token_budget=2048 1 (steps)" in format_summary(s)
    baseline = summarize([{**_record(k, 0.1, 0.0), "candidate": ""} for k in range(3)], "packing_free")
    assert "candidates" not in baseline and "plans run" not in format_summary(baseline)


def test_prediction_report_names_the_start_up_round_not_step_minus_one():
    """``profile --check RUN_DIR`` of a run of a few steps ended with "(online as of step -1 at the last)": step -1 is
    the start-up calibration round the first steps are planned with; the report now says so."""
    from dynabatch.training.metrics import format_prediction_report

    records = [{"step": k, "step_time_s": 1.0, "predicted_step_s": 0.9, "prediction_error": 0.1,
                "prediction_error_median": 0.1, "stage_time_measured_s": [0.5], "stage_time_predicted_s": [0.45],
                "calibration": "online as of step -1"} for k in range(2)]
    assert format_prediction_report(records).splitlines()[-1].startswith(
        "2 steps (online as of the start-up round at the last)")


def test_summary_counts_one_step_in_the_singular():
    one = summarize([_record(0, 0.1, 0.0)], "dynamic")
    assert one["steps"] == 1 and format_summary(one).startswith("dynamic: 1 step, loss ")
    two = summarize([_record(0, 0.1, 0.0), _record(1, 0.1, 0.0)], "dynamic")
    assert format_summary(two).startswith("dynamic: 2 steps, loss ")
