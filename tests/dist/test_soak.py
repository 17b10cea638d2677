"""Runtime robustness of ``dynabatch train`` (subprocesses on the toy mixture): faults and a short soak.

* a planner that dies stops the run with a clear error and a non-zero exit, no hang;
* a metrics file on a full disk warns once and keeps the records in memory;
* soak: a crash mid-run leaves the newest checkpoint truncated; ``--resume`` falls back to the previous
  one with a warning naming the broken one, replays the same batches, no (source, row) is drawn twice
  within an epoch of its source, and peak RSS stays flat after warm-up.

``scripts/soak.py`` runs the same soak longer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections import defaultdict

import pytest

from dynabatch.engine.checkpoint import data_files
from dynabatch.training.metrics import MetricsWriter

STEPS = 24
CHECKPOINT_EVERY = 4
CRASH_AT = 14  # checkpoints at 4, 8, 12 exist; 12 gets truncated to mimic a crash during a save


def train(out: str, mixture: str, *extra: str, env_extra: dict | None = None, timeout: float = 300):
    env = {**os.environ, **(env_extra or {})}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "t5-tiny", "--tokenizer", "byt5",
           "--mixture", mixture, "--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32",
           "--output-dir", out, "--log-every", "0", "--no-timeline", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def records(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_planner_crash_stops_the_run(tmp_path, toy_mixture_dir, monkeypatch):
    # In-process (the CLI lets a RuntimeError through as a traceback, exit code 1); a subprocess pays ~15 s of imports.
    from dynabatch.cli import main

    monkeypatch.setenv("DYNABATCH_PLANNER_CRASH_AT", "2")
    monkeypatch.delenv("RANK", raising=False)
    out = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="the background planner failed: RuntimeError: injected planner crash at step 2"):
        main(["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
              "--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32", "--output-dir", out,
              "--log-every", "0", "--no-timeline", "--steps", "4"])
    assert [r["step"] for r in records(out)] == [0, 1]


def test_metrics_on_a_full_disk_warn_once_and_stay_in_memory():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    writer = MetricsWriter("/dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            writer.write({"step": step})
    assert len(caught) == 1 and "could not write metrics to /dev/full" in str(caught[0].message)
    assert "training continues" in str(caught[0].message)
    assert [r["step"] for r in writer.records] == list(range(5)) and writer.failed


def check_no_repeat_within_epoch(draws: list[tuple[int, int]], source_sizes: list[int]) -> None:
    """Per source, consecutive blocks of ``size`` draws (one epoch each) hold distinct rows."""
    per_source: dict[int, list[int]] = defaultdict(list)
    for source, row in draws:
        per_source[source].append(row)
    for source, rows in per_source.items():
        n = source_sizes[source]
        for start in range(0, len(rows), n):
            epoch = rows[start : start + n]
            assert len(set(epoch)) == len(epoch), f"source {source}: a row repeats within epoch {start // n}"


def check_rss_flat(recs: list[dict], warmup: int = 2) -> None:
    rss = [r["peak_rss_bytes"] for r in recs][warmup:]
    q = max(1, len(rss) // 4)
    first, last = max(rss[:q]), max(rss[-q:])
    assert last <= first * 1.1 + 50 * 2**20, f"peak RSS grew from {first / 2**20:.0f} to {last / 2**20:.0f} MiB"


def replay_draws(mixture: str, num_steps: int):
    """The (source, row) ids and digests of the first ``num_steps`` global batches, as the trainer forms them."""
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.training.trainer import _digest

    data = MixtureData.load(MixtureSpec.from_file(mixture), load_tokenizer("byt5"), "t5")
    limits = LengthLimits("t5", max_input_len=128, max_target_len=32, max_seq_len=128)
    batcher = GlobalBatcher(data, limits, token_budget=1024)
    draws, digests = [], []
    for _ in range(num_steps):
        batch = batcher.next_batch()
        draws += [(s.source_index, s.row_index) for s in batch.samples]
        digests.append(_digest(batch))
    return draws, digests, data


def soak_mixture(folder, toy_mixture_dir) -> str:
    """The toy mixture's files at fixed rates plus a 6-row source, so sources wrap into new epochs."""
    from conftest import random_rows, write_jsonl

    write_jsonl(os.path.join(folder, "tiny.jsonl"), random_rows("tiny", 6, 4, 8, 3))
    with open(os.path.join(toy_mixture_dir, "toy.json")) as f:
        spec = json.load(f)
    spec["rule"] = "fixed"  # fixed rates so the small sources wrap several epochs
    spec.pop("cap", None)
    for s, rate in zip(spec["sources"], (0.35, 0.2, 0.25)):
        s["data_files"] = os.path.join(toy_mixture_dir, s["data_files"])
        s["rate"] = rate
    spec["sources"].append({"task": "tiny", "data_files": os.path.join(folder, "tiny.jsonl"), "rate": 0.2})
    path = os.path.join(folder, "soak.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def test_soak_crash_corrupt_checkpoint_resume(tmp_path, toy_mixture_dir):
    mixture = soak_mixture(str(tmp_path), toy_mixture_dir)
    out = str(tmp_path / "soak")
    first = train(out, mixture, "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
                  env_extra={"DYNABATCH_CRASH_AT": str(CRASH_AT)})
    assert first.returncode == 17, first.stderr[-2000:]
    before = records(out)
    assert [r["step"] for r in before] == list(range(CRASH_AT))
    newest = os.path.join(out, "checkpoints", "step-000012")
    name = data_files(newest)[0]
    broken = os.path.join(newest, name)
    with open(broken, "r+b") as f:  # truncate the newest checkpoint's data file
        f.truncate(os.path.getsize(broken) // 2)

    second = train(out, mixture, "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--resume")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "skipping broken checkpoint" in second.stderr and "step-000012" in second.stderr
    assert f"{name} is corrupt or truncated" in second.stderr
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(STEPS))  # the resume dropped the records of steps 8-13 it trains again
    after = records(out)[8:]  # resumed from the step-8 checkpoint

    draws, digests, data = replay_draws(mixture, STEPS)
    assert [r["samples_digest"] for r in before] == digests[:CRASH_AT]
    assert [r["samples_digest"] for r in after] == digests[8:]  # same batches after the resume
    sizes = [len(s) for s in data.sources]
    assert sum(1 for src, _ in draws if src == 3) > 2 * sizes[3], "the tiny source should wrap epochs"
    check_no_repeat_within_epoch(draws, sizes)
    check_rss_flat(after)


@pytest.mark.slow  # ~25-45 s on 2 cores; tests/dist/test_dead_rank.py covers the executor-level path by default
def test_trainer_rank_killed_mid_run(tmp_path, toy_mixture_dir):
    """2 stages, rank 1 dies at step 2: rank 0 exits non-zero within the group timeout, naming the peer."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "t5-tiny", "--tokenizer", "byt5",
           "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--global-batch-tokens", "1024",
           "--max-input-len", "128", "--max-target-len", "32", "--output-dir", str(tmp_path / "run"),
           "--log-every", "0", "--no-timeline", "--stages", "2", "--steps", "4", "--timeout-s", "20"]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DYNABATCH_CRASH_AT": "2:1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 17
    assert procs[0].returncode not in (0, None), errs[0][-2000:]
    assert time.monotonic() - start < 120
    assert "PipelineError: rank 0 (stage 0, replica 0), step 2" in errs[0] and "(peer rank 1)" in errs[0], errs[0][-2000:]
