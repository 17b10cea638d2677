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
