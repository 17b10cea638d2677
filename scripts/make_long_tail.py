"""Write ``data/long_tail_32k.npz``: a multi-task lengths file with a long tail, deterministic (fixed seed).

Most samples are short FLAN-like ones; a few tenths of a percent are 16k-31k tokens long, as in real mixtures
whose rare long documents a user keeps whole (the long-tail benchmark, ``docs/benchmarks/long_tail/``)::

    python scripts/make_long_tail.py                   # writes data/long_tail_32k.npz
    dynabatch data-report --lengths data/long_tail_32k.npz

The file holds integer arrays ``input_len``, ``target_len`` (uint16) and ``task`` (uint8 task ids), the format
:func:`dynabatch.training.workload.load_lengths` reads. The mixture:

- 24 tasks, each with lognormal input lengths (medians 24-600 tokens) and target lengths (medians 2-160);
  inputs clipped to 4,096 and targets to 1,000 tokens;
- 0.8% of the samples (spread over the tasks) are mid-length, 2k-12k input tokens (log-uniform);
- 0.3% are long, 16k-31k input tokens (log-uniform) with 64-1,000 target tokens, so every sample of a
  decoder-only model stays under 32,768 tokens in all (inputs + targets).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SEED = 20261206
NUM_SAMPLES = 16_384
NUM_TASKS = 24
MID_SHARE, LONG_SHARE = 0.008, 0.003


def long_tail_lengths(num_samples: int = NUM_SAMPLES, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_len, target_len, task)`` of the long-tail mixture, in stream (shuffled) order."""
    rng = np.random.default_rng(seed)
    in_median = np.exp(rng.uniform(np.log(24), np.log(600), NUM_TASKS))
    tg_median = np.exp(rng.uniform(np.log(2), np.log(160), NUM_TASKS))
    task = rng.integers(0, NUM_TASKS, num_samples)
    inputs = np.clip(rng.lognormal(np.log(in_median[task]), 0.7), 4, 4096)
    targets = np.clip(rng.lognormal(np.log(tg_median[task]), 0.8), 1, 1000)
    kind = rng.random(num_samples)
    mid = kind < MID_SHARE
    long = (kind >= MID_SHARE) & (kind < MID_SHARE + LONG_SHARE)
    inputs[mid] = np.exp(rng.uniform(np.log(2048), np.log(12_000), mid.sum()))
    inputs[long] = np.exp(rng.uniform(np.log(16_384), np.log(31_000), long.sum()))
    targets[long] = np.exp(rng.uniform(np.log(64), np.log(1000), long.sum()))
    return inputs.astype(np.uint16), targets.astype(np.uint16), task.astype(np.uint8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "..", "data", "long_tail_32k.npz"))
    args = p.parse_args()
    e, d, task = long_tail_lengths()
    np.savez_compressed(args.out, input_len=e, target_len=d, task=task)
    total = e.astype(np.int64) + d
    print(f"wrote {os.path.normpath(args.out)} ({os.path.getsize(args.out)} bytes): {len(e)} samples, "
          f"{(total > 16_384).sum()} over 16k tokens, longest {total.max()}")


if __name__ == "__main__":
    main()
