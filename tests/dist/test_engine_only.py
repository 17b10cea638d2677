"""The engine stands on its own: ``examples/engine_only.py`` runs one step of variable-shape micro-batches through a
GPT-2 split in two, on two gloo ranks, with the plan, schedule and engine layers only (no module of the training
application imported), and its loss is the unsplit Hugging Face model's on the same samples."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "engine_only.py"
RANK_LINE = re.compile(r"^rank (\d): app modules imported: none; loss (\S+) over (\d+) loss tokens$", re.M)
SHAPES_LINE = re.compile(r"^micro-batch shapes \(b, T, 0\): (.*)$", re.M)


def _example():
    """The example as a module (its ``__main__`` part does not run): its model and samples."""
    spec = importlib.util.spec_from_file_location("engine_only_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unsplit_loss(example) -> tuple[float, int]:
    """The token-normalised loss of the samples under the whole HF model, one sample at a time, unpadded: HF's own
    shifted cross-entropy over the target tokens (inputs masked with -100)."""
    model = example.make_model()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for s in example.make_samples():
            ids = torch.from_numpy(np.concatenate([s.input_ids, s.target_ids]).astype(np.int64))[None]
            labels = ids.clone()
            labels[0, : s.input_len] = -100
            loss_sum += float(model(input_ids=ids, labels=labels).loss) * s.target_len
            tokens += s.target_len
    return loss_sum / tokens, tokens


def test_engine_runs_a_variable_shape_step_without_the_application():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen([sys.executable, str(EXAMPLE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:  # the reference runs while the ranks start up
        example = _example()
        expected, tokens = _unsplit_loss(example)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout + stderr
    ranks = {int(r): (float(loss), int(n)) for r, loss, n in RANK_LINE.findall(stdout)}
    assert sorted(ranks) == [0, 1], stdout + stderr  # both ranks checked sys.modules and reported
    shapes = ast.literal_eval(SHAPES_LINE.search(stdout).group(1))
    assert len(shapes) >= 2 and len(set(shapes)) >= 2, shapes  # variable-shape micro-batches in one step
    assert sum(b for b, _, _ in shapes) == len(example.LENGTHS)  # every sample in one row, planned once
    planned = [example.micro_batch_shape(mb) for mb in example.plan_micro_batches(example.make_samples())]
    assert shapes == planned  # what ran is what the plan layer cut
    assert ranks[0] == ranks[1]
    loss, got_tokens = ranks[0]
    assert got_tokens == tokens
    assert torch.isfinite(torch.tensor(loss))
    assert abs(loss - expected) <= 1e-5, (loss, expected)
    print(f"pipeline loss {loss!r}, unsplit {expected!r}, difference {abs(loss - expected):.2e}")
