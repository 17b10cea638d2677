"""`dynabatch plan` / `simulate --cost-profile`: a profile written by `dynabatch profile` prices the run (read as
train reads it), what train refuses with a profile is one line here too, and a model folder is checked at its
length limit as train checks it (Mistral's sliding window)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import MistralConfig

from dynabatch.cli import main


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """A gpt2-tiny profile from the real command (lengths up to 64), and a copy with every time doubled."""
    d = tmp_path_factory.mktemp("profiles")
    path = d / "gpt2.json"
    code = main(["profile", "--model", "gpt2-tiny", "--out", str(path), "--batch-sizes", "1,2,4,8", "--lengths",
                 "16,32,64", "--max-tokens", "512", "--min-repeats", "1", "--max-repeats", "1", "--min-time", "0",
                 "--p2p", "none", "--no-progress"])
    assert code == 0 and path.exists()
    doubled = json.loads(path.read_text())
    for layer in doubled["layers"].values():
        for key in ("fwd_s", "bwd_s", "time_s"):
            if key in layer:
                layer[key] = (2 * np.asarray(layer[key], dtype=np.float64)).tolist()
    slow = d / "gpt2-slow.json"
    slow.write_text(json.dumps(doubled))
    lengths = d / "lens.npz"
    rng = np.random.default_rng(0)
    np.savez(lengths, input_len=rng.integers(3, 40, 200), target_len=rng.integers(2, 24, 200))
    return str(path), str(slow), str(lengths)


def _flags(lengths: str) -> list[str]:
    return ["--model", "gpt2-tiny", "--lengths", lengths, "--max-input-len", "64", "--global-batch-tokens", "512",
            "--num-batches", "1", "--stages", "2", "--memory-gib", "4", "--methods", "dynamic,padding"]


def _json(capsys, *argv: str) -> dict:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return json.loads(out)


def _one_line(capsys, command: str, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dynabatch {command}: error: "), err[-2000:]
    return lines[0]


@pytest.mark.parametrize("command, step", [("plan", "predicted_step_s"), ("simulate", "step_s")])
def test_plan_and_simulate_price_with_the_profiles_measured_costs(profiles, command, step, capsys):
    path, slow, lengths = profiles
    flags = [command, *_flags(lengths)]
    measured = _json(capsys, *flags, "--cost-profile", path)
    doubled = _json(capsys, *flags, "--cost-profile", slow)
    analytic = _json(capsys, *flags, "--hardware", "cpu")
    assert measured["config"]["cost_profile"] == path and measured["cost_model"] == f"cost profile {path}"
    assert analytic["cost_model"] == "analytic, cpu"
    assert measured["resolved"]["split_blocks"][0] == "off" and measured["resolved"]["recompute"][0] == "none"
    # padding's micro-batches do not depend on the costs: every time of the profile doubled doubles its step
    # (no link costs with a profile, as train plans with it), and the analytic model prices it otherwise
    got, twice = measured["methods"]["padding"][step], doubled["methods"]["padding"][step]
    np.testing.assert_allclose(twice, 2 * got, rtol=1e-9)
    assert not np.isclose(got, analytic["methods"]["padding"][step], rtol=1e-3)
    assert 0 < measured["methods"]["dynamic"][step] < 1e3
    if command == "simulate":  # ~8k-token copies lie beyond the profile's batch sizes: no amortised efficiency
        assert measured["methods"]["padding"]["efficiency_amortised"] is None
        assert measured["methods"]["padding"]["efficiency"] > 0
    main([*flags, "--cost-profile", path])
    out = capsys.readouterr().out
    assert f"priced with cost profile {path}" in out


@pytest.mark.parametrize("command, step, peak", [("plan", "predicted_step_s", "peak_memory_gib"),
                                                 ("simulate", "step_s", "peak_memory_gib")])
def test_a_method_beyond_the_profiles_grid_reads_n_a_and_is_never_the_best(profiles, command, step, peak, capsys):
    # token_budget's default budget puts the whole global batch (~20 samples) in one micro-batch, beyond the
    # profile's batch sizes (up to 8): priced n/a, not ~1e30 s, not fitting, not compared, and one line says so
    path, _, lengths = profiles
    flags = [command, *_flags(lengths)[:-1], "dynamic,padding,token_budget", "--cost-profile", path]
    rows = _json(capsys, *flags)
    off = rows["methods"]["token_budget"]
    assert off["priced_off_grid"] is True and off[step] is None and off[peak] is None and off["fits_memory"] is False
    assert all(rows["methods"][m]["priced_off_grid"] is False and 0 < rows["methods"][m][step] < 1e3
               for m in ("dynamic", "padding"))
    assert rows["best_baseline"] == "padding" and rows["baselines_compared"] == "fitting"
    assert main(flags) == 0
    table = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split()}
    assert table["token_budget"].count("n/a") >= 3 and "NO" not in table["token_budget"]
    assert "n/a" not in table["padding"]
    line = [ln for ln in table.values() if ln[0] == "n/a:"]
    assert len(line) == 1 and " ".join(line[0]) == (
        "n/a: token_budget ran micro-batches beyond the cost profile's grid, which it cannot price; profile with "
        "larger --batch-sizes / longer --lengths (dynabatch profile), or leave it out of --methods")


@pytest.mark.parametrize("command, extra, expected", [
    ("plan", ["--methods", "dynamic_sliced"], "dynamic_sliced prices its token slices with the analytic cost model"),
    ("simulate", ["--slice-long"], "slice_long prices slices with the analytic cost model"),
    ("plan", ["--split-blocks", "on"], "split_blocks on cuts inside blocks, which a profile does not price"),
    ("simulate", ["--recompute", "full"], "recompute full needs a cost model that prices recomputation"),
    ("plan", ["--model", "gpt"], "--model gpt is an analytic preset"),
    ("simulate", ["--model", "llama-tiny"], "was measured on a gpt2 model (gpt2-tiny), and this run's model "
                                            "(llama-tiny) is a llama"),
    ("plan", ["--max-input-len", "128"], "covers lengths up to 64 (batch sizes up to 8), but this run's samples "
                                         "reach --max-input-len 128"),
    ("simulate", ["--flash-attention"], "drop --flash-attention or --cost-profile"),
])
def test_what_a_profile_cannot_price_is_one_line(profiles, command, extra, expected, capsys):
    path, _, lengths = profiles
    line = _one_line(capsys, command, main([command, *_flags(lengths), "--cost-profile", path, *extra]))
    assert expected in line


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_mistral_folder_above_its_sliding_window_is_refused_as_train_refuses_it(tmp_path, command, capsys):
    folder = tmp_path / "mistral"
    MistralConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=512, sliding_window=64).save_pretrained(folder)
    lengths = tmp_path / "lens.npz"
    np.savez(lengths, input_len=np.arange(3, 43), target_len=np.full(40, 8))
    flags = [command, "--model", str(folder), "--lengths", str(lengths), "--num-batches", "1", "--hardware", "cpu",
             "--global-batch-tokens", "256", "--methods", "padding", "--stages", "2"]
    line = _one_line(capsys, command, main([*flags, "--max-input-len", "128"]))
    assert "the length limit is 128 tokens but this mistral model uses sliding-window attention over 64" in line
    code = main([*flags, "--max-input-len", "64"])
    assert code == 0, capsys.readouterr().err[-2000:]
