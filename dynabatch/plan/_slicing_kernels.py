"""numba kernels of the token-slicing DP: arrays in, arrays out, no validation (``slicing.py`` validates).

Every kernel has a slow pure-Python twin in ``tests/reference/slicing_reference.py``; tests compare them.

A sequence is cut at grid points ``0 .. n`` (point ``i`` is token ``min(i g, L)``). ``T`` is a dense
(n + 1, n + 1) float64 matrix indexed by a slice's *end* then its *start*: ``T[j, i]`` (``i < j``) is the
time of the slice of grid points ``i .. j``, ``+inf`` where that slice breaks the memory budget; entries
with ``i >= j`` are ``+inf`` and never read as slices. Rows are contiguous, so the DP's inner loop over
starts reads memory in order. Paths are int64 arrays of grid points ``0 = p_0 < ... < p_k = n``.

``max_slices >= n`` means "no limit" and runs the O(n^2) DP on ``f[j]``; a smaller limit runs the
layered O(max_slices n^2) DP on ``f[k, j]`` (best over paths of exactly ``k`` slices).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dynabatch.plan._kernels import _new_cap_search, _pop_best_interval, _push_halves, _thin_caps


@njit(cache=True)
def _walk_back(choice_row_of, n):
    """Grid points of the path that ends at ``n`` (1-D choices: start of the last slice ending at j)."""
    out = np.empty(n + 1, dtype=np.int64)
    k = 0
    j = n
    while j > 0:
        out[k] = j
        j = choice_row_of[j]
        k += 1
    out[k] = 0
    return out[: k + 1][::-1].copy()


@njit(cache=True)
def _min_sum_path(T, cap, max_slices):
    """Min total time over paths whose slices all take ``<= cap`` (and at most ``max_slices`` slices).

    Returns ``(sum, max, path)``; ties in the sum prefer the smaller max along the path, then the
    earliest start of the last slice (the 1-D DP) or the fewest slices (layered). ``sum`` is inf and
    ``path`` empty when no path fits.
    """
    n = T.shape[0] - 1
    if max_slices >= n:
        f = np.empty(n + 1)
        m = np.empty(n + 1)
        choice = np.zeros(n + 1, dtype=np.int64)
        f[0] = 0.0
        m[0] = 0.0
        for j in range(1, n + 1):
            best = np.inf
            best_m = np.inf
            best_i = -1
            for i in range(j):
                t = T[j, i]
                if t == np.inf or t > cap:
                    continue
                prev = f[i]
                if prev == np.inf:
                    continue
                s = prev + t
                mm = max(m[i], t)
                if s < best or (s == best and mm < best_m):
                    best = s
                    best_m = mm
                    best_i = i
            f[j] = best
            m[j] = best_m
            choice[j] = best_i
        if f[n] == np.inf:
            return np.inf, np.inf, np.empty(0, dtype=np.int64)
        return f[n], m[n], _walk_back(choice, n)
    K = max_slices
    f2 = np.full((K + 1, n + 1), np.inf)
    m2 = np.full((K + 1, n + 1), np.inf)
    choice2 = np.full((K + 1, n + 1), -1, dtype=np.int64)
    f2[0, 0] = 0.0
    m2[0, 0] = 0.0
    for k in range(1, K + 1):
        for j in range(k, n + 1):
            best = np.inf
            best_m = np.inf
            best_i = -1
            for i in range(k - 1, j):
                t = T[j, i]
                if t == np.inf or t > cap:
                    continue
                prev = f2[k - 1, i]
                if prev == np.inf:
                    continue
                s = prev + t
                mm = max(m2[k - 1, i], t)
                if s < best or (s == best and mm < best_m):
                    best = s
                    best_m = mm
                    best_i = i
            f2[k, j] = best
            m2[k, j] = best_m
            choice2[k, j] = best_i
    best = np.inf
    best_m = np.inf
    best_k = 0
    for k in range(1, K + 1):
        s = f2[k, n]
        if s < best or (s == best and s < np.inf and m2[k, n] < best_m):
            best = s
            best_m = m2[k, n]
            best_k = k
    if best == np.inf:
        return np.inf, np.inf, np.empty(0, dtype=np.int64)
    path = np.empty(best_k + 1, dtype=np.int64)
    j = n
    for k in range(best_k, 0, -1):
        path[k] = j
        j = choice2[k, j]
    path[0] = 0
    return best, best_m, path


@njit(cache=True)
def _min_max_value(T, max_slices):
    """Smallest achievable max slice time over all paths (the bottleneck value); inf if none fits."""
    n = T.shape[0] - 1
    if max_slices >= n:
        g = np.empty(n + 1)
        g[0] = 0.0
        for j in range(1, n + 1):
            best = np.inf
            for i in range(j):
                v = max(g[i], T[j, i])
                if v < best:
                    best = v
            g[j] = best
        return g[n]
    K = max_slices
    g2 = np.full((K + 1, n + 1), np.inf)
    g2[0, 0] = 0.0
    out = np.inf
    for k in range(1, K + 1):
        for j in range(k, n + 1):
            best = np.inf
            for i in range(k - 1, j):
                v = max(g2[k - 1, i], T[j, i])
                if v < best:
                    best = v
            g2[k, j] = best
        if g2[k, n] < out:
            out = g2[k, n]
    return out


@njit(cache=True)
def _cap_candidates(T, lo, hi, tol):
    """Sorted finite slice times in ``[lo, hi]``, thinned so consecutive caps differ by more than ``tol``.

    Greedy cover shared with the partition DP (``_kernels._thin_caps``): every value is within a factor
    ``1 + tol`` below some cap.
    """
    n = T.shape[0] - 1
    count = 0
    for j in range(1, n + 1):
        for i in range(j):
            t = T[j, i]
            if lo <= t <= hi and t < np.inf:
                count += 1
    values = np.empty(count)
    k = 0
    for j in range(1, n + 1):
        for i in range(j):
            t = T[j, i]
            if lo <= t <= hi and t < np.inf:
                values[k] = t
                k += 1
    return _thin_caps(values, tol)


@njit(cache=True)
def _solve_slices(T, num_stages, tol, max_slices):
    """Slice boundaries minimising ``sum(t) + (num_stages - 1) * max(t)``: ``(path, objective, caps_tried)``.

    ``F(c)``, the min sum over paths whose slices all take ``<= c``, is non-increasing in ``c``; each DP
    under a cap scores its path with the path's actual max. Caps are the slice times between the
    bottleneck value and ``(U - F(inf)) / (S - 1)`` (``U``: objective of the unconstrained min-sum
    path; a path with a larger max costs more than ``U``), thinned by ``tol``, searched best-first by
    bisection: every path whose max lies strictly between evaluated caps ``lo < hi`` costs more than
    ``F(hi) + (S - 1) lo``, so intervals whose bound reaches the best objective are dropped.
    An empty path (objective inf) means no path fits the memory budget or ``max_slices``.
    """
    sum_min, max_at_min, best_path = _min_sum_path(T, np.inf, max_slices)
    if sum_min == np.inf:
        return best_path, np.inf, 0
    best_obj = sum_min + (num_stages - 1) * max_at_min
    if num_stages == 1:
        return best_path, best_obj, 0
    slope = num_stages - 1.0
    lo_cap = _min_max_value(T, max_slices)
    caps = _cap_candidates(T, lo_cap, (best_obj - sum_min) / slope, tol)
    k = caps.shape[0]
    if k == 0:
        return best_path, best_obj, 0
    F, stack = _new_cap_search(k, sum_min)
    num_open = 0
    num_tried = 0
    lo, mid, hi = 0, 0, k  # caps[0] first; splitting the virtual (0, k) there opens (0, k)
    while lo >= 0:
        s, mx, path = _min_sum_path(T, caps[mid], max_slices)
        F[mid] = s
        num_tried += 1
        if s + slope * mx < best_obj:
            best_obj = s + slope * mx
            best_path = path
        num_open = _push_halves(stack, num_open, lo, mid, hi)
        lo, mid, hi, num_open = _pop_best_interval(stack, num_open, F, caps, slope, best_obj)
    return best_path, best_obj, num_tried
