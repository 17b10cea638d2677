"""numba kernel of :func:`dynabatch.cost.pairs.flat_work`: the attention work of many micro-batches in one pass
(private: arrays in, arrays out, no validation; ``pairs.py`` checks the groups).

The attention-core calls follow the rule of ``_kernels._greedy_groups`` without a padding bound, as
``_kernels._count_groups`` counts them for one micro-batch: within a micro-batch, the samples alone in their rows and
the others apart, each set visited longest key first (then longest query), a sample joins the open group while both
its lengths are at least ``keep`` of the group's (its first sample's key, its longest query so far), else it opens
the next group. The count depends only on the order of the lengths, not on how ties are broken (tied samples have the
same lengths), so one order of the batch's samples serves every micro-batch: :func:`_count_calls` visits the samples
once per attention kind, longest first, and each appearance of a sample updates the open group of its micro-batch.
That is ``O(N log N + P)`` for ``N`` samples appearing ``P`` times in all micro-batches, where counting micro-batch
by micro-batch sorts each one: the baseline candidates price a global batch's samples in some twenty groupings at
once, each sample in one micro-batch of each (:mod:`dynabatch.plan.candidates`).

Plain twin: ``micro_batch_work`` in ``tests/reference/cost_reference.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _micro_batch_work(e, d, ids, alone, starts, keep, kinds, pairs, calls, longest):
    """Fill ``pairs`` (M, 3), ``calls`` (M, 3) and ``longest`` (M, 2) (int64) of M micro-batches, micro-batch ``m``
    holding the samples ``ids[starts[m]:starts[m + 1]]`` (indices into the int64 lengths ``e``, ``d``; ``alone[p]``:
    appearance ``p`` is alone in its row; every micro-batch holds a sample): ``sum e^2, sum d^2, sum d e``; the calls
    of the encoder (``e, e``), decoder (``d, d``) and cross kind (queries ``d``, keys ``e``) at fraction ``keep``
    (``kinds`` 1: only the first kind is counted, the other two are one call each, as a decoder-only model's); and
    ``max e, max d``."""
    _sums(e, d, ids, starts, pairs, longest)
    slots, first = _appearances(ids, alone, starts, e.shape[0])
    num = starts.shape[0] - 1
    _count_calls(e, e, slots, first, keep, num, calls[:, 0])
    if kinds == 3:
        _count_calls(d, d, slots, first, keep, num, calls[:, 1])
        _count_calls(d, e, slots, first, keep, num, calls[:, 2])
    else:
        calls[:, 1] = 1
        calls[:, 2] = 1


@njit(cache=True, nogil=True)
def _sums(e, d, ids, starts, pairs, longest):
    """Each micro-batch's summed pairs and longest lengths (:func:`_micro_batch_work`)."""
    for m in range(starts.shape[0] - 1):
        enc = dec = cross = 0
        head = ids[starts[m]]
        top_e, top_d = e[head], d[head]
        for p in range(starts[m], starts[m + 1]):
            i = ids[p]
            enc += e[i] * e[i]
            dec += d[i] * d[i]
            cross += d[i] * e[i]
            top_e = max(top_e, e[i])
            top_d = max(top_d, d[i])
        pairs[m, 0], pairs[m, 1], pairs[m, 2] = enc, dec, cross
        longest[m, 0], longest[m, 1] = top_e, top_d


@njit(cache=True, nogil=True)
def _appearances(ids, alone, starts, num_samples):
    """The appearances of the samples grouped by sample (a counting sort): sample ``i``'s are ``first[i]`` up to
    ``first[i + 1]``, each given as its slot ``2 m + alone``, the set of micro-batch ``m`` it is grouped in."""
    first = np.zeros(num_samples + 1, dtype=np.int64)
    for p in range(ids.shape[0]):
        first[ids[p] + 1] += 1
    for i in range(num_samples):
        first[i + 1] += first[i]
    filled = first[:-1].copy()
    slots = np.empty(ids.shape[0], dtype=np.int64)
    for m in range(starts.shape[0] - 1):
        for p in range(starts[m], starts[m + 1]):
            i = ids[p]
            slots[filled[i]] = 2 * m + (1 if alone[p] else 0)
            filled[i] += 1
    return slots, first


@njit(cache=True, nogil=True)
def _count_calls(q, k, slots, first, keep, num, out):
    """``out[m]``: the attention-core calls of micro-batch ``m`` for query lengths ``q`` and key lengths ``k`` (module
    docstring): the samples visited longest key first, then longest query (a stable sort on ``k * span + q``,
    reversed), each appearance joining its slot's open group or opening the next one. ``need_k``, ``need_q``: the
    least key and query length that still joins a slot's open group, ``keep`` times its first key and its longest
    query (``keep * max`` is ``max`` of ``keep *``: rounding is monotone, so the comparisons are the rule's)."""
    order = np.argsort(k * (q.max() + 1) + q, kind="mergesort")[::-1]
    count = np.zeros(2 * num, dtype=np.int64)
    need_k = np.empty(2 * num)
    need_q = np.empty(2 * num)
    for i in order:
        for j in range(first[i], first[i + 1]):
            x = slots[j]
            if count[x] > 0 and k[i] >= need_k[x] and q[i] >= need_q[x]:
                need_q[x] = max(need_q[x], keep * q[i])
            else:
                count[x] += 1
                need_k[x] = keep * k[i]
                need_q[x] = keep * q[i]
    for m in range(num):
        out[m] = count[2 * m] + count[2 * m + 1]
