"""Workloads for planning, simulation and benchmarks: global batches from lengths or mixtures, and
the micro-batches every batching method makes of them.

A workload is a stream of samples known by their lengths only (a ``.npz`` with integer arrays
``input_len``/``target_len`` and optional ``task``; a ``.jsonl`` with those fields; or a mixture spec,
tokenized). :func:`global_batches` cuts it into token-budget global batches with the same length
limits and truncation as training (:mod:`dynabatch.data.batching`). :func:`method_micro_batches`
then applies one method (``dynamic``, the planner, or a baseline) and returns the padded/packed
shapes ``(rows, E, D)`` the model would compute on, with real and computed token counts and the
attention pairs the padding-free runtime computes (:attr:`MethodPlan.pairs`), so that every method is
priced by the same cost model.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass, replace

import numpy as np

from dynabatch.core.sequence import is_seq2seq
from dynabatch.core.methods import COMPARED_METHODS, DYNAMIC_SLICED, METHODS, check_method_family, is_planner  # noqa: F401 (METHODS re-exported)
from dynabatch.cost.pairs import AttentionPairs, groups_pairs
from dynabatch.data.baselines import GROUPING_TOKENS, BaselineOptions, RowGroup, attention_for, group_shape, make_batcher
from dynabatch.data.user_files import USER_FILE_KINDS, is_user_file
from dynabatch.data.batching import MIN_LENGTH_LIMIT, GlobalBatcher, LengthLimits, check_token_budget
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.plan.global_plan import GlobalPlanner
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.tokenize import load_tokenizer

MODEL_FAMILIES = {"t5": "seq2seq", "gpt": "causal", "gpt2": "causal", "llama": "causal"}
"""``--model`` of ``plan``/``simulate``: a model family name -> its sequence kind (the analytic preset gives the shape)."""


@dataclass(frozen=True)
class Lengths:
    """Sample lengths of a workload, in stream order."""

    input_len: np.ndarray
    target_len: np.ndarray
    task: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.input_len.shape != self.target_len.shape or self.input_len.ndim != 1:
            raise ValueError(f"input_len {self.input_len.shape} and target_len {self.target_len.shape} must be equal 1-D")
        if len(self.input_len) == 0:
            raise ValueError("the lengths file holds no samples")


MAX_LENGTH = 2**31 - 1
"""The longest input or target a lengths file may give (the int32 range of token positions): far beyond any
sample, and small enough that every count and sum over the file stays exact."""


LENGTHS_FORMATS = (
    "a .npz of integer arrays input_len and target_len (np.savez(path, input_len=..., target_len=...[, task=...])) "
    "or a .jsonl with one {\"input_len\": E, \"target_len\": D} object per line"
)
"""What a lengths file is, for error messages."""


def load_lengths(path: str, family: str | None = None) -> Lengths:
    """Read a ``.npz`` (arrays ``input_len``, ``target_len``[, ``task``]) or ``.jsonl`` lengths file, every value
    checked once here: a whole number of tokens, inputs >= 0 (``family`` encoder-decoder: >= 1, the EOS an input
    always holds), targets >= 1, none over :data:`MAX_LENGTH`; a bad one is one line naming the file and its row
    (``.npz``, from 0) or line (``.jsonl``, from 1)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"lengths file {path!r} not found")
    if os.path.isdir(path):
        raise ValueError(f"lengths file {path!r} is a directory; expected {LENGTHS_FORMATS}")
    where = f"lengths file {path}"
    if path.endswith(".npz"):
        *columns, rows = _read_npz_lengths(path, where)
    elif path.endswith(".jsonl"):
        *columns, rows = _read_jsonl_lengths(path, where)
    else:
        raise ValueError(f"{path}: lengths files are .npz or .jsonl (mixture specs are {USER_FILE_KINDS})")
    try:
        lengths = Lengths(*columns)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    _check_range(lengths, family, where, rows)
    return lengths


def _check_range(lengths: Lengths, family: str | None, where: str, rows) -> None:
    """The first length out of range, as one line: ``rows(i)`` names sample ``i`` (its row or line)."""
    min_input = 1 if family is not None and is_seq2seq(family) else 0
    for name, values, low in (("input_len", lengths.input_len, min_input), ("target_len", lengths.target_len, 1)):
        bad = np.flatnonzero((values < low) | (values > MAX_LENGTH))
        if not len(bad):
            continue
        i = int(bad[0])
        why = (f"over {MAX_LENGTH} tokens, the most a lengths file may give" if values[i] > MAX_LENGTH else
               "an encoder-decoder model's input holds its EOS at least, so >= 1" if low == 1 and name == "input_len"
               else f">= {low}")
        more = f"; {len(bad)} samples in all are" if len(bad) > 1 else ""
        raise ValueError(f"{where}, {rows(i)}: {name} {int(values[i])} is out of range ({why}){more}; fix or drop "
                         f"{'them' if more else 'it'}")


def _read_npz_lengths(path: str, where: str):
    """``(input_len, target_len, task or None, rows)``; ``rows(i)`` names sample ``i``'s row (from 0)."""
    if not zipfile.is_zipfile(path):  # np.load would try to unpickle it and suggest allow_pickle
        raise ValueError(f"{where}: not a valid .npz (zip) file; expected {LENGTHS_FORMATS}")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"input_len", "target_len"} - set(f.files)
            if missing:
                raise ValueError(f"{where}: missing arrays {sorted(missing)}; found {f.files}; expected {LENGTHS_FORMATS}")
            arrays = {name: f[name] for name in ("input_len", "target_len", "task") if name in f.files}
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{where}: not a readable .npz file ({e}); expected {LENGTHS_FORMATS}") from e
    except ValueError as e:
        if "pickle" not in str(e):
            raise
        raise ValueError(f"{where}: holds object (pickled) arrays, not integer ones; expected {LENGTHS_FORMATS}") from e
    for name in ("input_len", "target_len"):
        if arrays[name].dtype.kind not in "iu":
            raise ValueError(f"{where}: array {name!r} has dtype {arrays[name].dtype}, not integers; "
                             f"expected {LENGTHS_FORMATS}")
    return (arrays["input_len"].astype(np.int64), arrays["target_len"].astype(np.int64), arrays.get("task"),
            lambda i: f"row {i} (from 0)")


def _read_jsonl_lengths(path: str, where: str):
    """``(input_len, target_len, task, rows)``; ``rows(i)`` names sample ``i``'s line (from 1; blank lines are
    skipped). A value that is not a whole number (``100.5``, ``"100"``, ``true``) is refused, never rounded."""
    inputs, targets, tasks, lines = [], [], [], []
    with open(path, encoding="utf-8") as f:
        line_no = 0
        try:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a JSON {type(row).__name__}, not an object")
                inputs.append(_whole_number(row, "input_len", f"{where}, line {line_no}"))
                targets.append(_whole_number(row, "target_len", f"{where}, line {line_no}"))
                tasks.append(str(row.get("task", "")))
                lines.append(line_no)
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text ({e}); expected {LENGTHS_FORMATS}") from e
        except _BadValue as e:
            raise ValueError(str(e)) from None
        except (ValueError, KeyError) as e:
            raise ValueError(f"{where}, line {line_no}: need integer fields input_len and target_len ({e})") from e
    return (np.array(inputs, dtype=np.int64), np.array(targets, dtype=np.int64), np.array(tasks),
            lambda i: f"line {lines[i]}")


class _BadValue(ValueError):
    """A field of a .jsonl lengths line that is there but not a whole number (its message is the whole line)."""


def _whole_number(row: dict, name: str, where: str) -> int:
    """``row[name]`` if it is a JSON integer (not a bool, a float or a string of digits)."""
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadValue(f"{where}: {name} must be a whole number of tokens, got {json.dumps(value)}; "
                        f"write it as an integer, e.g. \"{name}\": 100")
    return value


def is_mixture_spec(path: str) -> bool:
    """Whether ``path`` (a ``--lengths`` value) names a mixture spec by its ending, not a lengths file."""
    return is_user_file(path)


def global_batches(
    path: str,
    family: str,
    limits: LengthLimits,
    token_budget: int,
    num_batches: int,
    tokenizer: str = "builtin",
) -> list[GlobalBatch]:
    """The first ``num_batches`` global batches of a lengths file or a mixture spec.

    Lengths files are read in file order; over-long samples are truncated (counted in the batches).
    Samples carry zero token ids of the right lengths: only their lengths matter here.
    """

    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    check_token_budget(token_budget, limits, "--global-batch-tokens")
    if is_mixture_spec(path):
        data = MixtureData.load(MixtureSpec.from_file(path), load_tokenizer(tokenizer), family)
        batcher = GlobalBatcher(data, limits, token_budget=token_budget)
        return [batcher.next_batch() for _ in range(num_batches)]
    lengths = load_lengths(path, family)
    batches: list[GlobalBatch] = []
    current: list[TokenizedSample] = []
    total = truncated = 0
    for i in range(len(lengths.input_len)):
        e, d = int(lengths.input_len[i]), int(lengths.target_len[i])
        task = str(lengths.task[i]) if lengths.task is not None else ""
        over = limits.is_overlong(e, d)
        if over:  # truncated before any array is made: a file may give lengths far beyond memory
            e, d = limits.truncated_lengths(e, d)
        sample = TokenizedSample(task, np.zeros(e, np.int32), np.zeros(d, np.int32), 0, i)
        if current and total + sample.num_tokens > token_budget:
            batches.append(GlobalBatch(step=len(batches), samples=tuple(current), num_truncated=truncated))
            current, total, truncated = [], 0, 0
            if len(batches) == num_batches:
                return batches
        current.append(sample)
        total += sample.num_tokens
        truncated += over
    if current and len(batches) < num_batches:
        batches.append(GlobalBatch(step=len(batches), samples=tuple(current), num_truncated=truncated))
    return batches


def kept_limits(limits: LengthLimits, batches) -> LengthLimits:
    """``limits`` narrowed to the longest sample ``batches`` keep (after truncation): the row length a user who
    keeps every sample whole gives the fixed-size baselines (TRL's ``max_length`` at least the longest sample).
    Rows or budgets longer than that only charge the baselines for lengths no sample reaches (a false gain for
    the planner), so ``plan`` and ``simulate`` size them this way. Decoder-only: one limit on inputs +
    targets (``max_seq_len``, and ``max_input_len`` with it); T5: the longest input and the longest target."""
    e = max((int(b.input_lens.max()) for b in batches if len(b)), default=0)
    d = max((int(b.target_lens.max()) for b in batches if len(b)), default=0)
    if is_seq2seq(limits.family):
        return replace(limits, max_input_len=max(MIN_LENGTH_LIMIT, min(limits.max_input_len, e)),
                       max_target_len=max(MIN_LENGTH_LIMIT, min(limits.max_target_len, d)))
    seq = max((int((b.input_lens + b.target_lens).max()) for b in batches if len(b)), default=0)
    seq = max(MIN_LENGTH_LIMIT, min(limits.max_seq_len, seq))
    return replace(limits, max_seq_len=seq, max_input_len=min(limits.max_input_len, seq))


@dataclass(frozen=True)
class MethodPlan:
    """The micro-batches one method makes of one global batch."""

    method: str
    groups: tuple[RowGroup, ...]
    shapes: np.ndarray
    """(M, 3) int64 computed shape ``(rows, E, D)`` of each micro-batch (GPT: ``D`` = 0)."""
    real_tokens: int
    plan_time_s: float
    """Wall time the method took to decide (the planner's own cost)."""
    predicted_times_s: np.ndarray | None = None
    """(M,) bottleneck-stage times from the planner (``dynamic`` only; slices priced with their context)."""
    num_sliced_samples: int = 0
    """Samples the planner cut into token slices (``dynamic`` with slicing)."""
    pairs: AttentionPairs | None = None
    """(M,) attention score pairs of each micro-batch as the padding-free runtime computes them (per
    sample of each row, :func:`~dynabatch.cost.pairs.row_pairs`; a token slice: its dense ``s^2``); what
    ``dynabatch plan`` and ``simulate`` price the micro-batches with. ``None``: dense (the ``packing``
    baseline, which runs with dense block-diagonal masks)."""
    slice_links: tuple[int, ...] = ()
    """Token slices (``dynamic`` with slicing): per micro-batch, the previous slice of its sample or -1
    (:mod:`dynabatch.schedule.chains`); ``()`` without slices."""
    contexts: np.ndarray | None = None
    """(M,) tokens before each micro-batch (a slice's context length, 0 otherwise); ``None`` without slices."""
    candidate: str = ""
    """``dynamic``: which candidate plan was kept (:mod:`dynabatch.plan.candidates`: ``dp``, or a baseline's at a
    knob value such as ``packing_free=4``); ``""`` for a baseline."""
    replica_groups: tuple[tuple[RowGroup, ...], ...] = ()
    """Every replica's micro-batches (:attr:`groups` is replica 0's)."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.groups)

    @property
    def computed_tokens(self) -> int:
        return int((self.shapes[:, 0] * (self.shapes[:, 1] + self.shapes[:, 2])).sum())

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens


def method_micro_batches(
    method: str,
    batch: GlobalBatch,
    limits: LengthLimits,
    cost_model=None,
    num_stages: int = 1,
    options: BaselineOptions = BaselineOptions(),
    slice_cost_model=None,
    candidates: bool = True,
    price=None,
    num_replicas: int = 1,
    **planner_options,
) -> MethodPlan:
    """Apply ``method`` to ``batch`` through the one planning path (:class:`~dynabatch.plan.global_plan.GlobalPlanner`,
    the one ``train`` and the DataLoader use): ``dynamic`` (and ``dynamic_sliced``, which also needs
    ``slice_cost_model``) needs ``cost_model`` (a MicroBatchCostModel) and runs
    :func:`~dynabatch.plan.step.plan_step` (token slicing when ``slice_cost_model`` is given), then, with
    ``candidates``, keeps the DP's plan or a baseline's, whichever ``price(StepPlan)`` is lowest (default: the step
    formula under ``cost_model``, per segment); a baseline's micro-batches are dealt to ``num_replicas`` replicas
    as ``train`` deals them (``packing_free_split`` first cuts long samples into chunks, which its groups index).
    The returned plan describes replica 0 (:attr:`MethodPlan.replica_groups`: all)."""
    COMPARED_METHODS.check(method)
    family = limits.family
    check_method_family(method, family)
    if method == DYNAMIC_SLICED and slice_cost_model is None:
        raise ValueError(f"method {method!r} needs a slice cost model (slice_cost_model=)")
    if not is_planner(method):  # packing_free_split: long samples cut into chunks (the groups index them)
        batch = make_batcher(method, limits, GROUPING_TOKENS, **options.batcher_options(method, limits)).prepare(batch)
    planner = GlobalPlanner("dynamic" if is_planner(method) else method, limits, num_stages, num_replicas,
                            cost_model, options, planner_options=planner_options,
                            slice_cost_model=slice_cost_model,
                            candidates=candidates)
    start = time.perf_counter()
    chosen = planner.plan(batch, price=price)
    elapsed = time.perf_counter() - start
    step = chosen.plan
    replica_groups = tuple(tuple(chosen.row_groups(r)) for r in range(chosen.num_replicas))
    groups, pieces = replica_groups[0], step.replicas[0]
    shapes = np.array([p.shape for p in pieces], dtype=np.int64).reshape(-1, 3)
    if is_planner(method):
        times = np.array([p.time_s for p in pieces])
        pairs = micro_batch_pairs(batch, groups, family, [p.shape if p.is_slice else None for p in pieces])
        links = step.slice_links(0)
        return MethodPlan(method, groups, shapes, batch.num_tokens, elapsed, times, len(step.sliced_samples), pairs,
                          links, step.contexts(0) if links else None, chosen.candidate, replica_groups)
    # attention per segment, as the padding-free runtime computes it; a dense-mask baseline (packing) stays dense
    padding_free = attention_for(method, "segments") == "segments"
    pairs = micro_batch_pairs(batch, groups, family) if padding_free else None
    return MethodPlan(method, groups, shapes, batch.num_tokens, elapsed, pairs=pairs, replica_groups=replica_groups)


def micro_batch_pairs(batch: GlobalBatch, groups, family: str, slice_shapes=None) -> AttentionPairs:
    """(M,) attention pairs and calls of micro-batches given as row groups of ``batch``: per-sample blocks
    of every row (:func:`~dynabatch.cost.pairs.groups_pairs`, inputs + targets as one sequence for GPT).
    Entries of ``slice_shapes`` that are not None mark token slices, priced dense on their ``(1, s, 0)``."""

    pairs = groups_pairs([g.rows for g in groups], batch.input_lens, batch.target_lens, family)
    if not any(s is not None for s in slice_shapes or []):
        return pairs
    values = np.stack([pairs.encoder, pairs.decoder, pairs.cross], axis=1)  # (M, 3), a copy
    calls = np.stack(pairs.calls, axis=1)
    longest = np.stack(pairs.longest, axis=1)
    for k, sliced in enumerate(slice_shapes):
        if sliced is not None:
            b, e, d = (float(x) for x in sliced)
            values[k], calls[k], longest[k] = (b * e * e, b * d * d, b * d * e), 1.0, (e, d)
    return AttentionPairs(values[:, 0], values[:, 1], values[:, 2], (calls[:, 0], calls[:, 1], calls[:, 2]),
                          (longest[:, 0], longest[:, 1]))
