"""Slow pure-Python twins of the token-slicing kernels in :mod:`dynabatch.plan._slicing_kernels`, plus brute force.

Each twin follows its kernel line by line (same loop order, same tie-breaking) on Python lists, so tests
compare them exactly on random inputs. ``brute_force_slices`` enumerates every boundary set on the grid,
prices each slice with the cost model directly and is the ground truth for ``plan_slices``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from reference.plan_reference import pipeline_objective, search_caps, thin_caps

INF = math.inf


def min_sum_path(T, cap, max_slices):
    """Twin of ``_min_sum_path``: ``(sum, max, path)``; ``T[j][i]`` is the slice from point i to point j."""
    n = len(T) - 1
    if max_slices >= n:
        f, m, choice = [0.0] + [INF] * n, [0.0] + [INF] * n, [0] * (n + 1)
        for j in range(1, n + 1):
            best, best_m, best_i = INF, INF, -1
            for i in range(j):
                t = T[j][i]
                if t == INF or t > cap or f[i] == INF:
                    continue
                s, mm = f[i] + t, max(m[i], t)
                if s < best or (s == best and mm < best_m):
                    best, best_m, best_i = s, mm, i
            f[j], m[j], choice[j] = best, best_m, best_i
        if f[n] == INF:
            return INF, INF, []
        path, j = [n], n
        while j > 0:
            j = choice[j]
            path.append(j)
        return f[n], m[n], path[::-1]
    K = max_slices
    f = [[INF] * (n + 1) for _ in range(K + 1)]
    m = [[INF] * (n + 1) for _ in range(K + 1)]
    choice = [[-1] * (n + 1) for _ in range(K + 1)]
    f[0][0] = m[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(k, n + 1):
            best, best_m, best_i = INF, INF, -1
            for i in range(k - 1, j):
                t = T[j][i]
                if t == INF or t > cap or f[k - 1][i] == INF:
                    continue
                s, mm = f[k - 1][i] + t, max(m[k - 1][i], t)
                if s < best or (s == best and mm < best_m):
                    best, best_m, best_i = s, mm, i
            f[k][j], m[k][j], choice[k][j] = best, best_m, best_i
    best, best_m, best_k = INF, INF, 0
    for k in range(1, K + 1):
        s = f[k][n]
        if s < best or (s == best and s < INF and m[k][n] < best_m):
            best, best_m, best_k = s, m[k][n], k
    if best == INF:
        return INF, INF, []
    path, j = [n], n
    for k in range(best_k, 0, -1):
        j = choice[k][j]
        path.append(j)
    return best, best_m, path[::-1]


def min_max_value(T, max_slices):
    n = len(T) - 1
    if max_slices >= n:
        g = [0.0] + [INF] * n
        for j in range(1, n + 1):
            g[j] = min(max(g[i], T[j][i]) for i in range(j))
        return g[n]
    g = [[INF] * (n + 1) for _ in range(max_slices + 1)]
    g[0][0] = 0.0
    out = INF
    for k in range(1, max_slices + 1):
        for j in range(k, n + 1):
            g[k][j] = min(max(g[k - 1][i], T[j][i]) for i in range(k - 1, j))
        out = min(out, g[k][n])
    return out


def cap_candidates(T, lo, hi, tol):
    n = len(T) - 1
    return thin_caps([T[j][i] for j in range(1, n + 1) for i in range(j) if lo <= T[j][i] <= hi and T[j][i] < INF], tol)


def solve_slices(T, num_stages, tol, max_slices):
    """Twin of ``_solve_slices``: ``(path, objective, num_caps_tried)``."""
    T = [list(map(float, row)) for row in np.asarray(T)]
    sum_min, max_at_min, best_path = min_sum_path(T, INF, max_slices)
    if sum_min == INF:
        return best_path, INF, 0
    best_obj = sum_min + (num_stages - 1) * max_at_min
    if num_stages == 1:
        return best_path, best_obj, 0
    slope = num_stages - 1.0
    caps = cap_candidates(T, min_max_value(T, max_slices), (best_obj - sum_min) / slope, tol)
    k = len(caps)
    if k == 0:
        return best_path, best_obj, 0
    return search_caps(caps, sum_min, best_obj, best_path, slope, lambda cap: min_sum_path(T, cap, max_slices))


def slice_cost(cost_model, b, s, c):
    """``(time, stored, peak)`` of one slice as Python floats."""
    b, s, c = (np.array([x], dtype=np.int64) for x in (b, s, c))
    out = cost_model.evaluate(b, s, c)
    return tuple(float(np.asarray(x)[0]) for x in out)


def brute_force_slices(length, cost_model, num_stages, batch_size=1, granularity=1, max_slices=None, reserved=0.0):
    """Min ``sum + (S - 1) max`` over every boundary set on the grid, with the module's memory bound.

    Returns ``(objective, boundaries)``; ``(inf, None)`` when no boundary set fits.
    """
    grid = list(range(granularity, length, granularity))
    best = (INF, None)
    for cuts in itertools.product((False, True), repeat=len(grid)):
        bounds = [0] + [x for x, cut in zip(grid, cuts) if cut] + [length]
        if max_slices is not None and len(bounds) - 1 > max_slices:
            continue
        times, ok = [], True
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            t, stored, peak = slice_cost(cost_model, batch_size, hi - lo, lo)
            prefix = slice_cost(cost_model, batch_size, lo, 0)[1] if lo > 0 else 0.0
            ok &= prefix + stored + peak + reserved <= cost_model.memory_budget_bytes
            times.append(t)
        if not ok:
            continue
        obj = pipeline_objective(times, num_stages)
        if obj < best[0]:
            best = (obj, bounds)
    return best
