"""numba kernels of the replica split: arrays in, arrays out, no validation (``replicas.py`` validates).

Every kernel has a slow pure-Python twin in ``tests/reference/replicas_reference.py``; tests compare them.

A replica running micro-batches of bottleneck times ``t`` through ``S`` stages takes about
``sum(t) + (S - 1) * max(t)`` (see :mod:`dynabatch.plan.partition`); an empty replica takes 0.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _lpt_assign(times, order, num_replicas, num_stages):
    """Greedy LPT: take micro-batches in ``order`` (longest first); the first ``R`` open one replica each,
    every later one goes to the replica whose predicted time after taking it is smallest (ties: lowest
    replica index). For positive times the first ``R`` steps choose so anyway; seeding them keeps zero-time
    micro-batches from leaving a replica empty. Returns (M,) int64 replicas."""
    m = times.shape[0]
    total = np.zeros(num_replicas)
    peak = np.zeros(num_replicas)
    assign = np.empty(m, dtype=np.int64)
    for k in range(m):
        i = order[k]
        t = times[i]
        best, best_r = np.inf, min(k, num_replicas - 1)
        for r in range(num_replicas if k >= num_replicas else 0):
            v = total[r] + t + (num_stages - 1) * max(peak[r], t)
            if v < best:
                best, best_r = v, r
        assign[i] = best_r
        total[best_r] += t
        peak[best_r] = max(peak[best_r], t)
    return assign


@njit(cache=True)
def _replica_times(times, assign, num_replicas, num_stages):
    total = np.zeros(num_replicas)
    peak = np.zeros(num_replicas)
    for i in range(times.shape[0]):
        r = assign[i]
        total[r] += times[i]
        peak[r] = max(peak[r], times[i])
    return total + (num_stages - 1) * peak


@njit(cache=True)
def _top_two(times, assign, num_replicas):
    """Per replica: largest time, the index holding it (lowest index on ties), second largest, count."""
    first = np.zeros(num_replicas)
    first_index = np.full(num_replicas, -1, dtype=np.int64)
    second = np.zeros(num_replicas)
    count = np.zeros(num_replicas, dtype=np.int64)
    for i in range(times.shape[0]):
        r = assign[i]
        t = times[i]
        count[r] += 1
        if first_index[r] < 0 or t > first[r]:
            second[r] = first[r]
            first[r] = t
            first_index[r] = i
        elif t > second[r]:
            second[r] = t
    return first, first_index, second, count


@njit(cache=True)
def _refine(times, assign, num_replicas, num_stages, max_rounds):
    """Local search on the slowest replica ``a``: the best single move (``a`` keeps at least one
    micro-batch) or swap with another replica, if it lowers ``max(time_a, time_b)`` below ``time_a``.

    Candidates are scanned item of ``a`` by item in index order: its moves to replicas ``0 .. R-1``, then
    its swaps with items ``0 .. M-1`` of other replicas; only a strictly better candidate replaces the best
    so far, so the result is deterministic. Every accepted step lowers the sorted vector of replica times
    lexicographically, so the search ends. Works in place on ``assign``; returns the accepted steps.
    """
    m = times.shape[0]
    s1 = num_stages - 1
    for step in range(max_rounds):
        total = np.zeros(num_replicas)
        for i in range(m):
            total[assign[i]] += times[i]
        first, first_index, second, count = _top_two(times, assign, num_replicas)
        pred = total + s1 * first
        a = 0
        for r in range(1, num_replicas):
            if pred[r] > pred[a]:
                a = r
        limit = pred[a] * (1.0 - 1e-12)
        best, best_i, best_j = limit, -1, -1
        for i in range(m):
            if assign[i] != a:
                continue
            ti = times[i]
            peak_a_wo = second[a] if i == first_index[a] else first[a]  # max of a without i
            # move i to every other replica
            if count[a] > 1:
                new_a = total[a] - ti + s1 * peak_a_wo
                for b in range(num_replicas):
                    if b == a:
                        continue
                    new_b = total[b] + ti + s1 * max(first[b], ti)
                    v = max(new_a, new_b)
                    if v < best:
                        best, best_i, best_j = v, i, -1 - b
            # swap i with every item j of another replica
            for j in range(m):
                b = assign[j]
                if b == a:
                    continue
                tj = times[j]
                if tj >= ti:
                    continue  # a swap that does not shrink a cannot lower max(time_a, time_b) below time_a
                peak_b_wo = second[b] if j == first_index[b] else first[b]
                new_a = total[a] - ti + tj + s1 * max(peak_a_wo, tj)
                new_b = total[b] - tj + ti + s1 * max(peak_b_wo, ti)
                v = max(new_a, new_b)
                if v < best:
                    best, best_i, best_j = v, i, j
        if best_i < 0:
            return step
        if best_j < 0:  # move
            assign[best_i] = -1 - best_j
        else:  # swap
            assign[best_i] = assign[best_j]
            assign[best_j] = a
    return max_rounds
