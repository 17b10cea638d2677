"""Attention work of a micro-batch: the query-key score pairs its attention cores compute.

A dense micro-batch of ``b`` rows padded to ``(E, D)`` computes ``b E^2`` encoder (GPT: causal) self-attention
pairs, ``b D^2`` decoder self-attention pairs and ``b D E`` cross-attention pairs. The padding-free runtime
(``dynabatch.models.attention``: one SDPA call per group of equal-length segments, pad keys never computed)
computes each sample's own block only: a row holding samples ``k`` with lengths ``(e_k, d_k)`` costs
``sum e_k^2``, ``sum d_k^2`` and ``sum d_k e_k`` (GPT: ``sum (e_k + d_k)^2``, inputs and targets are one
sequence). A padded single-sample row is the one-segment case: its real length squared, not the row's.

Causal self-attention is counted as the full ``L x L`` square, as the analytic model prices causal attention
today (dense kernels compute the square; the flash kernel with ``is_causal`` skips about half of it, which
this count leaves on the safe side).

:class:`AttentionPairs` holds the three sums as float64 arrays of one shape (one entry per micro-batch); the
cost models take it as an optional ``pairs=`` argument and price dense ``b x Tq x Tk`` without it.
Optionally it also counts the attention-core *calls* per layer (``calls``): the runtime makes one SDPA
call per group of near-equal-length segments (:func:`attention_groups`), and on small shapes each call's
fixed cost matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.baselines import FlatGroups
from dynabatch.data.groups import lengths_of
from dynabatch.cost._kernels import _count_groups, _greedy_groups
from dynabatch.cost._work_kernels import _micro_batch_work


@dataclass(frozen=True)
class AttentionPairs:
    """Summed query-key pairs per attention kind, float64 arrays of one shape (one per micro-batch)."""

    encoder: np.ndarray
    """Encoder self-attention (T5) or the decoder-only model's causal self-attention (GPT): ``sum L^2``."""
    decoder: np.ndarray
    """T5 decoder self-attention: ``sum d^2`` (0 for GPT)."""
    cross: np.ndarray
    """T5 cross-attention: ``sum d e`` over samples (0 for GPT)."""
    calls: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """Attention-core calls per layer for each kind (encoder, decoder, cross): the runtime runs one SDPA
    call per group of samples with near-equal query and key lengths (:func:`attention_groups`,
    :func:`row_calls`); ``None``: one call each, as dense attention."""
    longest: tuple[np.ndarray, np.ndarray] | None = None
    """The longest input and target segment (GPT: sequence, and 0) of each micro-batch: the window of T5's
    relative-position bias, which the padding-free stages build for the longest segment, not the row
    (:func:`row_longest`); ``None``: the padded row lengths ``E, D``, as for one sample per row."""

    def __post_init__(self) -> None:
        names = ["encoder", "decoder", "cross"]
        extra = [("calls", self.calls), ("longest", self.longest)]
        values = [self.encoder, self.decoder, self.cross] + [x for _, v in extra if v is not None for x in v]
        arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in values))
        labels = names + [f"{name}[{k}]" for name, v in extra if v is not None for k in range(len(v))]
        for name, a in zip(labels, arrays):
            if a.size and not (np.all(np.isfinite(a)) and np.all(a >= 0)):
                raise ValueError(f"attention pairs ({name}) must be finite and >= 0, got min {a.min()}")
        for name, a in zip(names, arrays):
            object.__setattr__(self, name, a)
        rest = arrays[3:]
        for name, size, value in (("calls", 3, self.calls), ("longest", 2, self.longest)):
            if value is None:
                continue
            if len(value) != size:
                raise ValueError(f"{name} needs {size} arrays, got {len(value)}")
            object.__setattr__(self, name, tuple(rest[:size]))
            rest = rest[size:]

    @classmethod
    def of_sums(cls, encoder: np.ndarray, decoder: np.ndarray, cross: np.ndarray, calls=None,
                longest=None) -> "AttentionPairs":
        """Pairs from float64 arrays of one shape that are sums of checked pairs (the planner's prefix sums over
        runs of samples), kept as they are: not checked again. A difference of prefix sums of non-integer pairs
        may round a hair below zero, which the check would refuse and which prices the same."""
        out = object.__new__(cls)
        for name, value in (("encoder", encoder), ("decoder", decoder), ("cross", cross)):
            object.__setattr__(out, name, value)
        for name, value in (("calls", calls), ("longest", longest)):
            object.__setattr__(out, name, None if value is None else tuple(np.asarray(x, dtype=np.float64) for x in value))
        return out

    @classmethod
    def dense(cls, b, E, D=None) -> "AttentionPairs":  # noqa: N803 - shape names
        """The pairs dense attention computes on ``b`` rows padded to ``(E, D)`` (``D`` None or 0: GPT)."""
        b, E = np.asarray(b, dtype=np.float64), np.asarray(E, dtype=np.float64)
        D = np.zeros_like(E) if D is None else np.asarray(D, dtype=np.float64)
        return cls(b * E * E, b * D * D, b * D * E)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.encoder.shape

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "AttentionPairs":
        """The same function applied to each array (indexing, ravel, reshape, broadcast)."""
        calls = None if self.calls is None else tuple(fn(c) for c in self.calls)
        longest = None if self.longest is None else tuple(fn(x) for x in self.longest)
        return AttentionPairs(fn(self.encoder), fn(self.decoder), fn(self.cross), calls, longest)

    def bias_lengths(self, E, D):
        """``(encoder, decoder)`` window of T5's position bias: :attr:`longest`, else the row lengths."""
        return (E, D) if self.longest is None else self.longest

    def role(self, role: str) -> tuple[np.ndarray, np.ndarray | None]:
        """``(pairs, calls)`` of one attention kind: ``encoder``, ``decoder`` or ``cross``."""
        k = ("encoder", "decoder", "cross").index(role)
        return (self.encoder, self.decoder, self.cross)[k], (None if self.calls is None else self.calls[k])

    def __getitem__(self, index) -> "AttentionPairs":
        return self._derived(lambda a: a[index])

    def ravel(self) -> "AttentionPairs":
        """Every array flattened (1-D, in C order)."""
        return self._derived(np.ravel)

    def broadcast_to(self, shape) -> "AttentionPairs":
        if self.encoder.shape == tuple(shape):
            return self  # every array already has that shape (__post_init__ broadcast them to one)
        return self._derived(lambda a: np.broadcast_to(a, shape))

    def _derived(self, fn: Callable[[np.ndarray], np.ndarray]) -> "AttentionPairs":
        """:meth:`map` for a function that selects or repeats entries (indexing, broadcasting): the values were
        checked when this object was made, so they are not checked again (a cost model call makes several)."""
        out = object.__new__(AttentionPairs)
        for name in ("encoder", "decoder", "cross"):
            object.__setattr__(out, name, fn(getattr(self, name)))
        for name in ("calls", "longest"):
            value = getattr(self, name)
            object.__setattr__(out, name, None if value is None else tuple(fn(x) for x in value))
        return out


def row_pairs(rows: Iterable[Sequence[int]], input_lens, target_lens, family: str) -> tuple[float, float, float]:
    """``(encoder, decoder, cross)`` pairs of one micro-batch whose rows hold the samples ``rows`` (indices
    into the length arrays), as the padding-free runtime computes them (module docstring)."""
    ei, di, _ = _gathered(rows, input_lens, target_lens)
    return _pairs_of(ei, di, family)


def _gathered(rows, input_lens, target_lens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The input and target lengths (int64) of the samples of ``rows``, row after row, and whether each is alone in
    its row; ``ValueError`` for a micro-batch without samples."""
    e = np.asarray(input_lens, dtype=np.int64)
    d = np.asarray(target_lens, dtype=np.int64)
    rows = [r if isinstance(r, (tuple, list)) else list(r) for r in rows]
    ids = np.fromiter((i for r in rows for i in r), dtype=np.int64)
    if ids.size == 0:
        raise ValueError("a micro-batch needs at least one sample")
    alone = np.fromiter((len(r) == 1 for r in rows for _ in r), dtype=bool, count=ids.size)
    return e[ids], d[ids], alone


def _pairs_of(ei, di, family: str) -> tuple[float, float, float]:
    ei, di = ei.astype(np.float64), di.astype(np.float64)
    if not is_seq2seq(family):
        return float(((ei + di) ** 2).sum()), 0.0, 0.0
    return float((ei * ei).sum()), float((di * di).sum()), float((di * ei).sum())


def row_longest(rows: Iterable[Sequence[int]], input_lens, target_lens, family: str) -> tuple[int, int]:
    """``(input, target)`` length of the longest sample among ``rows`` (GPT: ``(inputs + targets, 0)``): the
    :attr:`AttentionPairs.longest` of one micro-batch."""
    ei, di, _ = _gathered(rows, input_lens, target_lens)
    return _longest_of(ei, di, family)


def _longest_of(ei, di, family: str) -> tuple[int, int]:
    if not is_seq2seq(family):
        return int((ei + di).max()), 0
    return int(ei.max()), int(di.max())


PAD_TOLERANCE = 0.25
"""Samples whose query and key lengths are within this fraction of a group's longest share one SDPA call,
padded to it under a key mask (pad pairs only, never another sample's keys): fewer, larger calls. Used by
the runtime (:mod:`dynabatch.models.attention`) and by :func:`row_calls`, so predicted calls are the
runtime's (but for a device's padding bound, below). Chosen by ``scripts/bench_attention.py`` (docs/algorithms/runtime.md, "Padding-free attention")."""

GROUP_WASTE_PAIRS: dict[str, float] = {"cpu": 2048.0}
"""Per device type: a sample joins a group only while padding it to the group's lengths adds at most this
many score pairs (with what a longer query adds to the members), about what one call's fixed cost buys.
Measured on this CPU, forward + backward of one ``(1, 4, L, 64)`` SDPA call is about 200 us + 60 ns per pair
with T5's bias as the mask (3,400 pairs a call) and 80 us + 49 ns per pair causal (1,600 pairs). So short
samples still share calls and long ones never pad to each other: T5 samples of 885 and 763 tokens in one
group cost 1.35x their two calls (the 25% tolerance alone let them share), and a T5 stage ran 11-25% slower
on a flat row holding both than on the two apart. Not measured on GPUs, where a call costs far more pairs:
device types not listed keep the 25% rule alone (:func:`group_waste_limit`).

The cost side counts calls without this bound (:func:`row_calls`): the calls it adds are those of long
samples, whose attention costs tens of calls each, and the simulated GPUs do not have it."""


def group_waste_limit(device_type: str) -> float:
    """:data:`GROUP_WASTE_PAIRS` of a device type (``"cpu"``, ``"cuda"``); unbounded where not measured."""
    return GROUP_WASTE_PAIRS.get(device_type, math.inf)


def attention_groups(query_lens, key_lens, alone, waste_limit: float = math.inf) -> list[tuple[np.ndarray, bool]]:
    """The samples that share one attention-core call, as ``(indices, alone)`` pairs.

    Greedy, longest key span first (then longest query span): a sample joins the open group while both its
    lengths are at least ``1 - PAD_TOLERANCE`` of the group's (0: equal lengths only; 1: one group) and
    padding it adds at most ``waste_limit`` pairs to the group (the runtime's :func:`group_waste_limit`).
    Samples alone in their rows (``alone``: the runtime slices their rows instead of gathering) and samples
    sharing a row are grouped apart. Lengths are integers (int64); the greedy pass is a numba kernel
    (``_kernels._greedy_groups``; its pure-Python twin is ``tests/reference/cost_reference.py``).
    """
    q = np.asarray(query_lens, dtype=np.int64)
    k = np.asarray(key_lens, dtype=np.int64)
    alone = np.asarray(alone, dtype=bool)
    groups: list[tuple[np.ndarray, bool]] = []
    for flag in (True, False):
        order, labels = _sorted_groups(q, k, np.flatnonzero(alone == flag), waste_limit)
        if order.size:
            cuts = np.flatnonzero(np.diff(labels)) + 1
            groups.extend((members, flag) for members in np.split(order, cuts))
    return groups


def _sorted_groups(q: np.ndarray, k: np.ndarray, candidates: np.ndarray, waste_limit: float):
    """``(order, labels)``: ``candidates`` longest key span first (then longest query span, then highest index),
    and the group of each (non-decreasing labels from 0; :func:`attention_groups`)."""
    order = candidates[np.lexsort((q[candidates], k[candidates]))[::-1]]
    return order, _greedy_groups(q, k, order, 1.0 - PAD_TOLERANCE, float(waste_limit))


def _num_groups(q: np.ndarray, k: np.ndarray, alone: np.ndarray) -> int:
    """``len(attention_groups(q, k, alone))`` (int64 lengths, no padding bound), without building the groups."""
    return int(_count_groups(q, k, alone, 1.0 - PAD_TOLERANCE))


def row_calls(rows: Iterable[Sequence[int]], input_lens, target_lens, family: str) -> tuple[int, int, int]:
    """``(encoder, decoder, cross)`` attention-core calls per layer of one micro-batch, as the runtime groups
    its samples (:func:`attention_groups`, without a device's padding bound; GPT: inputs + targets as one
    sequence)."""
    ei, di, alone = _gathered(rows, input_lens, target_lens)
    return _calls_of(ei, di, alone, family)


def _calls_of(ei, di, alone, family: str) -> tuple[int, int, int]:
    if not is_seq2seq(family):
        n = ei + di
        return _num_groups(n, n, alone), 1, 1
    return _num_groups(ei, ei, alone), _num_groups(di, di, alone), _num_groups(di, ei, alone)


RowWork = tuple[Sequence[float], Sequence[float], Sequence[float]]
"""One micro-batch's ``(pairs, calls, longest)``: :func:`row_pairs`, :func:`row_calls`, :func:`row_longest`."""


def row_work(rows: Iterable[Sequence[int]], input_lens, target_lens, family: str) -> RowWork:
    """The :data:`RowWork` of one micro-batch given as rows of sample indices (the samples gathered once)."""
    ei, di, alone = _gathered(rows, input_lens, target_lens)
    return _pairs_of(ei, di, family), _calls_of(ei, di, alone, family), _longest_of(ei, di, family)


def rows_work(groups: Sequence[Sequence[Sequence[int]]], input_lens, target_lens, family: str) -> list[RowWork]:
    """:func:`row_work` of each of ``groups`` (micro-batches as rows of sample indices), the same values
    (:func:`flat_work`'s, as tuples of Python numbers)."""
    if not groups:
        return []
    pairs, calls, longest = flat_work(FlatGroups.of(groups), input_lens, target_lens, family)
    return list(zip(map(tuple, pairs.tolist()), map(tuple, calls.tolist()), map(tuple, longest.tolist())))


def flat_work(groups: FlatGroups, input_lens, target_lens, family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The :data:`RowWork` of every micro-batch of ``groups`` as arrays: (M, 3) float64 pairs, (M, 3) int64 calls and
    (M, 2) int64 longest segments, each row what :func:`row_work` gives that micro-batch. One numba pass for all
    (``_work_kernels._micro_batch_work``): the pairs summed in integers (which the float64 sums hold exactly), the
    longest segments, and the calls of every micro-batch counted from one longest-first order of the samples per
    attention kind. ``ValueError`` for a micro-batch without samples."""
    num = len(groups)
    if not num:
        return np.zeros((0, 3)), np.zeros((0, 3), dtype=np.int64), np.zeros((0, 2), dtype=np.int64)
    row_sizes = groups.row_bounds[1:] - groups.row_bounds[:-1]
    starts = groups.row_bounds[groups.group_bounds]  # where each micro-batch's samples start, then the end
    if (groups.group_bounds[1:] == groups.group_bounds[:-1]).any() or (starts[1:] == starts[:-1]).any():
        raise ValueError("a micro-batch needs at least one sample")
    t5 = is_seq2seq(family)
    e, d = lengths_of(input_lens, target_lens, t5)  # a decoder-only model: one sequence, no targets
    pairs, calls = np.empty((num, 3), dtype=np.int64), np.empty((num, 3), dtype=np.int64)
    longest = np.empty((num, 2), dtype=np.int64)
    _micro_batch_work(e, d, groups.ids, np.repeat(row_sizes == 1, row_sizes), starts, 1.0 - PAD_TOLERANCE,
                      3 if t5 else 1, pairs, calls, longest)
    return pairs.astype(np.float64), calls, longest


def flat_pairs(groups: FlatGroups, input_lens, target_lens, family: str) -> AttentionPairs:
    """(M,) :class:`AttentionPairs` (with calls and longest segments) of the micro-batches of ``groups``: what
    :func:`stacked_pairs` makes of their :func:`rows_work`."""
    return work_pairs(*flat_work(groups, input_lens, target_lens, family))


def fill_work(work: dict, groups, input_lens, target_lens, family: str) -> None:
    """Add to ``work`` (a dict: rows of sample indices -> their :func:`row_work`) the micro-batches of ``groups``
    it lacks, all in one :func:`rows_work` pass."""
    missing = list(dict.fromkeys(rows for rows in groups if rows not in work))
    work.update(zip(missing, rows_work(missing, input_lens, target_lens, family)))


def stacked_pairs(work: Sequence[RowWork]) -> AttentionPairs:
    """(M,) :class:`AttentionPairs` (with calls and longest segments) of M micro-batches' :data:`RowWork`."""
    return work_pairs(*(np.array([w[k] for w in work], dtype=np.float64).reshape(-1, n)
                        for k, n in enumerate((3, 3, 2))))


def work_pairs(values, calls, longest) -> AttentionPairs:
    """(M,) :class:`AttentionPairs` of M micro-batches' work as arrays: (M, 3) pairs, (M, 3) calls, (M, 2) longest
    segments (:func:`flat_work`). Each of the three arrays is checked finite and >= 0 as a whole, the check
    :class:`AttentionPairs` makes column by column, and its columns are then taken as they are
    (:meth:`AttentionPairs.of_sums`)."""
    values, calls, longest = (np.asarray(a, dtype=np.float64) for a in (values, calls, longest))
    for name, a in (("pairs", values), ("calls", calls), ("longest", longest)):
        if a.size and not (np.isfinite(a).all() and (a >= 0).all()):
            raise ValueError(f"attention {name} must be finite and >= 0, got min {a.min()}")
    return AttentionPairs.of_sums(values[:, 0], values[:, 1], values[:, 2], (calls[:, 0], calls[:, 1], calls[:, 2]),
                                  (longest[:, 0], longest[:, 1]))


def groups_pairs(groups: Iterable[Sequence[Sequence[int]]], input_lens, target_lens, family: str) -> AttentionPairs:
    """(M,) :class:`AttentionPairs` (with calls) of micro-batches given as rows of sample indices
    (``RowGroup.rows``)."""
    return flat_pairs(FlatGroups.of(groups), input_lens, target_lens, family)


def sample_pairs(input_lens, target_lens, family: str) -> np.ndarray:
    """(N, 3) pairs of each sample alone (``encoder, decoder, cross``): the per-unit table that prefix sums
    turn into the pairs of any run of samples."""
    e = np.asarray(input_lens, dtype=np.float64)
    d = np.asarray(target_lens, dtype=np.float64)
    if not is_seq2seq(family):
        zero = np.zeros_like(e)
        return np.stack([(e + d) ** 2, zero, zero], axis=1)
    return np.stack([e * e, d * d, d * e], axis=1)
