"""``dynabatch data-report``: what a mixture or a lengths file looks like, and what each baseline would waste.

A mixture spec or ``--data`` file: per task (each row's ``task``, as training sees it: a ``--data`` file with a
``task`` column reports every task in it), the example count, mixing rate, input/target length percentiles and a
length histogram, then the padding efficiency (real / computed tokens) of every baseline batcher on a few global
batches at several maximum lengths. For T5 a max length L limits inputs to L and targets to L/4 (override with
``--max-target-len``).

A lengths file (``--lengths``, ``.npz``/``.jsonl`` as ``plan`` and ``simulate`` read them): its tail, the numbers
that decide how long samples must be handled (keep whole, slice, split or truncate;
``docs/user_guide/long_samples.md``): percentiles up to p99.9 and the maximum of the input, target and total
(inputs + targets) lengths, and how many samples, and what share of the tokens, lie over 4k, 8k and 16k tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from dynabatch.commands.common import check_length_flags, check_output_file, check_positive, parse_methods, write_json
from dynabatch.training.config.flags import add_fields
from dynabatch.training.config.resolve import Found, resolve_args
from dynabatch.core.methods import check_method_family, methods_for
from dynabatch.data.baselines import BASELINES, BaselineOptions, make_batcher, option_users
from dynabatch.data.batching import MIN_LENGTH_LIMIT, GlobalBatcher, LengthLimits, check_token_budget
from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.inputs import data_notes, data_spec, parse_columns
from dynabatch.data.mixture import DEFAULT_NAME, MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.tokenize import FAMILIES, describe_tokenizer, load_tokenizer, tokenizer_info
from dynabatch.core.progress import progress
from dynabatch.core.words import counted
from dynabatch.training.workload import Lengths, is_mixture_spec, load_lengths

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
    width = max(9, len(str(tail.percentiles["total"]["max"])) + 2)  # columns stay apart for any length
    print(f"{'':<8}" + "".join(f"{n:>{width}}" for n in names))
    for column, row in tail.percentiles.items():
        print(f"{column:<8}" + "".join(f"{row[n]:>{width}.0f}" for n in names))
    for t, o in tail.over.items():
        print(f"total over {t:>6} tokens: {o['samples']:>6} samples ({100 * o['share']:.2f}%), "
              f"{100 * o['token_share']:.1f}% of the tokens")


PERCENTILES = (50, 90, 95, 99)
HIST_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_fields(p, ["mixture", "data", "columns", "tokenizer", "global_batch_tokens"], helps={
        "tokenizer": "builtin (what auto is without --model), gpt2, byt5 or a local tokenizer folder "
                     "(e.g. a model folder)"})
    p.add_argument("--family", default="both", choices=[*FAMILIES, "t5", "gpt2", "both"],
                   help="sequence kind to tokenize for (t5 = seq2seq, gpt2 = causal)")
    p.add_argument("--max-lens", default="512,1024,2048", help="comma-separated maximum lengths to report")
    p.add_argument("--num-batches", type=int, default=4, help="global batches per measurement")
    p.add_argument("--methods", default=None, help=f"comma list of {', '.join(BASELINES)} (default: all)")
    add_fields(p, (*option_users(), "max_target_len", "overlong", "bad_rows"), defaults={"max_target_len": None}, helps={
        "max_target_len": "T5 target limit (default: max length / 4)",
        "overlong": "over-long samples in the efficiency table: truncate, drop (both counted) or error"})
    p.add_argument("--lengths", default=None, help="a lengths file (.npz with input_len, target_len[, task], or "
                                                   ".jsonl): report its tail (percentiles up to p99.9, max, samples "
                                                   "over 4k/8k/16k tokens) instead of a mixture's tables")
    p.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH",
                   help="with --lengths: write the tail as JSON to PATH, or to stdout instead of the table")


def _spec(args: argparse.Namespace) -> MixtureSpec:
    if args.columns and not args.data:
        raise ValueError("--columns maps the columns of --data; pass --data FILE (a mixture spec maps its own)")
    if args.data and args.mixture:
        raise ValueError(f"give --mixture or --data, not both (got {args.mixture!r} and {args.data!r})")
    if args.data:
        return data_spec(args.data, parse_columns(args.columns))
    return MixtureSpec.from_file(args.mixture or default_mixture_path())


def _pct(x: np.ndarray) -> str:
    """p50/p90/p95/p99 rounded, as ``--lengths``' tail prints them (they were truncated: a p99 of 9.9 read 9), then
    the maximum."""
    return " ".join(f"{v:>5.0f}" for v in np.percentile(x, PERCENTILES)) + f" {int(x.max()):>6d}"


def _histogram(lengths: np.ndarray) -> str:
    counts, _ = np.histogram(lengths, bins=[*HIST_EDGES, np.inf])
    peak = max(counts.max(), 1)
    bars = "".join(" ▁▂▃▄▅▆▇█"[int(np.ceil(8 * c / peak))] for c in counts)
    return f"|{bars}|"


@dataclass(frozen=True)
class TaskRows:
    """The rows of one task (the ``task`` of each row, as training and its task losses see them), over
    every source that holds some."""

    task: str
    num_rows: int
    rate: float
    """The task's share of the samples drawn: each source's mixing rate split over its rows' tasks."""
    input_lens: np.ndarray
    target_lens: np.ndarray


def task_rows(data: MixtureData) -> list[TaskRows]:
    """Per task (in order of first appearance), its rows over every source: a source read from one file with a
    ``task`` column holds several tasks, a source without one is one task named after it."""
    parts: dict[str, list[tuple[float, np.ndarray, np.ndarray]]] = {}
    for src, rate in zip(data.sources, data.rates):
        tasks = np.asarray(src.tasks, dtype=object)
        for task in dict.fromkeys(src.tasks):
            rows = np.flatnonzero(tasks == task)
            share = rate * len(rows) / len(src)
            parts.setdefault(task, []).append((share, src.input_ids.lengths[rows], src.target_ids.lengths[rows]))
    return [TaskRows(task, sum(len(p[1]) for p in ps), float(sum(p[0] for p in ps)),
                     np.concatenate([p[1] for p in ps]), np.concatenate([p[2] for p in ps]))
            for task, ps in parts.items()]


def print_task_table(data: MixtureData, notes: bool = True) -> None:
    """The per-task length table of ``data``, then (``notes``) one line per source with numbers cast to text or
    rows skipped. Those come from reading the files, the same for every family, so a report of both families says
    them under the first table only."""
    labels = ",".join(str(e) for e in HIST_EDGES[1:])
    tasks = task_rows(data)
    print(f"\n== tasks ({data.family}, {counted(len(tasks), 'task')} in {counted(len(data.sources), 'source')}) ==")
    header = f"{'task':<22} {'rows':>6} {'rate':>6} | inputs p{'/p'.join(map(str, PERCENTILES))} max | targets p{'/p'.join(map(str, PERCENTILES))} max | hist(total, bins <{labels},+)"
    print(header)
    for t in tasks:
        e, d = t.input_lens, t.target_lens
        print(f"{t.task:<22} {t.num_rows:>6d} {t.rate:>6.3f} | {_pct(e)} | {_pct(d)} | {_histogram(e + d)}")
    for note in data_notes(data) if notes else ():
        print(f"  {note}")


def parse_max_lens(text: str) -> list[int]:
    """``--max-lens``: a comma list of length limits, each under the one rule of every command (>=
    :data:`~dynabatch.data.batching.MIN_LENGTH_LIMIT`)."""
    try:
        max_lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        max_lens = []
    if not max_lens or min(max_lens) < MIN_LENGTH_LIMIT:
        raise ValueError(f"--max-lens takes a comma list of integers >= {MIN_LENGTH_LIMIT} (a sample keeps its EOS "
                         f"and one token; e.g. 512,1024), got {text!r}")
    return max_lens


def report_limits(family: str, max_len: int, max_target_len: int | None) -> LengthLimits:
    """The length limits of one ``--max-lens`` entry: T5 inputs up to ``max_len``, targets up to
    ``--max-target-len`` (default ``max_len / 4``); decoder-only sequences up to ``max_len``."""
    target_len = max_target_len if max_target_len is not None else max(max_len // 4, MIN_LENGTH_LIMIT)
    return LengthLimits(family, max_input_len=max_len, max_target_len=target_len, max_seq_len=max_len)


def report_methods(args: argparse.Namespace, family: str) -> list[str]:
    """``--methods`` for the ``family`` report (default: every baseline it can run); a decoder-only method named
    while ``--family`` reports encoder-decoder data is one line."""
    methods = parse_methods(args.methods, tuple(methods_for(family, tuple(BASELINES))) if args.methods is None
                            else tuple(BASELINES))
    subject = f"--family {args.family} {'includes' if args.family == 'both' else 'is'} encoder-decoder (seq2seq) data"
    for name in methods:  # packing_free_split cuts decoder-only sequences
        check_method_family(name, family, subject=subject)
    return methods


def check_report_args(args: argparse.Namespace, families) -> None:
    """Before any table: the methods of each family, and a ``--global-batch-tokens`` that holds one maximal sample
    at every ``--max-lens`` (the check and line of ``train`` and ``plan``: never raised silently)."""
    for family in families:
        report_methods(args, family)
        for max_len in parse_max_lens(args.max_lens):
            check_token_budget(args.global_batch_tokens, report_limits(family, max_len, args.max_target_len),
                               "--global-batch-tokens")


def print_efficiency(data: MixtureData, args: argparse.Namespace) -> None:
    max_lens = parse_max_lens(args.max_lens)
    methods = report_methods(args, data.family)
    options = BaselineOptions.of(args)
    print(f"\n== padding efficiency ({data.family}, {args.num_batches} global batches of {args.global_batch_tokens} tokens, "
          f"over-long samples: {args.overlong}) ==")
    print(f"{'max_len':>8} " + " ".join(f"{name:>15}" for name in methods) + f" {'truncated':>10} {'dropped':>8}")
    for max_len in progress(max_lens, desc=f"baselines {data.family}", leave=False):
        limits = report_limits(data.family, max_len, args.max_target_len)
        batcher = GlobalBatcher(data, limits, token_budget=args.global_batch_tokens, overlong=args.overlong)
        batches = [batcher.next_batch() for _ in range(args.num_batches)]
        cells = []
        for name in methods:
            b = make_batcher(name, limits, data.tokens, **options.batcher_options(name, limits))
            stats = [b.stats(gb) for gb in batches]
            real = sum(s.real_tokens for s in stats)
            computed = sum(s.computed_tokens for s in stats)
            cells.append(f"{real / computed:>15.3f}")
        n = sum(len(gb) for gb in batches)
        tqdm.write(f"{max_len:>8} " + " ".join(cells) + f" {batcher.num_truncated:>4d}/{n:<5d} {batcher.num_dropped:>8d}")


def run(args: argparse.Namespace) -> int:
    if args.lengths is not None:
        return run_lengths(args)
    if args.json:
        raise ValueError("--json goes with --lengths (the mixture report is a table)")
    check_positive(args, "global_batch_tokens", "num_batches", *option_users())
    check_length_flags(args)  # --max-target-len; before any table
    families = FAMILIES if args.family == "both" else (args.family,)
    check_report_args(args, families)
    spec = _spec(args)
    decided = resolve_args(args, Found())  # --tokenizer auto: the resolver's rule (no --model: builtin)
    tokenizer = load_tokenizer(args.tokenizer)
    why = decided["tokenizer"][1] if "tokenizer" in decided else None
    print(describe_tokenizer(args.tokenizer, None, tokenizer_info(tokenizer), why))
    print(mixture_line(spec))
    for i, family in enumerate(families):
        data = MixtureData.load(spec, tokenizer, family, bad_rows=args.bad_rows)
        print_task_table(data, notes=i == 0)
        print_efficiency(data, args)
    return 0


def mixture_line(spec: MixtureSpec) -> str:
    """The report's line about the mixture: its name unless it is the default one (``mixture``, which the line's
    first word already says), how many sources (``1 source``, ``2 sources``), its rule, cap and seed."""
    named = "mixture" if spec.name == DEFAULT_NAME else f"mixture {spec.name!r}"
    return f"{named}: {counted(len(spec.sources), 'source')}, rule {spec.rule}, cap {spec.cap}, seed {spec.seed}"


def run_lengths(args: argparse.Namespace) -> int:
    """``--lengths FILE``: the file's tail as a table, or as JSON with ``--json``."""
    if args.mixture or args.data:
        raise ValueError(f"give --lengths or a mixture (--mixture/--data), not both (got --lengths {args.lengths})")
    if is_mixture_spec(args.lengths):  # plan, simulate and bench --lengths take a mixture spec too
        raise ValueError(f"--lengths {args.lengths}: data-report's --lengths reads a lengths file (.npz/.jsonl); "
                         f"for a mixture spec's tables pass --mixture {args.lengths}")
    check_output_file(args.json, command="data-report")
    tail = lengths_tail(load_lengths(args.lengths, None if args.family == "both" else args.family))
    if args.json:
        if write_json({"lengths": args.lengths, **asdict(tail)}, args.json, command="data-report"):
            return 0
    print_tail(args.lengths, tail)
    return 0
