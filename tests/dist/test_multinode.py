"""Multi-node rehearsal on one machine: two ``torchrun --nnodes 2 --node-rank {0,1}`` launches (one process each,
meeting at a static rendezvous on 127.0.0.1) train one 2-stage job, and its losses and gradient norms equal those of
a one-node ``torchrun --nproc-per-node 2`` run of the same layout.

Plans must not depend on measured times for the runs to be comparable: ``--calibrate off`` keeps the online cost fit
out (the planner decides with the analytic model only), the layer split is priced by that model too, and dropout is
0, so both runs plan, split and compute the same steps (``samples_digest`` checks the samples)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(out, toy_mixture_dir) -> list[str]:
    return ["train", "--model", "gpt2-tiny", "--tokenizer", "byt5", "--stages", "2", "--global-batch-tokens", "1024",
            "--max-input-len", "128", "--max-target-len", "32", "--logging-steps", "0", "--no-timeline",
            "--task-loss-every", "0", "--calibrate", "off", "--planner", "thread",
            "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(out),
            "--max-steps", str(STEPS), "--save-steps", "0", "--timeout-s", "120"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _two_nodes(out, toy_mixture_dir, extra=((), ())):
    """``torchrun --nnodes 2`` launched twice on this machine, node ``n`` with its flags plus ``extra[n]``: the
    launches and their output (stdout and stderr)."""
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "dynabatch", *_flags(out, toy_mixture_dir), *extra[n]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for n in (0, 1)]
    outputs = []
    try:
        for p in nodes:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    return nodes, outputs


def test_two_node_launch_trains_like_one_node(tmp_path, toy_mixture_dir):
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dynabatch", *_flags(one, toy_mixture_dir)],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]

    nodes, outputs = _two_nodes(two, toy_mixture_dir)
    for n, (p, text) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"node {n}: " + text[-3000:]

    got, want = _records(two), _records(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(STEPS))
    assert [r["samples_digest"] for r in got] == [r["samples_digest"] for r in want]
    assert [r["micro_batch_shapes"] for r in got] == [r["micro_batch_shapes"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=0), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-6, abs=0), g["step"]


def test_a_flag_typed_otherwise_on_one_node_is_one_line_at_start(tmp_path, toy_mixture_dir):
    """Node 1 started with another --learning-rate: before any step, the run stops with one line naming the setting
    (it trained node 1's stage at that rate, silently; another --max-steps hung until the timeout)."""
    out = tmp_path / "run"
    nodes, outputs = _two_nodes(out, toy_mixture_dir, ((), ("--learning-rate", "0.5")))
    assert all(p.returncode != 0 for p in nodes), outputs
    text = "".join(outputs)
    lines = [ln for ln in text.splitlines() if ln.startswith("dynabatch train: error:")]
    assert len(lines) == 1, text[-3000:]
    assert "rank 1 was started with other settings than rank 0 (learning_rate: 0.001 on rank 0, 0.5 on rank 1)" \
        in lines[0], lines
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
