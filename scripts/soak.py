"""Soak ``dynabatch train``: many steps with checkpoints, kills and resumes; check data order and memory.

Runs tiny T5 on a mixture (default: a generated toy mixture like the tests' one) for ``--steps`` steps,
checkpointing every ``--checkpoint-every`` steps and killing the run (``DYNABATCH_CRASH_AT``) at each
step of ``--crash-at``, resuming each time. Then checks, against a replay of the global batcher:
every trained step saw exactly the batches an uninterrupted run would (``samples_digest``), no
(source, row) is drawn twice within an epoch of its source, and, per process, peak RSS after warm-up
does not grow (last-quarter max <= first-quarter max x 1.1 + 50 MiB).

    python scripts/soak.py --steps 200 --checkpoint-every 10 --crash-at 57,133
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def toy_mixture(folder: str) -> str:
    from conftest import random_rows, write_jsonl

    write_jsonl(os.path.join(folder, "short.jsonl"), random_rows("short", 40, 1, 4, 2))
    write_jsonl(os.path.join(folder, "classify.jsonl"), random_rows("classify", 150, 2, 30, 1))
    write_jsonl(os.path.join(folder, "summarize.jsonl"), random_rows("summarize", 600, 3, 60, 12))
    spec = {"name": "toy", "rule": "examples_proportional", "cap": 300, "seed": 7,
            "sources": [{"task": t, "data_files": f"{t}.jsonl"} for t in ("short", "classify", "summarize")]}
    path = os.path.join(folder, "toy.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--crash-at", default="37,81", help="comma-separated steps at which to kill the run")
    p.add_argument("--mixture", default=None)
    p.add_argument("--output-dir", default=None)
    a = p.parse_args(argv)
    soak = _load("soak_tests", os.path.join(HERE, "..", "tests", "dist", "test_soak.py"))
    work = a.output_dir or tempfile.mkdtemp(prefix="dynabatch-soak-")
    os.makedirs(work, exist_ok=True)
    mixture = a.mixture or toy_mixture(work)
    out = os.path.join(work, "run")
    crashes = sorted(int(x) for x in a.crash_at.split(",") if x)
    start = time.perf_counter()
    segments: list[list[dict]] = []
    seen = 0
    for i, crash in enumerate(crashes + [None]):
        env = {"DYNABATCH_CRASH_AT": str(crash)} if crash is not None else {}
        extra = ["--resume"] if i else []
        r = soak.train(out, mixture, "--steps", str(a.steps), "--checkpoint-every", str(a.checkpoint_every),
                       *extra, env_extra=env, timeout=24 * 3600)
        expected = 17 if crash is not None else 0
        if r.returncode != expected:
            print(r.stderr[-3000:])
            print(f"FAIL: run {i} exited {r.returncode}, expected {expected}")
            return 1
        recs = soak.records(out)
        segments.append(recs[seen:])
        seen = len(recs)
        print(f"run {i}: steps {segments[-1][0]['step']}..{segments[-1][-1]['step']} "
              f"({time.perf_counter() - start:.0f} s so far)")
    draws, digests, data = soak.replay_draws(mixture, a.steps)
    for seg in segments:
        for r in seg:
            assert r["samples_digest"] == digests[r["step"]], f"step {r['step']}: batch differs from the replay"
    soak.check_no_repeat_within_epoch(draws, [len(s) for s in data.sources])
    for seg in segments:
        if len(seg) >= 8:
            soak.check_rss_flat(seg)
    rss = [r["peak_rss_bytes"] / 2**20 for seg in segments for r in seg]
    print(f"OK: {a.steps} steps, {len(crashes)} kills + resumes, {len(draws)} samples, peak RSS "
          f"{min(rss):.0f}-{max(rss):.0f} MiB, {time.perf_counter() - start:.0f} s; output in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
