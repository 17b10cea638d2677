"""``dynabatch data-report``: what a mixture or a lengths file looks like.

A mixture spec or ``--data`` file: per-task length statistics and each baseline's padding efficiency
(:mod:`dynabatch.data.report`). A lengths file (``--lengths``, ``.npz``/``.jsonl`` as ``plan`` and ``simulate``
read them): its tail, the numbers that decide how long samples must be handled (keep whole, slice, split or
truncate; ``docs/user_guide/long_samples.md``): percentiles up to p99.9 and the maximum of the input, target
and total (inputs + targets) lengths, and how many samples, and what share of the tokens, lie over 4k, 8k and
16k tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np

from dynabatch.commands.common import write_json
from dynabatch.data import report
from dynabatch.workload import Lengths, load_lengths

TAIL_PERCENTILES = (50, 90, 99, 99.9)
TAIL_THRESHOLDS = (4096, 8192, 16384)


@dataclass(frozen=True)
class LengthsTail:
    """The tail of a lengths file."""

    samples: int
    tasks: int
    tokens: int
    percentiles: dict
    """``{"input"|"target"|"total": {"p50": .., "p90": .., "p99": .., "p99.9": .., "max": .., "mean": ..}}``."""
    over: dict
    """``{threshold: {"samples": n, "share": n / samples, "token_share": their tokens / all tokens}}``, by the
    total length (inputs + targets, a decoder-only model's sequence)."""


def lengths_tail(lengths: Lengths) -> LengthsTail:
    """Percentiles (up to p99.9), maximum and over-threshold counts of ``lengths``."""
    columns = {"input": lengths.input_len, "target": lengths.target_len,
               "total": lengths.input_len + lengths.target_len}
    pct = {name: {**{f"p{p:g}": float(np.percentile(x, p)) for p in TAIL_PERCENTILES},
                  "max": int(x.max()), "mean": float(x.mean())} for name, x in columns.items()}
    total = columns["total"]
    tokens = int(total.sum())
    over = {t: {"samples": int((total > t).sum()), "share": float((total > t).mean()),
                "token_share": float(total[total > t].sum() / tokens)} for t in TAIL_THRESHOLDS}
    tasks = len(np.unique(lengths.task)) if lengths.task is not None else 1
    return LengthsTail(len(total), tasks, tokens, pct, over)


def print_tail(path: str, tail: LengthsTail) -> None:
    print(f"== lengths file {path}: {tail.samples} samples, {tail.tasks} tasks, {tail.tokens} tokens ==")
    names = [*(f"p{p:g}" for p in TAIL_PERCENTILES), "max", "mean"]
    print(f"{'':<8}" + "".join(f"{n:>9}" for n in names))
    for column, row in tail.percentiles.items():
        print(f"{column:<8}" + "".join(f"{row[n]:>9.0f}" for n in names))
    for t, o in tail.over.items():
        print(f"total over {t:>6} tokens: {o['samples']:>6} samples ({100 * o['share']:.2f}%), "
              f"{100 * o['token_share']:.1f}% of the tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    report.add_arguments(p)
    p.add_argument("--lengths", default=None, help="a lengths file (.npz with input_len, target_len[, task], or "
                                                   ".jsonl): report its tail (percentiles up to p99.9, max, samples "
                                                   "over 4k/8k/16k tokens) instead of a mixture's tables")
    p.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH",
                   help="with --lengths: write the tail as JSON to PATH, or to stdout instead of the table")


def run(args: argparse.Namespace) -> int:
    if args.lengths is None:
        if args.json:
            raise ValueError("--json goes with --lengths (the mixture report is a table)")
        return report.run(args)
    if args.mixture or args.data:
        raise ValueError(f"give --lengths or a mixture (--mixture/--data), not both (got --lengths {args.lengths})")
    tail = lengths_tail(load_lengths(args.lengths))
    if args.json:
        if write_json({"lengths": args.lengths, **asdict(tail)}, args.json):
            return 0
    print_tail(args.lengths, tail)
    return 0
