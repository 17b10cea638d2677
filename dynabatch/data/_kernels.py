"""numba kernels of the baseline batchers' greedy passes and of the flat groups' passes (:mod:`dynabatch.data.groups`:
shapes, concatenation): arrays in, arrays out, no validation (``baselines.py`` validates and builds the row groups).

Every kernel has a slow pure-Python twin in ``tests/reference/batching_reference.py``; tests compare them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _best_fit_rows(e, d, order, cap_e, cap_d):
    """Best-fit-decreasing rows (the packing batchers' :func:`~dynabatch.data.baselines.pack_rows` and the planner's
    row packing, :mod:`dynabatch.plan.rowpack`): visit samples in ``order`` (largest first), put each into the open row
    whose normalised room left ``(free_e - e) / cap_e + (free_d - d) / cap_d`` is smallest among the rows
    where both lengths fit (the first such row on ties), else open a row. A sample over a cap opens a row
    that nothing else joins. ``cap_d = 0``: one length (decoder-only). Returns (N,) int64 row of each
    sample, rows numbered in opening order."""
    n = e.shape[0]
    row = np.empty(n, dtype=np.int64)
    free_e = np.empty(n, dtype=np.int64)
    free_d = np.empty(n, dtype=np.int64)
    num_rows = 0
    for k in range(n):
        i = order[k]
        best = -1
        best_left = np.inf
        for r in range(num_rows):
            if e[i] <= free_e[r] and d[i] <= free_d[r]:
                left = (free_e[r] - e[i]) / cap_e
                if cap_d > 0:
                    left += (free_d[r] - d[i]) / cap_d
                if left < best_left:
                    best, best_left = r, left
        if best < 0:
            best = num_rows
            num_rows += 1
            free_e[best] = max(cap_e - e[i], -1)
            free_d[best] = max(cap_d - d[i], -1)
            if e[i] > cap_e or d[i] > cap_d:
                free_e[best] = -1
        else:
            free_e[best] -= e[i]
            free_d[best] -= d[i]
        row[i] = best
    return row


@njit(cache=True)
def _budget_groups(e, d, order, max_tokens):
    """``token_budget``'s micro-batches: the samples visited in ``order`` (lengths ``e``, ``d``) go into the open
    micro-batch while ``(samples + 1) x (longest e + longest d)`` padded tokens stay within ``max_tokens``, else
    start the next one. Returns (N,) int64: the micro-batch of the ``k``-th visited sample (non-decreasing from 0)."""
    n = order.shape[0]
    group_of = np.empty(n, dtype=np.int64)
    group = -1
    size = 0
    max_e = 0
    max_d = 0
    for k in range(n):
        i = order[k]
        new_e = max(max_e, e[i])
        new_d = max(max_d, d[i])
        if size == 0 or (size + 1) * (new_e + new_d) > max_tokens:
            group += 1
            size = 0
            new_e = e[i]
            new_d = d[i]
        group_of[k] = group
        size += 1
        max_e = new_e
        max_d = new_d
    return group_of


@njit(cache=True)
def _longest_rows(e, d, ids, row_bounds, group_bounds):
    """Each micro-batch's longest row (:meth:`~dynabatch.data.groups.FlatGroups.shapes`): micro-batch ``m`` holds
    the rows ``group_bounds[m]`` up to ``group_bounds[m + 1]``, row ``r`` the samples ``ids[row_bounds[r]:row_bounds[r +
    1]]``. Returns (G, 2) int64: the largest summed ``e`` over a micro-batch's rows and the largest summed ``d``
    (each maximised on its own; every micro-batch holds a row)."""
    num = group_bounds.shape[0] - 1
    out = np.empty((num, 2), dtype=np.int64)
    for m in range(num):
        first = group_bounds[m]
        for r in range(first, group_bounds[m + 1]):
            sum_e = 0
            sum_d = 0
            for p in range(row_bounds[r], row_bounds[r + 1]):
                sum_e += e[ids[p]]
                sum_d += d[ids[p]]
            if r == first or sum_e > out[m, 0]:
                out[m, 0] = sum_e
            if r == first or sum_d > out[m, 1]:
                out[m, 1] = sum_d
    return out


@njit(cache=True)
def _joined_bounds(laid, sizes):
    """:func:`~dynabatch.data.groups.joined_bounds` of parts whose bounds (each from 0 to its total) are laid side by
    side in ``laid``, part ``p`` taking ``sizes[p]`` entries: one array from 0 to the sum of the totals, each part's
    bounds after its first shifted by the totals of the parts before it."""
    out = np.empty(laid.shape[0] - sizes.shape[0] + 1, dtype=np.int64)
    out[0] = 0
    k = 1
    start = 0
    shift = 0
    for p in range(sizes.shape[0]):
        end = start + sizes[p]
        for j in range(start + 1, end):
            out[k] = laid[j] + shift
            k += 1
        shift += laid[end - 1]
        start = end
    return out
