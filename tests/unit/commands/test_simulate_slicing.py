"""`dynabatch simulate --slice-long`: token slices (TeraPipe) in the simulated steps, priced with their context and
scheduled as chains (on the linear placement and on virtual stages), as `train --slice-long` runs them."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from dynabatch.commands import simulate


def _run(tmp_path, capsys, *extra: str) -> dict:
    rng = np.random.default_rng(0)
    lengths = tmp_path / "lengths.npz"
    inputs = np.concatenate([rng.integers(16, 200, 300), [3900, 3800, 3700]])  # a heavy tail: three long samples
    np.savez(lengths, input_len=inputs, target_len=rng.integers(2, 64, inputs.size))
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--model", "gpt", "--lengths", str(lengths), "--num-batches", "2", "--max-input-len", "4096",
                         "--methods", "dynamic", "--json", *extra])
    assert simulate.run(args) == 0
    return json.loads(capsys.readouterr().out)["methods"]["dynamic"]


def test_long_samples_run_as_chains_of_slices(tmp_path, capsys):
    whole = _run(tmp_path, capsys)
    sliced = _run(tmp_path, capsys, "--slice-long")
    assert whole["sliced_samples"] == 0 and sliced["sliced_samples"] > 0
    assert sliced["real_tokens"] == whole["real_tokens"] and sliced["fits_memory"]
    assert sliced["micro_batches"] > whole["micro_batches"]  # a sliced sample is several pieces
    # the long samples' single-piece micro-batches no longer dominate fill and drain
    assert sliced["bubble_fraction"] < whole["bubble_fraction"]
    assert sliced["step_s"] <= whole["step_s"] * (1 + 1e-9)  # the DP's whole-sample plan is a candidate too


def test_slices_run_on_virtual_stages_too(tmp_path, capsys):
    sliced = _run(tmp_path, capsys, "--slice-long", "--placement", "interleaved:2")
    assert sliced["sliced_samples"] > 0 and sliced["fits_memory"]
    assert all(policy.startswith("interleaved:2 ") for policy in sliced["policies"])


def test_slice_long_is_refused_for_encoder_decoder_models():
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--model", "t5", "--num-batches", "1", "--slice-long"])
    with pytest.raises(ValueError, match="--slice-long cuts decoder-only samples into token slices"):
        simulate.run(args)


def test_a_sample_that_fits_only_recomputed_says_recompute_full(capsys):
    """GPT-1.3B on 4 stages at 16 GiB: under ``--recompute auto`` (the default) slices are priced storing every
    activation (the safe side), and a 7,038-token sample of the long tail fits no slicing; under ``full`` they are
    priced and run recomputed and it fits. The refusal named stages, budget and lengths only."""
    from dynabatch.cli import main

    flags = ["simulate", "--model", "gpt", "--lengths", "data/long_tail_32k.npz", "--max-input-len", "16384",
             "--methods", "dynamic_sliced", "--num-batches", "1", "--memory-gib", "16"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "even when sliced" in err and "--recompute full" in err, err
    assert main([*flags, "--recompute", "full"]) == 0
    assert main([*flags, "--recompute", "full", "--memory-gib", "9"]) == 2  # recomputed too: no advice to recompute
    assert "even when sliced" in (err := capsys.readouterr().err) and "--recompute full" not in err, err


def test_moving_boundaries_in_simulate_keep_the_linear_placement(tmp_path, capsys):
    moving = _run(tmp_path, capsys, "--moving-boundaries", "--slice-long")
    assert moving["placement"] == "linear" and moving["fits_memory"] and moving["sliced_samples"] > 0
    with pytest.raises(ValueError, match="--moving-boundaries moves the cuts of a linear layout; --placement cyclic"):
        _run(tmp_path, capsys, "--moving-boundaries", "--placement", "cyclic")
