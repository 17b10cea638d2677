"""numba kernels for cost-table lookups (private: arrays in, numbers out, no validation).

The planner's DP kernels call these inside their own ``@njit`` loops; ``dynabatch.cost.tables`` wraps
them for Python callers and checks inputs. Slow pure-Python twins live in
``tests/reference/cost_reference.py``.

Interpolation, one axis at a time:
  1. along each length axis (D first, then E): log-log, ``log f`` linear in ``log x``, which is exact
     for power laws (attention ~ L^2, linear layers ~ L) and within ~1% for their sums; when either
     neighbour is <= 0 (e.g. a kind with no backward) the step is plain linear;
  2. along b: linear (costs are affine in the micro-batch size).
A weight of exactly 0 or 1 uses one neighbour only, so grid points are reproduced exactly even next
to a missing neighbour. Out of range: below the first grid value a query is clamped to it (an upper
bound, costs being non-decreasing in every axis); above the last value, at NaN queries, or when a
needed neighbour is missing (NaN: not profiled or out of memory) the result is ``+inf``, which
callers treat as infeasible.

Stage composition (``_stage_cost``): sums ``count x value`` over kinds for forward time, backward time
and stored bytes; peak bytes = stored + the largest per-kind transient (``peak - stored``), the memory
high-water mark when layers run one after another and each keeps only its saved tensors.
The stage kernels take *packed* tables (``pack_tables``): ``(num_kinds, 8, nb, nE)``, ``(num_kinds, 8,
nb, nD)`` and ``(num_kinds, 8, nb, nE, nD)`` holding FWD, BWD, STORED, PEAK and then their natural logs,
so a lookup costs two ``exp`` per metric instead of six transcendental calls.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

FWD, BWD, STORED, PEAK = 0, 1, 2, 3
INF = np.inf


@njit(cache=True, nogil=True)
def _locate(axis, x):
    """(i, x') with axis[i] <= x' <= axis[i + 1]; x below the axis is clamped; i = -1 if above or NaN."""
    n = axis.shape[0]
    if not x <= axis[n - 1]:
        return -1, x
    if x <= axis[0]:
        return 0, axis[0]
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if axis[mid] <= x:
            lo = mid
        else:
            hi = mid
    return lo, x


@njit(cache=True, nogil=True)
def _lerp(v0, v1, t):
    if t == 0.0:
        return v0
    if t == 1.0:
        return v1
    return v0 + t * (v1 - v0)


@njit(cache=True, nogil=True)
def _loglerp(v0, v1, t_log, t_lin):
    """Interpolate two neighbours along a length axis: log-log if both > 0, else linear."""
    if t_lin == 0.0:
        return v0
    if t_lin == 1.0:
        return v1
    if v0 > 0.0 and v1 > 0.0:
        return math.exp(math.log(v0) + t_log * (math.log(v1) - math.log(v0)))
    return v0 + t_lin * (v1 - v0)


@njit(cache=True, nogil=True)
def _weights(axis, i, x):
    """(t_log, t_lin) of x between axis[i] and axis[i + 1]."""
    x0, x1 = axis[i], axis[i + 1]
    if x == x0:
        return 0.0, 0.0
    if x == x1:
        return 1.0, 1.0
    return math.log(x / x0) / math.log(x1 / x0), (x - x0) / (x1 - x0)


@njit(cache=True, nogil=True)
def _interp2(axis_b, axis_l, table, b, l):
    """Interpolate ``table[nb, nl]`` at (b, l): log-log along l, linear along b; ``+inf`` if infeasible."""
    ib, b = _locate(axis_b, b)
    il, l = _locate(axis_l, l)
    if ib < 0 or il < 0:
        return INF
    tl, tn = _weights(axis_l, il, l)
    tb = (b - axis_b[ib]) / (axis_b[ib + 1] - axis_b[ib])
    v0 = _loglerp(table[ib, il], table[ib, il + 1], tl, tn) if tb != 1.0 else 0.0
    v1 = _loglerp(table[ib + 1, il], table[ib + 1, il + 1], tl, tn) if tb != 0.0 else 0.0
    v = _lerp(v0, v1, tb)
    return INF if math.isnan(v) else v


@njit(cache=True, nogil=True)
def _plane(plane, ie, id_, te_log, te_lin, td_log, td_lin):
    """Along D at E[ie] and E[ie + 1], then along E (log-log both)."""
    v0 = _loglerp(plane[ie, id_], plane[ie, id_ + 1], td_log, td_lin) if te_lin != 1.0 else 0.0
    v1 = _loglerp(plane[ie + 1, id_], plane[ie + 1, id_ + 1], td_log, td_lin) if te_lin != 0.0 else 0.0
    return _loglerp(v0, v1, te_log, te_lin)


@njit(cache=True, nogil=True)
def _interp3(axis_b, axis_e, axis_d, table, b, e, d):
    """Interpolate ``table[nb, nE, nD]`` at (b, e, d): log-log along d then e, linear along b."""
    ib, b = _locate(axis_b, b)
    ie, e = _locate(axis_e, e)
    id_, d = _locate(axis_d, d)
    if ib < 0 or ie < 0 or id_ < 0:
        return INF
    te_log, te_lin = _weights(axis_e, ie, e)
    td_log, td_lin = _weights(axis_d, id_, d)
    tb = (b - axis_b[ib]) / (axis_b[ib + 1] - axis_b[ib])
    v0 = _plane(table[ib], ie, id_, te_log, te_lin, td_log, td_lin) if tb != 1.0 else 0.0
    v1 = _plane(table[ib + 1], ie, id_, te_log, te_lin, td_log, td_lin) if tb != 0.0 else 0.0
    v = _lerp(v0, v1, tb)
    return INF if math.isnan(v) else v


@njit(cache=True, nogil=True)
def _cell(axis, x):
    """(i, t_log, t_lin) of x on a length axis; i = -1 when infeasible (above the axis or NaN)."""
    i, x = _locate(axis, x)
    if i < 0:
        return -1, 0.0, 0.0
    t_log, t_lin = _weights(axis, i, x)
    return i, t_log, t_lin


# The packed helpers index the stacked tables with full scalar indices: slicing out views would cost
# a reference-count increment and decrement per view, which was ~2/3 of a stage lookup.


@njit(cache=True, nogil=True)
def _row2(tab, k, m, r, i, t_log, t_lin):
    """Along the length axis in row (k, m, r) of a packed (K, 8, nb, nl) table."""
    v0 = tab[k, m, r, i]
    if t_lin == 0.0:
        return v0
    v1 = tab[k, m, r, i + 1]
    if t_lin == 1.0:
        return v1
    if v0 > 0.0 and v1 > 0.0:
        l0 = tab[k, m + 4, r, i]
        return math.exp(l0 + t_log * (tab[k, m + 4, r, i + 1] - l0))
    return v0 + t_lin * (v1 - v0)


@njit(cache=True, nogil=True)
def _metric2(tab, k, m, ib, tb, il, tl, tn):
    """Metric ``m`` of kind ``k`` of a packed (K, 8, nb, nl) table at a located (b, l)."""
    v0 = _row2(tab, k, m, ib, il, tl, tn) if tb != 1.0 else 0.0
    v1 = _row2(tab, k, m, ib + 1, il, tl, tn) if tb != 0.0 else 0.0
    return _lerp(v0, v1, tb)


@njit(cache=True, nogil=True)
def _row3(tab, k, m, r, ie, i, t_log, t_lin):
    """Along D in row (k, m, r, ie) of a packed (K, 8, nb, nE, nD) table."""
    v0 = tab[k, m, r, ie, i]
    if t_lin == 0.0:
        return v0
    v1 = tab[k, m, r, ie, i + 1]
    if t_lin == 1.0:
        return v1
    if v0 > 0.0 and v1 > 0.0:
        l0 = tab[k, m + 4, r, ie, i]
        return math.exp(l0 + t_log * (tab[k, m + 4, r, ie, i + 1] - l0))
    return v0 + t_lin * (v1 - v0)


@njit(cache=True, nogil=True)
def _plane3(tab, k, m, r, ie, te_log, te_lin, id_, td_log, td_lin):
    """(E, D) plane r of kind k: one ``exp`` of the bilinear log corners when all four are positive and
    both weights are strictly inside (0, 1), else along D then along E as in ``_plane``."""
    if 0.0 < te_lin < 1.0 and 0.0 < td_lin < 1.0:
        if (tab[k, m, r, ie, id_] > 0.0 and tab[k, m, r, ie, id_ + 1] > 0.0
                and tab[k, m, r, ie + 1, id_] > 0.0 and tab[k, m, r, ie + 1, id_ + 1] > 0.0):
            g = m + 4
            l0 = tab[k, g, r, ie, id_] + td_log * (tab[k, g, r, ie, id_ + 1] - tab[k, g, r, ie, id_])
            l1 = tab[k, g, r, ie + 1, id_] + td_log * (tab[k, g, r, ie + 1, id_ + 1] - tab[k, g, r, ie + 1, id_])
            return math.exp(l0 + te_log * (l1 - l0))
    v0 = _row3(tab, k, m, r, ie, id_, td_log, td_lin) if te_lin != 1.0 else 0.0
    v1 = _row3(tab, k, m, r, ie + 1, id_, td_log, td_lin) if te_lin != 0.0 else 0.0
    return _loglerp(v0, v1, te_log, te_lin)


@njit(cache=True, nogil=True)
def _metric3(tab, k, m, ib, tb, ie, te_log, te_lin, id_, td_log, td_lin):
    """Metric ``m`` of kind ``k`` of a packed (K, 8, nb, nE, nD) table at a located (b, e, d)."""
    v0 = _plane3(tab, k, m, ib, ie, te_log, te_lin, id_, td_log, td_lin) if tb != 1.0 else 0.0
    v1 = _plane3(tab, k, m, ib + 1, ie, te_log, te_lin, id_, td_log, td_lin) if tb != 0.0 else 0.0
    return _lerp(v0, v1, tb)


@njit(cache=True, nogil=True, inline="always")
def _add_kinds2(tab, cnt, ib, tb, il, tl, tn, fwd, bwd, stored, transient):
    """Add the kinds of a packed (K, 8, nb, nl) table with non-zero counts to a stage's running sums.

    Returns ``(ok, fwd, bwd, stored, transient)``; ``ok`` is False when such a kind needs a length that
    is off the axis (``il < 0``): the stage is infeasible.
    """
    for k in range(cnt.shape[0]):
        c = cnt[k]
        if c == 0.0:
            continue
        if il < 0:
            return False, fwd, bwd, stored, transient
        s = _metric2(tab, k, STORED, ib, tb, il, tl, tn)
        fwd += c * _metric2(tab, k, FWD, ib, tb, il, tl, tn)
        bwd += c * _metric2(tab, k, BWD, ib, tb, il, tl, tn)
        stored += c * s
        transient = max(transient, _metric2(tab, k, PEAK, ib, tb, il, tl, tn) - s)
    return True, fwd, bwd, stored, transient


@njit(cache=True, nogil=True)
def _stage_cost(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed, b, e, d):
    """(fwd_s, bwd_s, stored_bytes, peak_bytes) of a stage: kinds weighted by counts (see module doc).

    Tables are packed (``pack_tables``): ``tab_be`` (K, 8, nb, nE), ``tab_bd`` (K, 8, nb, nD),
    ``tab_bed`` (K, 8, nb, nE, nD); metric m in 0..3 (FWD, BWD, STORED, PEAK), its natural log in m + 4.
    Cells are located once per call; the numbers equal ``_interp2`` / ``_interp3`` on the plain tables.
    """
    ib, b = _locate(axis_b, b)
    ie, te_log, te_lin = _cell(axis_e, e)
    id_, td_log, td_lin = _cell(axis_d, d)
    if ib < 0:
        return INF, INF, INF, INF
    tb = (b - axis_b[ib]) / (axis_b[ib + 1] - axis_b[ib])
    ok, fwd, bwd, stored, transient = _add_kinds2(tab_be, cnt_be, ib, tb, ie, te_log, te_lin, 0.0, 0.0, 0.0, 0.0)
    if not ok:
        return INF, INF, INF, INF
    ok, fwd, bwd, stored, transient = _add_kinds2(tab_bd, cnt_bd, ib, tb, id_, td_log, td_lin,
                                                  fwd, bwd, stored, transient)
    if not ok:
        return INF, INF, INF, INF
    for k in range(cnt_bed.shape[0]):
        c = cnt_bed[k]
        if c == 0.0:
            continue
        if ie < 0 or id_ < 0:
            return INF, INF, INF, INF
        loc = (ib, tb, ie, te_log, te_lin, id_, td_log, td_lin)
        s = _metric3(tab_bed, k, STORED, *loc)
        fwd += c * _metric3(tab_bed, k, FWD, *loc)
        bwd += c * _metric3(tab_bed, k, BWD, *loc)
        stored += c * s
        transient = max(transient, _metric3(tab_bed, k, PEAK, *loc) - s)
    if not (math.isfinite(fwd) and math.isfinite(bwd) and math.isfinite(stored) and math.isfinite(transient)):
        return INF, INF, INF, INF
    return fwd, bwd, stored, stored + transient


def pack_tables(tables: np.ndarray) -> np.ndarray:
    """(K, 4, ...) metric tables -> (K, 8, ...) with natural logs appended (0 where not positive)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(tables > 0, np.log(np.where(tables > 0, tables, 1.0)), 0.0)
    return np.ascontiguousarray(np.concatenate([tables, logs], axis=1))


@njit(cache=True, nogil=True)
def _p2p_time(sizes, times, nbytes):
    """One-way send seconds for ``nbytes``: piecewise linear in bytes; below the first size the first
    time (latency floor); above the last size the last segment's slope continues (bandwidth-bound)."""
    n = sizes.shape[0]
    if not nbytes >= 0.0:
        return INF
    if nbytes <= sizes[0]:
        return times[0]
    i = n - 2
    if nbytes < sizes[n - 1]:
        i, nbytes = _locate(sizes, nbytes)
    slope = max(0.0, (times[i + 1] - times[i]) / (sizes[i + 1] - sizes[i]))
    return times[i] + slope * (nbytes - sizes[i])


@njit(cache=True, nogil=True)
def _evaluate_stages(axis_b, axis_e, axis_d, tab_be, cnts_be, tab_bd, cnts_bd, tab_bed, cnts_bed, b, e, d,
                     out_time, out_stored, out_transient):
    """Bottleneck over stages for each shape i: max of fwd + bwd, max of stored, max of peak - stored.

    ``cnts_*`` are (num_stages, num_kinds) count arrays; ``b, e, d`` float64 arrays of one length.
    Infeasible shapes get ``+inf`` in all three outputs.
    """
    num_stages = cnts_be.shape[0]
    for i in range(b.shape[0]):
        t = 0.0
        s = 0.0
        p = 0.0
        for st in range(num_stages):
            f, g, so, pk = _stage_cost(axis_b, axis_e, axis_d, tab_be, cnts_be[st], tab_bd, cnts_bd[st], tab_bed,
                                       cnts_bed[st], b[i], e[i], d[i])
            if math.isinf(f):
                t = INF
                s = INF
                p = INF
                break
            t = max(t, f + g)
            s = max(s, so)
            p = max(p, pk - so)
        out_time[i] = t
        out_stored[i] = s
        out_transient[i] = p


@njit(cache=True, nogil=True)
def _stage_cost_many(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed, b, e, d, out):
    """``_stage_cost`` for every shape i of the float64 arrays ``b, e, d``; writes ``out[:, i]`` (4, n)."""
    for i in range(b.shape[0]):
        f, g, s, p = _stage_cost(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed,
                                 b[i], e[i], d[i])
        out[FWD, i] = f
        out[BWD, i] = g
        out[STORED, i] = s
        out[PEAK, i] = p


@njit(cache=True, nogil=True)
def _greedy_groups(q, k, order, keep, waste_limit):
    """Group of each position of ``order`` (int64 sample indices into ``q``, ``k``): the greedy pass of
    :func:`dynabatch.cost.pairs.attention_groups` over samples already sorted. A sample opens a new group unless
    both lengths are at least ``keep`` of the open group's and padding it adds at most ``waste_limit`` pairs."""
    n = order.shape[0]
    labels = np.empty(n, np.int64)
    group = -1
    size = 0
    top_q = 0
    top_k = 0
    for p in range(n):
        j = order[p]
        qj = q[j]
        kj = k[j]
        if size > 0:
            grown_q = max(top_q, qj)  # the group's query length once j joins
            added = (size + 1) * grown_q * top_k - size * top_q * top_k - qj * kj
            if not (kj >= keep * top_k and qj >= keep * top_q and added <= waste_limit):
                size = 0
        if size == 0:
            group += 1
            top_q = qj
            top_k = kj
        labels[p] = group
        size += 1
        top_q = max(top_q, qj)
    return labels


@njit(cache=True, nogil=True)
def _count_groups(q, k, alone, keep):
    """``len(attention_groups(q, k, alone))`` without a padding bound: each of the two sets (``alone``, then the
    others) sorted longest key, longest query, highest index first (:func:`_sort_longest_first`) and counted by
    :func:`_greedy_groups`. One scratch array for both sets: a micro-batch costs two allocations, not a dozen."""
    total = 0
    order = np.empty(q.shape[0], dtype=np.int64)
    for flag in (True, False):
        size = 0
        for i in range(q.shape[0]):
            if alone[i] == flag:
                order[size] = i
                size += 1
        if size == 0:
            continue
        members = order[:size]
        _sort_longest_first(q, k, members)
        total += _greedy_groups(q, k, members, keep, np.inf)[-1] + 1
    return total


_INSERTION_SORT_MAX = 32
"""Up to this many samples :func:`_sort_longest_first` sorts by insertion (no allocation), beyond with numpy."""


@njit(cache=True, nogil=True)
def _sort_longest_first(q, k, members):
    """Sort ``members`` (increasing sample indices into ``q``, ``k``) in place: longest key span first, then longest
    query span, then highest index (a stable sort on ``k * span + q``, reversed)."""
    n = members.shape[0]
    if n > _INSERTION_SORT_MAX:
        span = q[members].max() + 1
        members[:] = members[np.argsort(k[members] * span + q[members], kind="mergesort")[::-1]]
        return
    for a in range(1, n):
        j = members[a]  # higher than every index before it: goes first among equal lengths
        b = a - 1
        while b >= 0 and (k[j] > k[members[b]] or (k[j] == k[members[b]] and q[j] >= q[members[b]])):
            members[b + 1] = members[b]
            b -= 1
        members[b + 1] = j


@njit(cache=True, nogil=True)
def _run_program(x, exponents, kinds, starts, cols, weights, outputs):
    """``(len(outputs), n)`` values of a max-plus program (:class:`dynabatch.cost.symbolic.Program`) at the
    ``(V, n)`` variables ``x``: monomial columns first, then each node a weighted sum or the maximum of earlier
    columns, every column computed over a tile of entries at once (tiles small enough for the columns to stay
    in cache). A sum adds its terms in order, ``((0 + w0 a) + w1 b) + ...``, up to four terms a pass over the
    tile (fewer passes, the same additions in the same order)."""
    n = x.shape[1]
    k_mono = exponents.shape[0]
    tile = 256
    vals = np.empty((k_mono + kinds.shape[0], tile))
    out = np.empty((outputs.shape[0], n))
    for lo_j in range(0, n, tile):
        m = min(tile, n - lo_j)
        for k in range(k_mono):
            for j in range(m):
                vals[k, j] = 1.0
            for v in range(exponents.shape[1]):
                for _ in range(exponents[k, v]):
                    for j in range(m):
                        vals[k, j] *= x[v, lo_j + j]
        for i in range(kinds.shape[0]):
            r = k_mono + i
            lo, hi = starts[i], starts[i + 1]
            if kinds[i] == 0:
                for j in range(m):
                    vals[r, j] = 0.0
                q = lo
                while q + 3 < hi:
                    c1, c2, c3, c4 = cols[q], cols[q + 1], cols[q + 2], cols[q + 3]
                    w1, w2, w3, w4 = weights[q], weights[q + 1], weights[q + 2], weights[q + 3]
                    for j in range(m):
                        vals[r, j] = (((vals[r, j] + w1 * vals[c1, j]) + w2 * vals[c2, j]) + w3 * vals[c3, j]) \
                            + w4 * vals[c4, j]
                    q += 4
                while q < hi:
                    c1, w1 = cols[q], weights[q]
                    for j in range(m):
                        vals[r, j] += w1 * vals[c1, j]
                    q += 1
            else:
                c0 = cols[lo]
                for j in range(m):
                    vals[r, j] = vals[c0, j]
                for q in range(lo + 1, hi):
                    c = cols[q]
                    for j in range(m):
                        if vals[c, j] > vals[r, j]:
                            vals[r, j] = vals[c, j]
        for o in range(outputs.shape[0]):
            c = outputs[o]
            for j in range(m):
                out[o, lo_j + j] = vals[c, j]
    return out


@njit(cache=True, nogil=True)
def _planner_view(fwd, bwd, stored, peak, send, load, entries, terms, has_terms, b, num_stages, single_alone, budget,
                  policy, t_out, stored_out, peak_out, fits_out):
    """:meth:`StageCostModel.evaluate <dynabatch.cost.stages.StageCostModel.evaluate>` of per-stage costs ``(S, n)``
    (mode ``none``), entry by entry: each stage in its recomputation mode (``policy`` 0 none, 1 auto, 2 selective,
    3 full; ``terms`` ``(6, S, n)``: the selective then full ``extra_s, freed_bytes, peak_bytes``; ``load`` ``(n,)``:
    the host-input bytes every stage loads), then reduced to
    the planner's bottleneck time, stored bytes (+ the largest stage's in-flight buffers) and peak. Under ``auto``
    an entry whose maxima fit ``in_flight`` times without recomputation keeps mode ``none``; the others (where
    ``has_terms``) take, stage by stage, the first mode that fits, else the one needing least; entries under
    ``auto`` that do not fit and have no terms are only flagged (``fits_out`` False) for a second pass with terms.
    Only the ``entries`` listed are computed; ``terms[:, :, q]`` belong to entry ``entries[q]``.
    With a policy the reduction keeps the tightest stage's stored and peak where the maxima do not fit ``S`` in
    flight (``StageCostModel.reduce``)."""
    S = fwd.shape[0]
    for q in range(entries.shape[0]):
        j = entries[q]
        buffers = 0.0
        for s in range(S):
            received = send[s - 1, j] if s > 0 else 0.0
            v = 2.0 * (received + send[s, j]) + load[j]
            if s == 0 or v > buffers:
                buffers = v
        in_flight = 1.0 if single_alone and b[j] == 1.0 else float(num_stages)
        top_stored = stored[0, j]
        top_peak = peak[0, j]
        for s in range(1, S):
            top_stored = max(top_stored, stored[s, j])
            top_peak = max(top_peak, peak[s, j])
        fits = in_flight * (top_stored + buffers) + top_peak <= budget
        fits_out[j] = fits
        t = 0.0
        best_stored = 0.0
        best_peak = 0.0
        tight = -1.0
        max_stored = 0.0
        max_peak = 0.0
        for s in range(S):
            mode = 0
            if policy == 2 or policy == 3:
                mode = policy - 1
            elif policy == 1 and not fits and has_terms:
                least = 0.0
                best = 0
                mode = -1
                for k in range(3):
                    st, pk = stored[s, j], peak[s, j]
                    if k > 0:
                        st = max(st - terms[3 * (k - 1) + 1, s, q], 0.0)
                        pk = pk + terms[3 * (k - 1) + 2, s, q]
                    need = in_flight * (st + buffers) + pk
                    if need <= budget:
                        mode = k
                        break
                    if k == 0 or need < least:
                        least = need
                        best = k
                if mode < 0:
                    mode = best
            f, bw, st, pk = fwd[s, j], bwd[s, j], stored[s, j], peak[s, j]
            if mode > 0:
                bw = bw + terms[3 * (mode - 1), s, q]
                st = max(st - terms[3 * (mode - 1) + 1, s, q], 0.0)
                pk = pk + terms[3 * (mode - 1) + 2, s, q]
            if s == 0 or f + bw > t:
                t = f + bw
            if s == 0 or st > max_stored:
                max_stored = st
            if s == 0 or pk > max_peak:
                max_peak = pk
            score = num_stages * st + pk
            if s == 0 or score > tight:
                tight, best_stored, best_peak = score, st, pk
        t_out[j] = t
        stored_out[j] = max_stored + buffers
        peak_out[j] = max_peak
        if policy != 0 and num_stages * stored_out[j] + max_peak > budget:
            stored_out[j] = best_stored + buffers
            peak_out[j] = best_peak


@njit(cache=True, nogil=True)
def _planner_view_plain(fwd, bwd, stored, peak, send, load, b, num_stages, single_alone, budget, policy, t_out,
                        stored_out, peak_out, fits_out):
    """:func:`_planner_view` of every entry with no stage recomputing (``policy`` 0, or 1 before any terms), stage
    by stage over all entries (contiguous rows, no per-entry branching on modes): the same values."""
    S, n = fwd.shape
    buffers = np.empty(n)
    tight = np.empty(n)
    best_stored = np.empty(n)
    best_peak = np.empty(n)
    for j in range(n):
        buffers[j] = 2.0 * (0.0 + send[0, j]) + load[j]
        t_out[j] = fwd[0, j] + bwd[0, j]
        stored_out[j] = stored[0, j]
        peak_out[j] = peak[0, j]
        tight[j] = num_stages * stored[0, j] + peak[0, j]
        best_stored[j] = stored[0, j]
        best_peak[j] = peak[0, j]
    for s in range(1, S):
        for j in range(n):
            v = 2.0 * (send[s - 1, j] + send[s, j]) + load[j]
            if v > buffers[j]:
                buffers[j] = v
            v = fwd[s, j] + bwd[s, j]
            if v > t_out[j]:
                t_out[j] = v
            st, pk = stored[s, j], peak[s, j]
            if st > stored_out[j]:
                stored_out[j] = st
            if pk > peak_out[j]:
                peak_out[j] = pk
            v = num_stages * st + pk
            if v > tight[j]:
                tight[j] = v
                best_stored[j] = st
                best_peak[j] = pk
    for j in range(n):
        in_flight = 1.0 if single_alone and b[j] == 1.0 else float(num_stages)
        fits_out[j] = in_flight * (stored_out[j] + buffers[j]) + peak_out[j] <= budget
        stored_out[j] += buffers[j]
        if policy != 0 and num_stages * stored_out[j] + peak_out[j] > budget:
            stored_out[j] = best_stored[j] + buffers[j]
            peak_out[j] = best_peak[j]
