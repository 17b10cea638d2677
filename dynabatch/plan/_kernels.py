"""numba kernels of the planner: arrays in, arrays out, no validation (the public wrappers validate).

Every kernel has a slow pure-Python twin in ``tests/reference/plan_reference.py``; tests compare them.

Candidate runs are indexed by their *last* sample: ``T[j, w - 1]`` is the time of the run of ``w``
ordered samples ``j - w + 1 .. j``, and ``L[j]`` is how many lengths ``w = 1 .. L[j]`` are feasible.
``T[j, :L[j]]`` must be non-decreasing (a longer run pads at least as much), which lets the DP stop
scanning a row at the first run over the cap.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# --------------------------------------------------------------------------- partition


@njit(cache=True)
def _band_runs(e, d, cum_e, cum_d, prefix, flat, ends, w_lo, w_hi, rows_at, num_rows):
    """The runs of lengths ``w_lo[k] .. w_hi[k] - 1`` ending at each ``ends[k]`` (those starting at sample 0 or
    later), end by end, shortest first, as the cost model prices them.

    Returns ``counts`` (K,): the runs of each end, and ``x`` (``num_rows``, M = ``counts.sum()``) float64, one column
    per run: row ``rows_at[0]``, ``[1]``, ``[2]`` its ``b, E, D`` priced padded (``(w, longest e, longest d)``) or,
    with ``flat``, as one row (``(1, sum e, sum d)``); rows ``rows_at[3:6]`` the sums of the units' attention pairs
    over the run from their prefix sums ``prefix`` ((N + 1, 3); a (0, 3) array: none); rows ``rows_at[6:8]`` its
    longest ``e`` and ``d``. A negative ``rows_at`` entry is not written; rows not written are zero.
    """
    num_ends = ends.shape[0]
    counts = np.zeros(num_ends, dtype=np.int64)
    for k in range(num_ends):
        counts[k] = max(0, min(w_hi[k] - 1, ends[k] + 1) - w_lo[k] + 1)
    x = np.zeros((num_rows, counts.sum()))
    with_pairs = prefix.shape[0] > 0
    q = 0
    for k in range(num_ends):
        j = ends[k]
        max_e = 0
        max_d = 0
        for w in range(1, min(w_hi[k] - 1, j + 1) + 1):
            i = j - w + 1
            if e[i] > max_e:
                max_e = e[i]
            if d[i] > max_d:
                max_d = d[i]
            if w < w_lo[k]:
                continue
            if flat:
                shape = (1, cum_e[j + 1] - cum_e[i], cum_d[j + 1] - cum_d[i])
            else:
                shape = (w, max_e, max_d)
            for r in range(3):
                if rows_at[r] >= 0:
                    x[rows_at[r], q] = shape[r]
            if with_pairs:
                for c in range(3):
                    if rows_at[3 + c] >= 0:
                        x[rows_at[3 + c], q] = prefix[j + 1, c] - prefix[i, c]
            if rows_at[6] >= 0:
                x[rows_at[6], q] = max_e
            if rows_at[7] >= 0:
                x[rows_at[7], q] = max_d
            q += 1
    return counts, x


@njit(cache=True)
def _band_fits(counts, times, fits):
    """Per end of a band (runs laid out as :func:`_band_runs` returns them): how many of its runs, shortest first,
    fit before the first that does not (``fits``), and the slowest time of those of its runs that fit (0: none)."""
    num_ends = counts.shape[0]
    num_fit = np.zeros(num_ends, dtype=np.int64)
    slowest = np.zeros(num_ends)
    q = 0
    for k in range(num_ends):
        leading = True
        for c in range(counts[k]):
            if fits[q + c]:
                if leading:
                    num_fit[k] += 1
                if times[q + c] > slowest[k]:
                    slowest[k] = times[q + c]
            else:
                leading = False
        q += counts[k]
    return num_fit, slowest


@njit(cache=True)
def _next_band_ends(counts, times, w_lo, w_hi, bound, max_w, margin):
    """Where each end's next band stops (exclusive), its runs so far ``w_lo[k] .. w_hi[k] - 1`` priced at ``times``
    (laid out as :func:`_band_runs` returns them), at most ``max_w + 1``: the band doubles, and under a pruning
    ``bound`` (not inf) it stops sooner, ``margin`` past the length where the line through the band's last (up to 5)
    times reaches the bound: runs slower than the bound are in no better plan, and an end whose band still ends
    below it grows again in the next call. Which lengths each call prices changes, not which runs the table ends
    with within the bound. (The last times: on heavy-tailed batches a row's times grow faster than a line, and the
    slope from its first time overshot the bound more. Never past doubling: where times barely rise the line
    reaches the bound far out, and on 2,000-sample batches a band sized by it alone priced twice the runs.)"""
    num_ends = counts.shape[0]
    out = np.empty(num_ends, dtype=np.int64)
    q = 0
    for k in range(num_ends):
        longest = w_hi[k] - 1
        end = min(max_w, 2 * longest)
        c = counts[k]
        first = q + max(c - 4, 0)
        if c > 1 and bound < np.inf and times[q + c - 1] > times[first]:
            slope = (times[q + c - 1] - times[first]) / (q + c - 1 - first)
            reach = longest + (bound - times[q + c - 1]) / slope
            end = int(min(float(end), max(float(longest + 1), np.ceil(reach * (1.0 + margin)))))  # float: no overflow
        out[k] = end + 1
        q += c
    return out


@njit(cache=True)
def _running_max_rows(table):
    """Each row of ``table`` made non-decreasing in place: every entry the largest of it and those before it in its
    row (``np.maximum.accumulate(table, axis=1)``, which runs the rows' strided axis slowly)."""
    for j in range(table.shape[0]):
        for w in range(1, table.shape[1]):
            if table[j, w - 1] > table[j, w]:
                table[j, w] = table[j, w - 1]


@njit(cache=True)
def _scatter_band(table, ends, w_lo, counts, values):
    """Write a band's per-run ``values`` (laid out as :func:`_band_runs` returns them, the runs of ``ends[k]`` from
    length ``w_lo[k]``) into the run table ``table[end, w - 1]``, the lengths past the table's width left out."""
    q = 0
    for k in range(ends.shape[0]):
        for c in range(counts[k]):
            col = w_lo[k] - 1 + c
            if col < table.shape[1]:
                table[ends[k], col] = values[q + c]
        q += counts[k]


@njit(cache=True)
def _min_max_dp(T, L):
    """Smallest achievable max run time over all partitions (the bottleneck value)."""
    n = T.shape[0]
    g = np.empty(n + 1)
    g[0] = 0.0
    for j in range(n):
        best = np.inf
        for w in range(1, L[j] + 1):
            t = T[j, w - 1]
            if t >= best:
                break
            v = max(g[j + 1 - w], t)
            if v < best:
                best = v
        g[j + 1] = best
    return g[n]


@njit(cache=True)
def _min_sum_dp(T, L, cap, f, m, choice):
    """Min total time over partitions whose runs all take ``<= cap``; fills ``f``, ``m``, ``choice``.

    ``f[k]``: best sum over the first ``k`` samples; ``m[k]``: max run time on that path (ties in the
    sum prefer the smaller max); ``choice[j]``: length of the last run ending at ``j``.
    Returns ``(f[n], m[n])``; ``f[n]`` is inf when no partition fits the cap.
    """
    n = T.shape[0]
    f[0] = 0.0
    m[0] = 0.0
    for j in range(n):
        best = np.inf
        best_m = np.inf
        best_w = 0
        for w in range(1, L[j] + 1):
            t = T[j, w - 1]
            if t > cap:
                break
            prev = f[j + 1 - w]
            if prev == np.inf:
                continue
            s = prev + t
            mm = max(m[j + 1 - w], t)
            if s < best or (s == best and mm < best_m):
                best = s
                best_m = mm
                best_w = w
        f[j + 1] = best
        m[j + 1] = best_m
        choice[j] = best_w
    return f[n], m[n]


@njit(cache=True)
def _cap_candidates(T, L, lo, hi, tol):
    """Sorted run times in ``[lo, hi]``, thinned by ``_thin_caps`` so consecutive caps differ by more than ``tol``."""
    n = T.shape[0]
    count = 0
    for j in range(n):
        for w in range(L[j]):
            t = T[j, w]
            if lo <= t <= hi:
                count += 1
    values = np.empty(count)
    k = 0
    for j in range(n):
        for w in range(L[j]):
            t = T[j, w]
            if lo <= t <= hi:
                values[k] = t
                k += 1
    return _thin_caps(values, tol)


@njit(cache=True)
def _thin_caps(values, tol):
    """Sort ``values`` in place and thin them: from the smallest uncovered value ``v`` take the largest
    value ``<= v (1 + tol)``, so every value is within a factor ``1 + tol`` below some cap."""
    values.sort()
    count = values.shape[0]
    caps = np.empty(count)
    num_caps = 0
    i = 0
    while i < count:
        limit = values[i] * (1.0 + tol)
        while i + 1 < count and values[i + 1] <= limit:
            i += 1
        caps[num_caps] = values[i]
        num_caps += 1
        i += 1
    return caps[:num_caps]


@njit(cache=True)
def _lengths_from_choice(choice):
    """Run lengths, first run first, from the DP's last-run choices."""
    n = choice.shape[0]
    out = np.empty(n, dtype=np.int64)
    k = 0
    j = n - 1
    while j >= 0:
        out[k] = choice[j]
        j -= choice[j]
        k += 1
    return out[:k][::-1].copy()


@njit(cache=True)
def _solve_partition(T, L, num_stages, tol):
    """Contiguous partition minimising ``sum(t) + (num_stages - 1) * max(t)``.

    Returns ``(run_lengths, objective, num_caps_tried)``. ``F(c)``, the min sum over partitions whose
    runs all take ``<= c``, is non-increasing in ``c``; the DP under cap ``c`` gives ``F(c)`` and a path
    whose objective (with the path's actual max) is a candidate. Caps are the run times between the
    bottleneck value and ``(U - F(inf)) / (S - 1)`` (``U``: objective of the unconstrained min-sum path),
    thinned by ``tol``. Instead of trying them in order, branch and bound on intervals of the sorted
    caps: every partition whose cap lies strictly between evaluated caps ``lo < hi`` costs more than
    ``F(hi) + (S - 1) * lo``; the interval with the lowest bound is split at its middle cap until
    no bound is below the best objective.
    """
    n = T.shape[0]
    f = np.empty(n + 1)
    m = np.empty(n + 1)
    choice = np.zeros(n, dtype=np.int64)
    sum_min, max_at_min = _min_sum_dp(T, L, np.inf, f, m, choice)
    best_obj = sum_min + (num_stages - 1) * max_at_min
    best_choice = choice.copy()
    if num_stages == 1:
        return _lengths_from_choice(best_choice), best_obj, 0
    slope = num_stages - 1.0
    lo_cap = _min_max_dp(T, L)
    caps = _cap_candidates(T, L, lo_cap, (best_obj - sum_min) / slope, tol)
    k = caps.shape[0]
    if k == 0:
        return _lengths_from_choice(best_choice), best_obj, 0
    F, stack = _new_cap_search(k, sum_min)
    num_open = 0
    num_tried = 0
    lo, mid, hi = 0, 0, k  # caps[0] first; splitting the virtual (0, k) there opens (0, k)
    while lo >= 0:
        s, mx = _min_sum_dp(T, L, caps[mid], f, m, choice)
        F[mid] = s
        num_tried += 1
        if s + slope * mx < best_obj:
            best_obj = s + slope * mx
            best_choice[:] = choice
        num_open = _push_halves(stack, num_open, lo, mid, hi)
        lo, mid, hi, num_open = _pop_best_interval(stack, num_open, F, caps, slope, best_obj)
    return _lengths_from_choice(best_choice), best_obj, num_tried


# --------------------------------------------------------------------------- best-first cap search
# Shared by ``_solve_partition`` and ``_slicing_kernels._solve_slices``; each runs its own DP under a cap.
# ``F[i]`` is the min sum under ``caps[i]`` once evaluated (``F[k]``, past the last cap, the unconstrained
# one); a cap strictly inside an open interval ``(lo, hi)`` of cap indices scores more than
# ``F[hi] + slope * caps[lo]``. A solver loop: evaluate ``caps[mid]``, ``_push_halves``,
# ``_pop_best_interval``, until it returns ``lo = -1``.


@njit(cache=True)
def _new_cap_search(k, sum_min):
    """``(F, stack)`` for ``k`` caps: ``F`` (k + 1,) with ``F[k] = sum_min``; ``stack`` (k + 1, 2) of open
    intervals ``(lo, hi)``, empty (at most one interval per cap is open at once)."""
    F = np.empty(k + 1)
    F[k] = sum_min
    return F, np.empty((k + 1, 2), dtype=np.int64)


@njit(cache=True)
def _pop_best_interval(stack, num_open, F, caps, slope, best_obj):
    """Remove the open interval with the lowest bound ``F[hi] + slope * caps[lo]`` (first on ties).

    Returns ``(lo, mid, hi, num_open)`` with ``mid = (lo + hi) // 2`` the cap to evaluate next; ``lo = -1``
    (nothing removed) when no interval is open or no bound is below ``best_obj``: the search is over.
    Removal swaps the last interval into the hole.
    """
    if num_open == 0:
        return -1, -1, -1, num_open
    pick = 0
    bound = np.inf
    for q in range(num_open):
        v = F[stack[q, 1]] + slope * caps[stack[q, 0]]
        if v < bound:
            bound = v
            pick = q
    if bound >= best_obj:
        return -1, -1, -1, num_open
    lo = stack[pick, 0]
    hi = stack[pick, 1]
    num_open -= 1
    stack[pick, 0] = stack[num_open, 0]
    stack[pick, 1] = stack[num_open, 1]
    return lo, (lo + hi) // 2, hi, num_open


@njit(cache=True)
def _push_halves(stack, num_open, lo, mid, hi):
    """Push ``(lo, mid)`` and ``(mid, hi)``, each only if a cap lies strictly inside; returns ``num_open``."""
    if mid - lo > 1:
        stack[num_open, 0] = lo
        stack[num_open, 1] = mid
        num_open += 1
    if hi - mid > 1:
        stack[num_open, 0] = mid
        stack[num_open, 1] = hi
        num_open += 1
    return num_open


# --------------------------------------------------------------------------- orderings


@njit(cache=True)
def _morton_keys(x, y):
    """Z-order (Morton) keys of non-negative int coordinates: bits of ``x`` and ``y`` interleaved."""
    n = x.shape[0]
    keys = np.empty(n, dtype=np.int64)
    for k in range(n):
        key = 0
        for bit in range(31):
            key |= ((x[k] >> bit) & 1) << (2 * bit + 1)
            key |= ((y[k] >> bit) & 1) << (2 * bit)
        keys[k] = key
    return keys


@njit(cache=True)
def _hilbert_keys(x, y, order):
    """Hilbert-curve index of each ``(x, y)`` on the ``2**order`` square grid (classic xy2d)."""
    n = x.shape[0]
    keys = np.empty(n, dtype=np.int64)
    side = np.int64(1) << order
    for k in range(n):
        px = x[k]
        py = y[k]
        key = 0
        s = side >> 1
        while s > 0:
            rx = 1 if (px & s) > 0 else 0
            ry = 1 if (py & s) > 0 else 0
            key += s * s * ((3 * rx) ^ ry)
            if ry == 0:  # rotate the quadrant
                if rx == 1:
                    px = side - 1 - px
                    py = side - 1 - py
                px, py = py, px
            s >>= 1
        keys[k] = key
    return keys


@njit(cache=True)
def _nearest_neighbour_path(x, y, start):
    """Greedy open path: from ``start``, repeatedly the closest unvisited point in L1 (ties: lowest index)."""
    n = x.shape[0]
    path = np.empty(n, dtype=np.int64)
    visited = np.zeros(n, dtype=np.bool_)
    cur = start
    for k in range(n):
        path[k] = cur
        visited[cur] = True
        best = -1
        best_dist = np.int64(0)
        for c in range(n):
            if visited[c]:
                continue
            dist = abs(x[c] - x[cur]) + abs(y[c] - y[cur])
            if best < 0 or dist < best_dist:
                best = c
                best_dist = dist
        cur = best
    return path


@njit(cache=True)
def _two_opt(path, x, y, window, max_passes):
    """Improve an open path in place by 2-opt segment reversals (L1 distances, integers, exact).

    Reversing ``path[i..k]`` replaces edges ``(i-1, i)`` and ``(k, k+1)`` by ``(i-1, k)`` and
    ``(i, k+1)`` (a missing edge at either end of the path counts 0). Only ``k - i < window`` is tried;
    first improvement is taken; stops after a pass without improvement or ``max_passes`` passes.
    Returns the number of passes run.
    """
    n = path.shape[0]
    passes = 0
    improved = True
    while improved and passes < max_passes:
        improved = False
        passes += 1
        for i in range(n - 1):
            for k in range(i + 1, min(n, i + window)):
                a = path[i]
                b = path[k]
                delta = np.int64(0)
                if i > 0:
                    p = path[i - 1]
                    delta += abs(x[p] - x[b]) + abs(y[p] - y[b]) - abs(x[p] - x[a]) - abs(y[p] - y[a])
                if k < n - 1:
                    q = path[k + 1]
                    delta += abs(x[a] - x[q]) + abs(y[a] - y[q]) - abs(x[b] - x[q]) - abs(y[b] - y[q])
                if delta < 0:
                    lo = i
                    hi = k
                    while lo < hi:
                        tmp = path[lo]
                        path[lo] = path[hi]
                        path[hi] = tmp
                        lo += 1
                        hi -= 1
                    improved = True
    return passes
