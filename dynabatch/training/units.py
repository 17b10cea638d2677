"""Units: what the step planner hands on to be collated, and what it makes of them without collating.

A :class:`Unit` is one micro-batch's rows of a global batch (a :class:`~dynabatch.data.baselines.RowGroup`), or,
with ``bounds``, one sample's chain of token slices (TeraPipe). The planner prices and lowers a step from the
units' shapes alone (:func:`units_layout`, :func:`units_pairs`); the tensors are collated only where they are
used (:func:`micro_batches_of` with :func:`collate_group`), on each rank from its own copy of the data.
:func:`synthetic_units` makes the start-up calibration's micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.cost.pairs import row_work, stacked_pairs
from dynabatch.data.baselines import RowGroup, group_shape
from dynabatch.data.batching import LengthLimits
from dynabatch.data.collate import collate_rows
from dynabatch.data.microbatch import MicroBatch, token_slices
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.schedule.chains import links_for
from dynabatch.sequence import is_seq2seq


@dataclass(frozen=True)
class Unit:
    """Rows to collate as one micro-batch, or, with ``bounds``, as a chain of token slices."""

    group: RowGroup
    bounds: tuple[int, ...] | None = None
    """Token slice boundaries ``0 < ... < length`` of a sliced sample (TeraPipe)."""


def synthetic_units(limits: LengthLimits, tokens: TokenizerInfo, global_batch_tokens: int, num_lengths: int = 5,
                    seed: int = 0) -> tuple[GlobalBatch, list[Unit]]:
    """Synthetic samples and micro-batches spanning a run's shapes, for the start-up calibration: for
    ``num_lengths`` lengths from short to the limit (geometric; T5: encoder and decoder lengths paired
    short-long and long-short too), one single-sample micro-batch and one of about
    ``global_batch_tokens / 8`` tokens (at most 64 rows). Random token ids; a quarter of a GPT sequence is
    target."""

    rng = np.random.default_rng(seed)
    seq2seq = is_seq2seq(limits.family)
    top_e = limits.max_input_len if seq2seq else limits.max_seq_len
    enc = np.unique(np.geomspace(min(32, top_e), top_e, num_lengths).astype(int))
    dec = np.unique(np.geomspace(min(8, limits.max_target_len), limits.max_target_len, len(enc)).astype(int))
    dec = np.resize(dec, len(enc))
    pairs = [(int(e), int(d)) for e, d in zip(enc, dec)]
    if seq2seq:
        pairs += [(int(e), int(d)) for e, d in zip(enc[::2], dec[::-2])]
    samples, units = [], []
    per_mb = max(1, global_batch_tokens // 8)
    for e, d in pairs:
        for b in sorted({1, int(min(64, max(1, per_mb // (e + (d if seq2seq else 0)))))}):
            rows = []
            for _ in range(b):
                n_in, n_out = (e, d) if seq2seq else (e - max(1, e // 4), max(1, e // 4))
                ids = rng.integers(3, tokens.vocab_size, size=n_in + n_out).astype(np.int32)
                samples.append(TokenizedSample("calibration", ids[:n_in], ids[n_in:]))
                rows.append((len(samples) - 1,))
            units.append(Unit(RowGroup(tuple(rows))))
    return GlobalBatch(-1, tuple(samples)), units


def units_pairs(batch: GlobalBatch, units: list[Unit], family: str):
    """(M,) :class:`~dynabatch.cost.pairs.AttentionPairs` of the micro-batches :func:`micro_batches_of` makes
    of ``units``: each sample's own block of every row, one attention call per distinct length; a token
    slice of ``s`` tokens is priced ``s^2`` in one call (its context is the slice cost model's)."""

    work = []
    for u in units:
        if u.bounds:
            work += [((float(hi - lo) ** 2, 0.0, 0.0), (1, 1, 1), (hi - lo, 0))
                     for lo, hi in zip(u.bounds[:-1], u.bounds[1:])]
        else:
            work.append(row_work(u.group.rows, batch.input_lens, batch.target_lens, family))
    return stacked_pairs(work)


def collate_group(batch: GlobalBatch, g: RowGroup, family: str, tokens: TokenizerInfo) -> MicroBatch:
    """One row group of ``batch`` collated as the planner lays it out (no loss on inputs)."""
    return collate_rows(batch.samples, g.rows, family, tokens, g.encoder_len, g.decoder_len)


def units_layout(batch: GlobalBatch, units, family: str) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...], list[int]]:
    """What :func:`micro_batches_of` makes of ``units``, from the lengths alone (nothing collated): each micro-batch's
    padded ``(b, E, D)`` (:func:`~dynabatch.data.baselines.group_shape`; a token slice ``(b, hi - lo, 0)``), the
    token-slice links (``()`` without slices) and each one's context length."""
    shapes: list[tuple[int, int, int]] = []
    for u in units:
        if u.bounds:
            b = len(u.group.rows)
            shapes += [(b, int(hi - lo), 0) for lo, hi in zip(u.bounds[:-1], u.bounds[1:])]
        else:
            shapes.append(tuple(int(x) for x in group_shape(batch, u.group, family)))
    links = links_for([len(u.bounds) - 1 if u.bounds else 1 for u in units]) if any(u.bounds for u in units) else ()
    contexts = [c for u in units for c in (u.bounds[:-1] if u.bounds else (0,))]
    return tuple(shapes), links, contexts


def micro_batches_of(units: list[Unit], collate) -> tuple[list[MicroBatch], tuple[int, ...], list[int]]:
    """Collate units (``collate(RowGroup) -> MicroBatch``): the micro-batches in order, their token-slice
    links (``()`` without slices) and each one's context length (0 unless a later slice)."""
    pieces = []
    for u in units:
        mb = collate(u.group)
        pieces.append(token_slices(mb, u.bounds) if u.bounds else [mb])
    links = links_for([len(ps) for ps in pieces]) if any(u.bounds for u in units) else ()
    contexts = [c for u in units for c in (u.bounds[:-1] if u.bounds else (0,))]
    return [mb for ps in pieces for mb in ps], links, contexts


def plan_units(plan, replica: int) -> list[Unit]:
    """A replica's planned pieces as units: the slices of one sample become one unit, collated whole
    (one row of its full length) and cut at the slices' token ranges."""
    pieces, groups = plan.replicas[replica], plan.to_row_groups(replica)
    links = plan.slice_links(replica) or (-1,) * len(pieces)
    out: list[Unit] = []
    for piece, group, prev in zip(pieces, groups, links):
        if prev >= 0:
            out[-1] = Unit(out[-1].group, (*out[-1].bounds, piece.token_range[1]))
        elif piece.is_slice:
            out.append(Unit(RowGroup(group.rows), (0, piece.token_range[1])))
        else:
            out.append(Unit(group))
    return out
