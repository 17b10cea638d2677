"""Slow pure-Python twins of :mod:`dynabatch.plan._replica_kernels`, plus brute force over assignments.

Each twin follows its kernel line by line (same scan order, same strict comparisons) on Python lists, so
tests can compare assignments exactly. ``brute_force_assignment`` tries every map of micro-batches to
replicas and is the ground truth for small cases.
"""

from __future__ import annotations

import itertools
import math


def replica_times(times, assign, num_replicas, num_stages):
    total = [0.0] * num_replicas
    peak = [0.0] * num_replicas
    for t, r in zip(times, assign):
        total[r] += t
        peak[r] = max(peak[r], t)
    return [total[r] + (num_stages - 1) * peak[r] for r in range(num_replicas)]


def lpt_assign(times, order, num_replicas, num_stages):
    total = [0.0] * num_replicas
    peak = [0.0] * num_replicas
    assign = [0] * len(times)
    for k, i in enumerate(order):
        t = times[i]
        best, best_r = math.inf, k  # the first num_replicas micro-batches open one replica each
        if k >= num_replicas:
            for r in range(num_replicas):
                v = total[r] + t + (num_stages - 1) * max(peak[r], t)
                if v < best:
                    best, best_r = v, r
        assign[i] = best_r
        total[best_r] += t
        peak[best_r] = max(peak[best_r], t)
    return assign


def refine(times, assign, num_replicas, num_stages, max_rounds):
    """Same local search as the kernel, recomputing each candidate's replica times from scratch."""
    assign = list(assign)
    m = len(times)
    s1 = num_stages - 1
    for step in range(max_rounds):
        members = [[i for i in range(m) if assign[i] == r] for r in range(num_replicas)]
        pred = replica_times(times, assign, num_replicas, num_stages)
        a = max(range(num_replicas), key=lambda r: (pred[r], -r))
        best, best_move = pred[a] * (1.0 - 1e-12), None

        def cost(rows):
            return sum(times[i] for i in rows) + s1 * max((times[i] for i in rows), default=0.0)

        for i in members[a]:
            rest_a = [k for k in members[a] if k != i]
            if rest_a:
                for b in range(num_replicas):
                    if b != a:
                        v = max(cost(rest_a), cost(members[b] + [i]))
                        if v < best:
                            best, best_move = v, (i, None, b)
            for j in range(m):
                b = assign[j]
                if b == a or times[j] >= times[i]:
                    continue
                v = max(cost(rest_a + [j]), cost([k for k in members[b] if k != j] + [i]))
                if v < best:
                    best, best_move = v, (i, j, b)
        if best_move is None:
            return assign, step
        i, j, b = best_move
        assign[i] = b
        if j is not None:
            assign[j] = a
    return assign, max_rounds


def brute_force_assignment(times, num_replicas, num_stages):
    """Smallest slowest-replica time over all maps of micro-batches to replicas (no replica left empty)."""
    best = math.inf
    for assign in itertools.product(range(num_replicas), repeat=len(times)):
        if len(set(assign)) == num_replicas:
            best = min(best, max(replica_times(times, assign, num_replicas, num_stages)))
    return best
