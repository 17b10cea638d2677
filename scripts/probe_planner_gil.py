"""How long does rank 0's planner hold the GIL per planned step? A probe, one process, no torch.distributed.

Builds the trainer's :class:`~dynabatch.training.planner.StepPlanner` (``--model``, ``--stages``, built-in
mixture, ``--calibrate off``) and measures, in turns of ``--seconds`` each (``--rounds`` times, so machine noise
hits both alike):

* alone: the main thread spins a pure-Python loop (it wants the GIL all the time, as a training loop dispatching
  GPU kernels does) and counts its iterations;
* with the planner: the same spin while a background thread plans steps one after another.

The spin's lost share of iterations times the turn's length is the time the planner thread held the GIL;
divided by the steps it planned, the GIL seconds per planned step: what the planner thread can take from rank 0's
training loop per step at most. Also prints each planned step's own wall time run synchronously (``plan_time_s``).

    python scripts/probe_planner_gil.py --model gpt2-tiny --stages 2 [--seconds 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402


def build_planner(model: str, stages: int, extra: dict):
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import _load_data, planner_cost_model
    from dynabatch.models.families import check_model

    cfg = TrainConfig(model=model, stages=stages, calibrate="off", **extra)
    family = check_model(cfg.model, cfg.max_input_len, cfg.slice_long).sequence_kind
    tokenizer = load_tokenizer(cfg.tokenizer)
    net = build_model(cfg.model, vocab_size=tokenizer_info(tokenizer).vocab_size)
    loaded = _load_data(cfg, tokenizer, family, None)
    cost_model = planner_cost_model(cfg, net.config, layout_for(net, stages))
    return StepPlanner(loaded.batcher, cfg, cost_model, loaded.data.tokens)


def _spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while True:
        for _ in range(1000):
            n += 1
        if time.perf_counter() >= end:
            return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args(argv)
    planner = build_planner(a.model, a.stages, {})
    sync = []
    for _ in range(5):
        sync.append(planner().plan_time_s)
    print(f"planned synchronously: plan_time_s median {1e3 * np.median(sync):.1f} ms")
    held, planned = [], 0
    for _ in range(a.rounds):
        alone = _spin(a.seconds)
        stop, count = threading.Event(), [0]

        def plan_loop():
            while not stop.is_set():
                planner()
                count[0] += 1

        t = threading.Thread(target=plan_loop, daemon=True)
        t.start()
        with_planner = _spin(a.seconds)
        stop.set()
        t.join()
        lost = max(0.0, 1.0 - with_planner / alone) * a.seconds
        held.append(lost / max(count[0], 1))
        planned += count[0]
        print(f"  round: spin lost {lost / a.seconds:.1%} of {a.seconds:g} s while the planner planned {count[0]} steps"
              f" -> {1e3 * held[-1]:.1f} ms of GIL per planned step")
    print(f"GIL held per planned step: median {1e3 * np.median(held):.1f} ms over {a.rounds} rounds "
          f"({planned} steps planned)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
