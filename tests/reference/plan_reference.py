"""Slow pure-Python twins of the planner kernels in :mod:`dynabatch.plan._kernels`, plus brute force.

Each twin follows its kernel line by line (same loop order, same tie-breaking) on Python lists, so tests
can compare them exactly on random inputs. ``brute_force_partition`` enumerates every contiguous
partition and is the ground truth for the DP.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

INF = math.inf


def run_shapes(e, d, ends, w_lo, w_hi):
    rows_b, rows_e, rows_d = [], [], []
    for j in ends:
        rb, re_, rd = [0] * (w_hi - w_lo), [0] * (w_hi - w_lo), [0] * (w_hi - w_lo)
        for w in range(w_lo, w_hi):
            if w <= j + 1:
                rb[w - w_lo] = w
                re_[w - w_lo] = max(int(x) for x in e[j - w + 1 : j + 1])
                rd[w - w_lo] = max(int(x) for x in d[j - w + 1 : j + 1])
        rows_b.append(rb)
        rows_e.append(re_)
        rows_d.append(rd)
    return rows_b, rows_e, rows_d


def min_max_dp(T, L):
    n = len(L)
    g = [0.0] + [INF] * n
    for j in range(n):
        g[j + 1] = min((max(g[j + 1 - w], T[j][w - 1]) for w in range(1, L[j] + 1)), default=INF)
    return g[n]


def min_sum_dp(T, L, cap):
    """``(sum, max, choice)`` of the min-sum partition with every run ``<= cap`` (ties: smaller max)."""
    n = len(L)
    f, m, choice = [0.0] + [INF] * n, [0.0] + [INF] * n, [0] * n
    for j in range(n):
        best, best_m, best_w = INF, INF, 0
        for w in range(1, L[j] + 1):
            t = T[j][w - 1]
            if t > cap:
                break
            if f[j + 1 - w] == INF:
                continue
            s, mm = f[j + 1 - w] + t, max(m[j + 1 - w], t)
            if s < best or (s == best and mm < best_m):
                best, best_m, best_w = s, mm, w
        f[j + 1], m[j + 1], choice[j] = best, best_m, best_w
    return f[n], m[n], choice


def cap_candidates(T, L, lo, hi, tol):
    return thin_caps([T[j][w] for j in range(len(L)) for w in range(L[j]) if lo <= T[j][w] <= hi], tol)


def thin_caps(values, tol):
    """Twin of ``_thin_caps`` (shared by both solvers): sorted, greedily thinned to a relative step ``tol``."""
    values = sorted(values)
    caps, i = [], 0
    while i < len(values):
        limit = values[i] * (1.0 + tol)
        while i + 1 < len(values) and values[i + 1] <= limit:
            i += 1
        caps.append(values[i])
        i += 1
    return caps


def lengths_from_choice(choice):
    out, j = [], len(choice) - 1
    while j >= 0:
        out.append(choice[j])
        j -= choice[j]
    return out[::-1]


def solve_partition(T, L, num_stages, tol):
    """Twin of ``_solve_partition``: ``(run_lengths, objective, num_caps_tried)``."""
    T = [list(map(float, row)) for row in np.asarray(T)]
    L = [int(x) for x in L]
    sum_min, max_at_min, choice = min_sum_dp(T, L, INF)
    best_obj, best_choice = sum_min + (num_stages - 1) * max_at_min, choice
    if num_stages == 1:
        return lengths_from_choice(best_choice), best_obj, 0
    slope = num_stages - 1.0
    caps = cap_candidates(T, L, min_max_dp(T, L), (best_obj - sum_min) / slope, tol)
    k = len(caps)
    if k == 0:
        return lengths_from_choice(best_choice), best_obj, 0
    best_choice, best_obj, num_tried = search_caps(caps, sum_min, best_obj, best_choice, slope,
                                                   lambda cap: min_sum_dp(T, L, cap))
    return lengths_from_choice(best_choice), best_obj, num_tried


def search_caps(caps, sum_min, best_obj, best, slope, solve):
    """Twin of the best-first cap search shared by ``_solve_partition`` and ``_solve_slices``.

    ``solve(cap) -> (sum, max, result)`` is the solver's DP under a cap; ``best`` / ``best_obj`` the
    unconstrained DP's result and objective, ``sum_min`` its sum. Returns ``(best, best_obj, num_tried)``.
    """
    k = len(caps)
    F, open_, num_tried = {k: sum_min}, [], 0
    lo, mid, hi = 0, 0, k  # caps[0] first; splitting the virtual (0, k) there opens (0, k)
    while True:
        s, mx, result = solve(caps[mid])
        F[mid] = s
        num_tried += 1
        if s + slope * mx < best_obj:
            best_obj, best = s + slope * mx, result
        if mid - lo > 1:  # _push_halves
            open_.append((lo, mid))
        if hi - mid > 1:
            open_.append((mid, hi))
        if not open_:  # _pop_best_interval
            break
        bounds = [F[hi] + slope * caps[lo] for lo, hi in open_]
        pick = min(range(len(open_)), key=lambda q: (bounds[q], q))
        if bounds[pick] >= best_obj:
            break
        lo, hi = open_[pick]
        open_[pick] = open_[-1]  # swap-remove, as the kernel does
        open_.pop()
        mid = (lo + hi) // 2
    return best, best_obj, num_tried


def pipeline_objective(times, num_stages):
    """``sum(times) + (num_stages - 1) * max(times)``, the sum taken left to right."""
    total = 0.0
    for t in times:
        total += t
    return total + (num_stages - 1) * max(times)


def brute_force_partition(T, L, num_stages):
    """Min ``sum + (S - 1) max`` over all contiguous partitions whose runs are within the bands."""
    n = len(L)
    best = (INF, None)
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [n]
        lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        if any(w > L[hi - 1] for w, hi in zip(lengths, bounds[1:])):
            continue
        obj = pipeline_objective([float(T[hi - 1][w - 1]) for w, hi in zip(lengths, bounds[1:])], num_stages)
        if obj < best[0]:
            best = (obj, lengths)
    return best


# --------------------------------------------------------------------------- orderings


def morton_keys(x, y):
    out = []
    for a, b in zip(x, y):
        key = 0
        for bit in range(31):
            key |= ((int(a) >> bit) & 1) << (2 * bit + 1)
            key |= ((int(b) >> bit) & 1) << (2 * bit)
        out.append(key)
    return out


def hilbert_keys(x, y, order):
    side = 1 << order
    out = []
    for px, py in zip(x, y):
        px, py, key, s = int(px), int(py), 0, side >> 1
        while s > 0:
            rx, ry = int(px & s > 0), int(py & s > 0)
            key += s * s * ((3 * rx) ^ ry)
            if ry == 0:
                if rx == 1:
                    px, py = side - 1 - px, side - 1 - py
                px, py = py, px
            s >>= 1
        out.append(key)
    return out


def nearest_neighbour_path(x, y, start):
    n, path, visited, cur = len(x), [], set(), start
    for _ in range(n):
        path.append(cur)
        visited.add(cur)
        rest = [c for c in range(n) if c not in visited]
        if rest:
            cur = min(rest, key=lambda c: (abs(int(x[c]) - int(x[cur])) + abs(int(y[c]) - int(y[cur])), c))
    return path


def two_opt(path, x, y, window, max_passes):
    """Returns ``(path, passes)``; same scan order and first-improvement rule as the kernel."""
    path = list(path)

    def dist(a, b):
        return abs(int(x[a]) - int(x[b])) + abs(int(y[a]) - int(y[b]))

    n, passes, improved = len(path), 0, True
    while improved and passes < max_passes:
        improved, passes = False, passes + 1
        for i in range(n - 1):
            for k in range(i + 1, min(n, i + window)):
                a, b = path[i], path[k]
                delta = 0
                if i > 0:
                    delta += dist(path[i - 1], b) - dist(path[i - 1], a)
                if k < n - 1:
                    delta += dist(a, path[k + 1]) - dist(b, path[k + 1])
                if delta < 0:
                    path[i : k + 1] = path[i : k + 1][::-1]
                    improved = True
    return path, passes
