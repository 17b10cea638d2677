"""The batching methods users pick today, each cutting a global batch into micro-batches.

Every batcher first *groups* sample indices into rows and micro-batches using lengths only
(:meth:`Batcher.flat_group`: flat arrays, :class:`FlatGroups`; :meth:`Batcher.group`: the same as
:class:`RowGroup` s; cheap and tensor-free, used for statistics and by later planners), then
collates the groups into model-ready tensors (:meth:`Batcher.__call__`).

- ``padding``: fixed samples per micro-batch in stream order, padded to the micro-batch max.
- ``length_grouped``: like HF ``group_by_length``: sort the global batch by length, then chunk.
- ``token_budget``: like fairseq ``max_tokens``: sorted, each micro-batch holds as many samples as
  fit ``max_tokens`` *padded* tokens.
- ``packing``: the DynaPipe paper's packing baseline: fixed-length rows filled best-fit-decreasing,
  several samples per row with positions restarting and a dense block-diagonal mask confining
  attention to each sample; every row is computed at the full row length. GPT: one row length for
  inputs + targets. T5 (seqio-style): inputs pack into encoder rows and targets into decoder rows
  of the same row, a sample fits a row only if both fit.
- ``packing_free``: what TRL users run today (``SFTConfig(packing=True, packing_strategy="bfd",
  padding_free=True)``): the same best-fit-decreasing rows, but not padded to the row length
  (a micro-batch is padded only to its longest row; padding-free attention kernels skip the rest)
  and attention never crosses a sample (per-segment / varlen attention).
- ``packing_free_split``: TRL's ``packing_strategy="bfd_split"`` (decoder-only): rows of a tuned length,
  a sample longer than a row split into row-length chunks, each chunk its own sequence (positions restart,
  no attention to the chunks before it). It CHANGES THE OBJECTIVE: later chunks train without their
  context, so its loss is not comparable with the whole-sample methods' (tables say so).

:data:`BASELINES` holds each method's batcher and knob, keyed by the names that
:data:`dynabatch.core.methods.BASELINE_METHODS` registers: every command's method list, its knob flags
(``--packing-rows``, ...) and the ``--tune-baselines`` grids are derived from them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

from dynabatch.core.methods import (BASELINE_METHODS, LENGTH_GROUPED, PACKING, PACKING_FREE, PACKING_FREE_SPLIT,
                                    PADDING, TOKEN_BUDGET, check_method_family)
from dynabatch.data.batching import LengthLimits
from dynabatch.data.groups import FlatGroups, RowGroup, bounds, data_kernels, lengths_of
from dynabatch.data.sample import GlobalBatch
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.core.sequence import is_seq2seq

if TYPE_CHECKING:  # torch-free at import: dynabatch.training.config imports the registry (`train --help` stays fast)
    from dynabatch.data.microbatch import MicroBatch


@dataclass(frozen=True)
class BatchStats:
    """Token accounting of one batching of a global batch."""

    num_micro_batches: int
    real_tokens: int
    computed_tokens: int
    """Tokens the model computes on, padding included."""

    @property
    def efficiency(self) -> float:
        """Padding efficiency: real / computed tokens."""
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


@dataclass(frozen=True)
class Batcher:
    """Base class: subclasses implement :meth:`flat_group`."""

    limits: LengthLimits
    tokens: TokenizerInfo
    loss_on_inputs: bool = False
    """Decoder-only: also take loss on input tokens."""

    @property
    def family(self) -> str:
        return self.limits.family

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        """The micro-batches of ``batch`` as row groups (:meth:`flat_group`'s, one :class:`RowGroup` each)."""
        return self.flat_group(batch).row_groups()

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        """The micro-batches of ``batch`` as flat arrays of sample indices (lengths only)."""
        raise NotImplementedError

    def prepare(self, batch: GlobalBatch) -> GlobalBatch:
        """The global batch this batcher groups: ``batch`` itself, except for a batcher that changes the samples
        (``packing_free_split`` cuts long ones into chunks). :meth:`group` indices refer to it; callers that
        group a batch of real samples call this first (it is idempotent)."""
        return batch

    def __call__(self, batch: GlobalBatch) -> list[MicroBatch]:
        batch = self.prepare(batch)
        return [self.collate(batch, g) for g in self.group(batch)]

    def collate(self, batch: GlobalBatch, g: RowGroup) -> MicroBatch:
        from dynabatch.data.collate import collate_rows  # lazy: keeps torch out of `dynabatch --help`

        return collate_rows(batch.samples, g.rows, self.family, self.tokens, g.encoder_len, g.decoder_len,
                            self.loss_on_inputs)

    def stats(self, batch: GlobalBatch) -> BatchStats:
        """Real and computed tokens of this batching, from lengths alone."""
        batch = self.prepare(batch)
        shapes = self.flat_group(batch).shapes(batch.input_lens, batch.target_lens, self.family)
        computed = int((shapes[:, 0] * (shapes[:, 1] + shapes[:, 2])).sum())
        return BatchStats(num_micro_batches=len(shapes), real_tokens=batch.num_tokens, computed_tokens=computed)

    def _sort_key(self, batch: GlobalBatch):
        """Longest first: by total length (GPT) or by (input, target) length (T5); ties by index."""
        if is_seq2seq(self.family):
            return lambda i: (-batch.input_lens[i], -batch.target_lens[i], i)
        return lambda i: (-(batch.input_lens[i] + batch.target_lens[i]), i)

    def _longest_first(self, batch: GlobalBatch) -> np.ndarray:
        """The sample indices sorted by :meth:`_sort_key` (int64, one stable numpy sort, the same order), kept in the
        batch's :func:`memo` when it has one (the candidates' batchers of one global batch share it)."""
        return memo(batch, ("longest_first", is_seq2seq(self.family)), lambda: _longest_first(batch, self.family))


def memo(batch, key, compute: Callable):
    """``compute()``, kept in ``batch.memo`` (a dict) under ``key`` when the batch carries one: what the batchers
    derive from a batch's lengths alone (its longest-first order, its packed rows), computed once for the several
    batchers and knob values that group one global batch (:mod:`dynabatch.plan.candidates`). Callers do not
    mutate what it returns."""
    cache = getattr(batch, "memo", None)
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def longest_first(batch, family: str) -> list[int]:
    """Sample indices longest first, as :meth:`Batcher._sort_key` orders them: by total length (GPT) or by
    (input, target) length (T5), ties by index (a stable sort on the negated lengths)."""
    return _longest_first(batch, family).tolist()


def _longest_first(batch, family: str) -> np.ndarray:
    """:func:`longest_first` as an int64 array."""
    e, d = np.asarray(batch.input_lens, dtype=np.int64), np.asarray(batch.target_lens, dtype=np.int64)
    index = np.arange(e.size)
    keys = (index, -d, -e) if is_seq2seq(family) else (index, -(e + d))
    return np.lexsort(keys)


def group_shapes(batch, groups, family: str) -> list[tuple[int, int, int]]:
    """:func:`group_shape` of each of ``groups`` (:meth:`FlatGroups.shapes`, each group's own fixed lengths)."""
    shapes = FlatGroups.of(g.rows for g in groups).shapes(batch.input_lens, batch.target_lens, family).tolist()
    t5 = is_seq2seq(family)
    return [(b, int(g.encoder_len or e), int(g.decoder_len or d) if t5 else 0) for g, (b, e, d) in zip(groups, shapes)]


def group_shape(batch: GlobalBatch, g: RowGroup, family: str) -> tuple[int, int, int]:
    """Computed shape ``(rows, E, D)`` of a row group (GPT: ``E`` = row length, ``D`` = 0)."""
    e, d = batch.input_lens, batch.target_lens
    if is_seq2seq(family):
        enc = g.encoder_len or max(int(sum(e[i] for i in r)) for r in g.rows)
        dec = g.decoder_len or max(int(sum(d[i] for i in r)) for r in g.rows)
        return len(g.rows), int(enc), int(dec)
    seq = g.encoder_len or max(int(sum(e[i] + d[i] for i in r)) for r in g.rows)
    return len(g.rows), int(seq), 0


def _chunks(indices, size: int) -> FlatGroups:
    """The samples ``indices`` one per row, ``size`` rows a micro-batch, in order."""
    return FlatGroups.chunked_rows(indices, np.arange(len(indices) + 1, dtype=np.int64), size)


@dataclass(frozen=True)
class Padding(Batcher):
    samples_per_micro_batch: int = 8

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        return _chunks(np.arange(len(batch), dtype=np.int64), self.samples_per_micro_batch)


@dataclass(frozen=True)
class LengthGrouped(Batcher):
    samples_per_micro_batch: int = 8

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        return _chunks(self._longest_first(batch), self.samples_per_micro_batch)


@dataclass(frozen=True)
class TokenBudget(Batcher):
    max_tokens: int = 8192
    """Padded tokens per micro-batch (rows x padded length)."""

    def __post_init__(self) -> None:
        if self.max_tokens < self.limits.max_tokens:
            raise ValueError(
                f"token_budget max_tokens={self.max_tokens} cannot hold one maximal sample "
                f"({self.limits.max_tokens} tokens); raise it"
            )

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        """Longest first, each micro-batch as many samples as fit ``max_tokens`` padded tokens (GPT: one sequence of
        inputs and targets; the greedy pass: ``_kernels._budget_groups``), one sample per row."""
        order = self._longest_first(batch)
        if not order.size:
            return FlatGroups.single_rows(order, [0])
        e, d = lengths_of(batch.input_lens, batch.target_lens, is_seq2seq(self.family))
        group_of = data_kernels()._budget_groups(e, d, order, self.max_tokens)  # non-decreasing from 0, no gaps
        return FlatGroups.single_rows(order, bounds(np.bincount(group_of)))


def pack_rows(batch: GlobalBatch, limits: LengthLimits, key) -> list[list[int]]:
    """Rows of sample indices filled best-fit-decreasing (samples in ``key`` order, longest first).

    A row holds ``limits.max_seq_len`` tokens (GPT: inputs + targets) or, for T5, ``max_input_len``
    encoder and ``max_target_len`` decoder tokens; each sample goes to the open row it leaves the least
    room in (the relative room left on both sides, for T5), the first such row on ties, or opens a row.
    Samples are within the limits already (the global batcher truncates, drops or rejects over-long
    ones, as TRL's ``bfd`` truncates); one that is not is a ``ValueError`` naming it.
    """
    ids, bounds = (a.tolist() for a in _packed_rows(batch, limits, sorted(range(len(batch)), key=key)))
    return [ids[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def _packed_rows(batch: GlobalBatch, limits: LengthLimits, order) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_rows` with the samples visited in ``order`` (the best-fit pass: ``_kernels._best_fit_rows``), as
    flat rows: the sample indices row after row, each row's in visiting order, and where each row starts (then the
    end), rows in opening order."""
    t5 = is_seq2seq(limits.family)
    cap_e = limits.max_input_len if t5 else limits.max_seq_len
    cap_d = limits.max_target_len if t5 else 0
    e, d = lengths_of(batch.input_lens, batch.target_lens, t5)
    visit = np.asarray(order, dtype=np.int64)
    over = (e[visit] > cap_e) | (d[visit] > cap_d)
    if over.any():
        i = int(visit[np.argmax(over)])
        raise ValueError(f"sample {i} (input_len={batch.input_lens[i]}, target_len={batch.target_lens[i]}) "
                         f"does not fit a packed row ({limits.describe()}); truncate it to the limits first")
    row_of = data_kernels()._best_fit_rows(e, d, visit, cap_e, cap_d)[visit]  # cap_d 0 (GPT): one length
    ids = visit[np.argsort(row_of, kind="stable")]  # by row, each row's samples in visiting order
    return ids, bounds(np.bincount(row_of, minlength=int(row_of.max(initial=-1)) + 1))


@dataclass(frozen=True)
class Packing(Batcher):
    """The DynaPipe paper's packing baseline: best-fit-decreasing rows (:func:`pack_rows`), every row
    computed at the full row length (a dense block-diagonal mask keeps samples apart)."""

    rows_per_micro_batch: int = 4
    fixed_row_length: ClassVar[bool] = True
    """Rows are padded to the row length (``packing``), or only to the micro-batch's longest row."""

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        """The packed rows (:meth:`_row_limits`, kept in the batch's :func:`memo`), ``rows_per_micro_batch`` a
        micro-batch in the order they were opened."""
        limits = self._row_limits()
        ids, bounds = memo(batch, ("packed_rows", limits), lambda: _packed_rows(batch, limits, self._longest_first(batch)))
        enc = dec = None
        if self.fixed_row_length:
            t5 = is_seq2seq(self.family)
            enc = self.limits.max_input_len if t5 else self.limits.max_seq_len
            dec = self.limits.max_target_len if t5 else None
        return FlatGroups.chunked_rows(ids, bounds, self.rows_per_micro_batch, enc, dec)

    def _row_limits(self) -> LengthLimits:
        """The limits a packed row holds (:func:`pack_rows`): the run's."""
        return self.limits


@dataclass(frozen=True)
class PackingFree(Packing):
    """TRL's default packing, ``packing_strategy="bfd"`` with ``padding_free=True``.

    The rows of :class:`Packing` (best-fit-decreasing up to the row length: TRL's ``max_length``;
    GPT one row for inputs + targets, T5 inputs into encoder and targets into decoder rows, a sample
    fits only where both fit), positions restarting per sample and no attention across samples
    (``DataCollatorWithFlattening`` + FlashAttention varlen in TRL, per-segment attention here). A
    micro-batch is padded only to its longest row: padding-free kernels skip the pad.

    Knob: ``rows_per_micro_batch``, because that is what TRL users tune: with ``padding_free`` a
    device's micro-batch is ``per_device_train_batch_size`` packed rows of up to ``max_length`` tokens
    flattened into one sequence, and ``max_length`` is the length limit (here the row length), fixed
    by the data rather than tuned for speed. Rows follow their creation order, longest samples'
    rows first (TRL shuffles the packed rows; with rows this full it changes little padding).
    """

    fixed_row_length: ClassVar[bool] = False


@dataclass(frozen=True)
class PackingFreeSplit(PackingFree):
    """TRL's ``packing_strategy="bfd_split"`` with ``padding_free=True`` (decoder-only models).

    Rows of ``row_tokens`` tokens (TRL's ``max_length``, here the knob), one row per micro-batch (with
    ``padding_free`` a device's ``per_device_train_batch_size`` rows are flattened into one sequence, so a
    row of ``B x max_length`` tokens is the same micro-batch). A sample longer than a row is split into
    row-length chunks (:func:`split_long_samples`), each its own sequence: positions restart and a chunk does
    not attend to the chunks before it. This CHANGES THE OBJECTIVE (later chunks are trained without their
    context; its loss is not comparable with a whole-sample method's); it is reported beside the
    whole-sample baselines, never as one of them. :meth:`prepare` cuts the batch; :meth:`group` then packs
    the chunks best-fit-decreasing like ``packing_free``.
    """

    row_tokens: int = 4096
    """Tokens per row (= per micro-batch): the split length."""
    rows_per_micro_batch: int = 1

    def __post_init__(self) -> None:
        check_method_family(PACKING_FREE_SPLIT, self.family)
        if self.row_tokens < 2:
            raise ValueError(f"packing_free_split row_tokens must be >= 2, got {self.row_tokens}")

    def prepare(self, batch: GlobalBatch) -> GlobalBatch:
        return split_long_samples(batch, self.row_tokens)

    def flat_group(self, batch: GlobalBatch) -> FlatGroups:
        longest = int((batch.input_lens + batch.target_lens).max()) if len(batch) else 0
        if longest > self.row_tokens:
            raise ValueError(f"packing_free_split: a sample of {longest} tokens is longer than a row "
                             f"({self.row_tokens}); split the batch first (Batcher.prepare)")
        return super().flat_group(batch)

    def _row_limits(self) -> LengthLimits:
        """Rows of :attr:`row_tokens` tokens."""
        return replace(self.limits, max_seq_len=self.row_tokens)


def split_long_samples(batch: GlobalBatch, length: int) -> GlobalBatch:
    """``batch`` with every decoder-only sample longer than ``length`` tokens (inputs + targets) cut into
    consecutive chunks of ``length`` tokens (the last one shorter), each chunk a sample of its own: its tokens
    that were inputs stay inputs and those that were targets stay targets (a chunk inside the inputs has no
    target tokens). Token counts are unchanged; samples that fit stay as they are, in place; a batch with
    nothing to cut is returned as is."""
    if not len(batch) or int((batch.input_lens + batch.target_lens).max()) <= length:
        return batch
    samples = []
    for s in batch.samples:
        n = s.num_tokens
        if n <= length:
            samples.append(s)
            continue
        e = s.input_len
        for lo in range(0, n, length):
            hi = min(lo + length, n)
            samples.append(replace(s, input_ids=s.input_ids[min(lo, e):min(hi, e)],
                                   target_ids=s.target_ids[max(lo - e, 0):max(hi - e, 0)]))
    return replace(batch, samples=tuple(samples))


@dataclass(frozen=True)
class BaselineSpec:
    """One baseline method: its batcher and the micro-batch size knob a user tunes."""

    name: str
    batcher: type[Batcher]
    knob: str
    """The batcher field that sizes its micro-batches (``rows_per_micro_batch``, ...)."""
    option: str
    """The :class:`BaselineOptions` / ``TrainConfig`` field (and flag) that sets ``knob``; baselines
    with the same knob share it."""
    grid: tuple[int, ...]
    """Values ``--tune-baselines`` tries."""
    help: str
    """What the knob is, for flag help texts."""
    at_least_one_sample: bool = False
    """The value is raised to one maximal sample's tokens (``token_budget``)."""
    dense_attention: bool = False
    """Runs (and is priced) with dense 4-D block-diagonal masks whatever ``--attention`` says: ``packing``, the
    DynaPipe paper's baseline; ``packing_free`` is its padding-free counterpart."""
    plan_candidate: bool = True
    """The dynamic method also prices this baseline's plans of each global batch and runs one where it is
    predicted faster (:mod:`dynabatch.plan.candidates`). Not ``padding`` (stream order: the sorted chunks of
    ``length_grouped`` at the same sizes are the candidates) nor the dense-mask ``packing``."""

    def batcher_fields(self, value: int, limits: LengthLimits) -> dict:
        """The fields :func:`make_batcher` takes for this baseline at knob value ``value`` (raised to one maximal
        sample's tokens where :attr:`at_least_one_sample`)."""
        return {self.knob: max(value, limits.max_tokens) if self.at_least_one_sample else value}


_SIZES = (1, 2, 4, 8, 16, 32)
_ROWS = (1, 2, 4, 8, 16)
_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SPLIT_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)

BASELINES: dict[str, BaselineSpec] = {s.name: s for s in (
    BaselineSpec(PADDING, Padding, "samples_per_micro_batch", "samples_per_micro_batch", _SIZES,
                 "samples per micro-batch", plan_candidate=False),
    BaselineSpec(LENGTH_GROUPED, LengthGrouped, "samples_per_micro_batch", "samples_per_micro_batch", _SIZES,
                 "samples per micro-batch"),
    BaselineSpec(TOKEN_BUDGET, TokenBudget, "max_tokens", "token_budget_tokens", _TOKENS,
                 "padded tokens per micro-batch", at_least_one_sample=True),
    BaselineSpec(PACKING, Packing, "rows_per_micro_batch", "packing_rows", _ROWS,
                 "rows per micro-batch (dense rows of the max length, DynaPipe's baseline)", dense_attention=True,
                 plan_candidate=False),
    BaselineSpec(PACKING_FREE, PackingFree, "rows_per_micro_batch", "packing_free_rows", _ROWS,
                 "rows per micro-batch (TRL's per_device_train_batch_size with padding_free)"),
    BaselineSpec(PACKING_FREE_SPLIT, PackingFreeSplit, "row_tokens", "packing_free_split_tokens", _SPLIT_TOKENS,
                 "tokens per row and micro-batch; longer samples are split into chunks of this length (TRL bfd_split "
                 "max_length; changes the objective; decoder-only)", plan_candidate=False),
)}
"""Every baseline's batcher and knob, by its name in :data:`dynabatch.core.methods.BASELINE_METHODS` (which
registers the names and their order)."""
assert tuple(BASELINES) == BASELINE_METHODS, "every registered baseline name needs its batcher here, in order"

BATCHERS: dict[str, type[Batcher]] = {name: spec.batcher for name, spec in BASELINES.items()}


def baseline_spec(name: str) -> BaselineSpec:
    if name not in BASELINES:
        raise ValueError(f"unknown batching method {name!r}; valid: {', '.join(BASELINE_METHODS)}")
    return BASELINES[name]


def attention_for(method: str, requested: str) -> str:
    """The attention path a run of ``method`` uses: ``dense`` for a dense-mask baseline, else ``requested``."""
    spec = BASELINES.get(method)
    return "dense" if spec is not None and spec.dense_attention else requested


def option_help(option: str) -> str:
    """The flag help of a :class:`BaselineOptions` field: the baselines it sizes and what their knob is."""
    names = option_users()[option]
    return f"{' / '.join(names)} baseline: {BASELINES[names[0]].help}"


def option_users() -> dict[str, list[str]]:
    """Each :class:`BaselineOptions` field and the baselines it sizes (``packing_rows -> [packing]``)."""
    out: dict[str, list[str]] = {}
    for spec in BASELINES.values():
        out.setdefault(spec.option, []).append(spec.name)
    return out


@dataclass(frozen=True)
class BaselineOptions:
    """Micro-batch sizes of the baselines (what a user would tune); one field per
    :attr:`BaselineSpec.option` of :data:`BASELINES`."""

    samples_per_micro_batch: int = 8
    """``padding`` and ``length_grouped``."""
    token_budget_tokens: int = 2048
    """``token_budget``: padded tokens per micro-batch (raised to one maximal sample if smaller)."""
    packing_rows: int = 4
    """``packing``: rows per micro-batch."""
    packing_free_rows: int = 4
    """``packing_free``: rows per micro-batch."""
    packing_free_split_tokens: int = 4096
    """``packing_free_split``: tokens per row (one row per micro-batch); longer samples are split at this length."""

    @classmethod
    def of(cls, source) -> "BaselineOptions":
        """The options held by ``source``'s attributes of the same names (a ``TrainConfig``, parsed flags)."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls) if getattr(source, f.name, None) is not None})

    def value(self, name: str) -> int:
        """The knob value of baseline ``name``."""
        return getattr(self, baseline_spec(name).option)

    def with_value(self, name: str, value: int) -> "BaselineOptions":
        """These options with baseline ``name``'s knob set to ``value`` (shared knobs change for all their users)."""
        return replace(self, **{baseline_spec(name).option: value})

    def batcher_options(self, name: str, limits: LengthLimits) -> dict:
        """The fields :func:`make_batcher` takes for baseline ``name``."""
        return baseline_spec(name).batcher_fields(self.value(name), limits)


SET_BY_CALLER = ("limits", "tokens", "loss_on_inputs")
"""Batcher fields every caller sets itself (the DataLoader from its own arguments): not options of a baseline."""


def option_names(name: str) -> list[str]:
    """The option names baseline ``name`` takes: its batcher's fields (``rows_per_micro_batch``) and its knob's
    ``TrainConfig`` / flag name (``packing_free_rows``)."""
    spec = baseline_spec(name)
    own = [f.name for f in fields(spec.batcher) if f.init and f.name not in SET_BY_CALLER]
    return own + ([spec.option] if spec.option not in own else [])


def batcher_options_given(name: str, options: Mapping[str, Any], limits: LengthLimits) -> dict:
    """The batcher fields of baseline ``name`` from ``options`` named either way (:func:`option_names`; the
    ``TrainConfig`` name's value is taken as ``train`` takes it, e.g. a token budget raised to one maximal sample).
    One ``ValueError`` line for a name the baseline does not take, or for its knob given under both names."""
    spec, valid = baseline_spec(name), option_names(name)
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ValueError(f"method_options {', '.join(map(repr, unknown))} not taken by baseline {name!r}; valid: "
                         f"{', '.join(valid)}")
    if spec.option == spec.knob:  # one name (samples_per_micro_batch): the batcher's own field
        return dict(options)
    if spec.option in options and spec.knob in options:
        raise ValueError(f"method_options give baseline {name!r}'s micro-batch size twice ({spec.knob!r} and "
                         f"{spec.option!r}); keep one")
    out = {k: v for k, v in options.items() if k != spec.option}
    if spec.option in options:
        out.update(spec.batcher_fields(options[spec.option], limits))
    return out


def make_batcher(name: str, limits: LengthLimits, tokens: TokenizerInfo, **options) -> Batcher:
    """A baseline batcher by name; ``options`` are its fields (e.g. ``samples_per_micro_batch``)."""
    return baseline_spec(name).batcher(limits=limits, tokens=tokens, **options)


def grid_settings(name: str, batches, limits: LengthLimits, options: BaselineOptions = BaselineOptions()
                  ) -> list[tuple[int, int | None]]:
    """``(value, same_as)`` for every value of baseline ``name``'s grid and its value in ``options`` (the
    default), in increasing order. ``same_as`` names the value (the default first, else a smaller one)
    whose micro-batches on ``batches`` are identical, nothing to measure again; else it is ``None``.
    Token budgets below one maximal sample count as one."""
    default = options.value(name)
    seen: dict[tuple, int] = {}
    out: list[tuple[int, int | None]] = []
    for value in [default, *sorted(set(baseline_spec(name).grid) - {default})]:
        opts = options.with_value(name, value)
        batcher = make_batcher(name, limits, GROUPING_TOKENS, **opts.batcher_options(name, limits))
        key = tuple(tuple(batcher.group(batcher.prepare(b))) for b in batches)
        out.append((value, seen.get(key)))
        seen.setdefault(key, value)
    return sorted(out)


@dataclass(frozen=True)
class Trial:
    """One setting of a baseline's knob tried by ``--tune-baselines``."""

    value: int
    tokens_per_s: float | None = None
    """Real tokens per second (simulated or measured); ``None`` when the setting was not run."""
    feasible: bool = True
    """Fits the memory limit."""
    note: str = ""
    """Why it was not run or not counted (does not fit memory, same micro-batches as another value)."""
    same_as: int | None = None
    """The value with the same micro-batches (then not run again: same speed, same memory)."""

    def to_dict(self) -> dict:
        return {"value": self.value, "tokens_per_s": self.tokens_per_s, "feasible": self.feasible, "note": self.note}


def with_twins(trials: dict[int, Trial], same_as: dict[int, int]) -> tuple[Trial, ...]:
    """``trials`` of the values that ran (or were refused) plus one for each value with the same
    micro-batches as another (``same_as``), marked feasible as its twin is; in increasing order."""
    out = dict(trials)
    for value, twin in same_as.items():
        out[value] = Trial(value, feasible=trials[twin].feasible, note=f"same micro-batches as {twin}", same_as=twin)
    return tuple(out[v] for v in sorted(out))


def best_trial(trials) -> Trial | None:
    """The fastest feasible trial (the smallest value on ties); ``None`` when none is feasible."""
    ran = [t for t in trials if t.feasible and t.tokens_per_s is not None]
    return max(ran, key=lambda t: (t.tokens_per_s, -t.value)) if ran else None


GROUPING_TOKENS = TokenizerInfo(pad_id=0, eos_id=1, decoder_start_id=0, vocab_size=1)
"""Token ids for grouping by lengths only (no collation)."""
