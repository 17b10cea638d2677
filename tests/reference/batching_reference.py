"""Slow pure-Python twins of the batchers' kernels in :mod:`dynabatch.data._kernels`.

Written from the documented rules with Python lists; tests compare them with the kernels on random lengths.
"""

from __future__ import annotations


def best_fit_rows(e, d, order, cap_e, cap_d):
    """Twin of ``_best_fit_rows``: best-fit-decreasing rows (see the kernel's docstring)."""
    row = [0] * len(e)
    free: list[list[int]] = []  # [free_e, free_d] per open row; -1 closes a row
    for i in order:
        i = int(i)
        best, best_left = -1, float("inf")
        for r, (fe, fd) in enumerate(free):
            if e[i] <= fe and d[i] <= fd:
                left = (fe - e[i]) / cap_e + ((fd - d[i]) / cap_d if cap_d > 0 else 0.0)
                if left < best_left:
                    best, best_left = r, left
        if best < 0:
            over = e[i] > cap_e or d[i] > cap_d
            free.append([-1 if over else cap_e - int(e[i]), max(cap_d - int(d[i]), -1)])
            best = len(free) - 1
        else:
            free[best][0] -= int(e[i])
            free[best][1] -= int(d[i])
        row[i] = best
    return row


def budget_groups(e, d, order, max_tokens):
    """The micro-batch of each visited sample: a new one when one more sample would pad past ``max_tokens``."""
    out, members = [], []
    for i in order:
        grown = members + [i]
        if members and len(grown) * (max(e[j] for j in grown) + max(d[j] for j in grown)) > max_tokens:
            members = [i]
            out.append(out[-1] + 1)
        else:
            members = grown
            out.append(out[-1] if out else 0)
    return out


def longest_first(e, d, t5):
    """Sample indices longest first: by (input, target) length (T5) or total length (GPT), ties by index."""
    key = (lambda i: (-e[i], -d[i], i)) if t5 else (lambda i: (-(e[i] + d[i]), i))
    return sorted(range(len(e)), key=key)


def baseline_groups(method, e, d, t5, value, cap_e, cap_d):
    """Rows of each micro-batch (tuples of sample-index tuples) of the candidate baselines, built one Python tuple at
    a time from the documented rules: ``length_grouped`` chunks of ``value`` samples longest first, ``token_budget``
    longest first cut where :func:`budget_groups` cuts (``value`` padded tokens), ``packing_free`` the rows of
    :func:`best_fit_rows` (each row's samples in visiting order) ``value`` rows at a time, rows in opening order.
    ``cap_e``, ``cap_d``: a packed row's lengths (GPT: ``cap_d`` 0)."""
    e, d = [int(x) for x in e], [int(x) for x in d]
    order = longest_first(e, d, t5)
    if not t5:  # one sequence of inputs and targets
        e, d = [a + b for a, b in zip(e, d)], [0] * len(e)
    if method == "length_grouped":
        return [tuple((i,) for i in order[k:k + value]) for k in range(0, len(order), value)]
    if method == "token_budget":
        groups: list[list] = []
        for i, g in zip(order, budget_groups(e, d, order, value)):
            if g == len(groups):
                groups.append([])
            groups[g].append((i,))
        return [tuple(g) for g in groups]
    assert method == "packing_free", method
    row = best_fit_rows(e, d, order, cap_e, cap_d)
    rows: list[list[int]] = [[] for _ in range(max(row, default=-1) + 1)]
    for i in order:
        rows[row[i]].append(i)
    return [tuple(tuple(r) for r in rows[k:k + value]) for k in range(0, len(rows), value)]


def longest_rows(e, d, ids, row_bounds, group_bounds):
    """Twin of ``_longest_rows``: for each micro-batch (rows ``group_bounds[m]`` up to ``group_bounds[m + 1]``, row
    ``r`` the samples ``ids[row_bounds[r]:row_bounds[r + 1]]``), its largest row sum of ``e`` and of ``d``."""
    out = []
    for m in range(len(group_bounds) - 1):
        rows = [ids[row_bounds[r]:row_bounds[r + 1]] for r in range(group_bounds[m], group_bounds[m + 1])]
        out.append([max(sum(int(e[i]) for i in row) for row in rows), max(sum(int(d[i]) for i in row) for row in rows)])
    return out


def joined_bounds(parts):
    """Twin of ``_joined_bounds``, given the parts' bounds one list each: their bounds one after another, each part's
    (but its first, the end of the part before) shifted by the totals of the parts before it."""
    out, shift = [0], 0
    for part in parts:
        out.extend(int(x) + shift for x in part[1:])
        shift += int(part[-1])
    return out
