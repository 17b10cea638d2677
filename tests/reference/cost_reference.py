"""Slow pure-Python twins of the cost kernels in :mod:`dynabatch.cost._kernels` and :mod:`dynabatch.cost._work_kernels`.

Written from the documented rules rather than copied: linear scans instead of binary search, nested
Python lists instead of arrays. Tests compare them with the kernels on random queries.
"""

from __future__ import annotations

import math

INF = math.inf


def locate(axis, x):
    """(i, x') with axis[i] <= x' <= axis[i+1]; below the axis x' = axis[0]; above / NaN -> (None, x)."""
    axis = [float(a) for a in axis]
    if math.isnan(x) or x > axis[-1]:
        return None, x
    if x <= axis[0]:
        return 0, axis[0]
    for i in range(len(axis) - 1):
        if axis[i] <= x < axis[i + 1]:
            return i, x
    return len(axis) - 2, x  # x == axis[-1]


def weights(axis, i, x):
    x0, x1 = float(axis[i]), float(axis[i + 1])
    if x == x0:
        return 0.0, 0.0
    if x == x1:
        return 1.0, 1.0
    return math.log(x / x0) / math.log(x1 / x0), (x - x0) / (x1 - x0)


def along_length(v0, v1, t_log, t_lin):
    if t_lin == 0.0:
        return v0
    if t_lin == 1.0:
        return v1
    if v0 > 0 and v1 > 0:
        return math.exp(math.log(v0) + t_log * (math.log(v1) - math.log(v0)))
    return v0 + t_lin * (v1 - v0)


def along_b(v0, v1, t):
    if t == 0.0:
        return v0
    if t == 1.0:
        return v1
    return v0 + t * (v1 - v0)


def _finish(v):
    return INF if math.isnan(v) else v


def interp2(axis_b, axis_l, table, b, l):
    ib, b = locate(axis_b, b)
    il, l = locate(axis_l, l)
    if ib is None or il is None:
        return INF
    tl, tn = weights(axis_l, il, l)
    tb = (b - axis_b[ib]) / (axis_b[ib + 1] - axis_b[ib])
    rows = []
    for r in (ib, ib + 1):
        rows.append(along_length(float(table[r][il]), float(table[r][il + 1]), tl, tn))
    v = rows[0] if tb == 0.0 else rows[1] if tb == 1.0 else along_b(rows[0], rows[1], tb)
    return _finish(v)


def interp3(axis_b, axis_e, axis_d, table, b, e, d):
    ib, b = locate(axis_b, b)
    ie, e = locate(axis_e, e)
    id_, d = locate(axis_d, d)
    if ib is None or ie is None or id_ is None:
        return INF
    te_log, te_lin = weights(axis_e, ie, e)
    td_log, td_lin = weights(axis_d, id_, d)
    tb = (b - axis_b[ib]) / (axis_b[ib + 1] - axis_b[ib])
    planes = []
    for r in (ib, ib + 1):
        plane = table[r]
        cols = [along_length(float(plane[c][id_]), float(plane[c][id_ + 1]), td_log, td_lin) for c in (ie, ie + 1)]
        cols = [cols[0] if te_lin == 0.0 else cols[1] if te_lin == 1.0 else
                along_length(cols[0], cols[1], te_log, te_lin)]
        planes.append(cols[0])
    v = planes[0] if tb == 0.0 else planes[1] if tb == 1.0 else along_b(planes[0], planes[1], tb)
    return _finish(v)


def stage_cost(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed, b, e, d):
    """(fwd, bwd, stored, stored + max transient) summed over kinds with non-zero counts."""
    totals = [0.0, 0.0, 0.0]
    transient = 0.0
    groups = [(tab_be, cnt_be, lambda t: interp2(axis_b, axis_e, t, b, e)),
              (tab_bd, cnt_bd, lambda t: interp2(axis_b, axis_d, t, b, d)),
              (tab_bed, cnt_bed, lambda t: interp3(axis_b, axis_e, axis_d, t, b, e, d))]
    for tables, counts, lookup in groups:
        for k in range(len(counts)):
            if counts[k] == 0:
                continue
            vals = [lookup(tables[k][m]) for m in range(4)]
            for m in range(3):
                totals[m] += counts[k] * vals[m]
            transient = max(transient, vals[3] - vals[2])
    if any(math.isinf(v) or math.isnan(v) for v in (*totals, transient)):
        return INF, INF, INF, INF
    return totals[0], totals[1], totals[2], totals[2] + transient


def p2p_time(sizes, times, nbytes):
    if math.isnan(nbytes) or nbytes < 0:
        return INF
    if nbytes <= sizes[0]:
        return float(times[0])
    i = len(sizes) - 2
    for k in range(len(sizes) - 1):
        if sizes[k] <= nbytes < sizes[k + 1]:
            i = k
            break
    slope = max(0.0, (times[i + 1] - times[i]) / (sizes[i + 1] - sizes[i]))
    return float(times[i] + slope * (nbytes - sizes[i]))


def attention_groups(query_lens, key_lens, alone, waste_limit=INF, tolerance=0.25):
    """The groups of :func:`dynabatch.cost.pairs.attention_groups` as sorted lists of indices, from its rule: the
    samples alone in their rows first, then the others; each set longest key then longest query first (ties:
    highest index first); a sample joins the open group while both its lengths are at least ``1 - tolerance``
    of the group's longest and padding it to the grown group adds at most ``waste_limit`` pairs."""
    q, k = [int(x) for x in query_lens], [int(x) for x in key_lens]
    groups = []
    for flag in (True, False):
        members_of = sorted((i for i in range(len(q)) if bool(alone[i]) == flag), key=lambda i: (k[i], q[i], i),
                            reverse=True)
        group, top_q, top_k = [], 0, 0
        for j in members_of:
            if group:
                waste = (len(group) + 1) * max(top_q, q[j]) * top_k - len(group) * top_q * top_k - q[j] * k[j]
                if k[j] < (1 - tolerance) * top_k or q[j] < (1 - tolerance) * top_q or waste > waste_limit:
                    groups.append(sorted(group))
                    group = []
            if not group:
                top_q, top_k = q[j], k[j]
            group.append(j)
            top_q = max(top_q, q[j])
        if group:
            groups.append(sorted(group))
    return groups


def micro_batch_work(e, d, ids, alone, starts, kinds=3, tolerance=0.25):
    """Twin of ``_work_kernels._micro_batch_work``, one micro-batch at a time (micro-batch ``m``: the samples
    ``ids[starts[m]:starts[m + 1]]``, ``alone`` per appearance): ``(pairs, calls, longest)`` as lists, the pairs
    ``sum e^2, sum d^2, sum d e``, the calls the groups of :func:`attention_groups` of the kinds ``(e, e)``,
    ``(d, d)``, ``(d, e)`` (the first ``kinds`` of them; one call for each other), the longest ``max e, max d``."""
    pairs, calls, longest = [], [], []
    for lo, hi in zip(starts[:-1], starts[1:]):
        me, md = [int(e[i]) for i in ids[lo:hi]], [int(d[i]) for i in ids[lo:hi]]
        flags = [bool(x) for x in alone[lo:hi]]
        pairs.append([sum(x * x for x in me), sum(y * y for y in md), sum(x * y for x, y in zip(me, md))])
        kind_lengths = [(me, me), (md, md), (md, me)][:kinds]  # (queries, keys) of each kind counted
        calls.append([len(attention_groups(q, k, flags, tolerance=tolerance)) for q, k in kind_lengths]
                     + [1] * (3 - kinds))
        longest.append([max(me), max(md)])
    return pairs, calls, longest
