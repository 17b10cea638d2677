"""numba kernels of the schedule search: the adaptive list schedule, the replay of per-stage orders, and
their memory (the algorithms are documented where they are used: :mod:`dynabatch.schedule.policies`,
:mod:`dynabatch.schedule.simulate`).

Op codes: ``codes[s, k] = 2 m + 1`` for the backward of micro-batch ``m``, ``2 m`` for its forward; every stage
runs ``2 M`` ops. Arrays are ``(S, M)`` float64 per stage and micro-batch. ``choose_schedule`` evaluates about
60 candidate schedules per step; these kernels make that about 20x faster than the pure-Python loops they
replace (the same decisions, the same times).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def replay(codes, fwd, bwd, send):
    """``(starts, ends, ptr)``: start and end of every op (``(S, 2M)``), each stage running its ops in order as
    soon as the stage is free and the op's input has arrived (plus the send time from a neighbour). ``ptr``:
    per stage, how many ops ran; fewer than ``2M`` means the orders deadlock there."""
    S, n = codes.shape
    M = fwd.shape[1]
    last = S - 1
    f_end = np.full((S, M), -1.0)
    b_end = np.full((S, M), -1.0)
    starts = np.zeros((S, n))
    ends = np.zeros((S, n))
    ptr = np.zeros(S, np.int64)
    free = np.zeros(S)
    remaining = S * n
    while remaining > 0:
        progressed = False
        for s in range(S):
            k, t = ptr[s], free[s]
            while k < n:
                code = codes[s, k]
                m = code >> 1
                if code & 1:
                    if s == last:
                        ready = f_end[s, m]
                    else:
                        ready = b_end[s + 1, m]
                        if ready < 0:
                            break
                        ready += send[s, m]
                    t0 = t if t > ready else ready
                    t = t0 + bwd[s, m]
                    b_end[s, m] = t
                else:
                    if s == 0:
                        ready = 0.0
                    else:
                        ready = f_end[s - 1, m]
                        if ready < 0:
                            break
                        ready += send[s - 1, m]
                    t0 = t if t > ready else ready
                    t = t0 + fwd[s, m]
                    f_end[s, m] = t
                starts[s, k] = t0
                ends[s, k] = t
                k += 1
            if k > ptr[s]:
                remaining -= k - ptr[s]
                ptr[s] = k
                free[s] = t
                progressed = True
        if not progressed:
            break
    return starts, ends, ptr


@njit(cache=True, nogil=True)
def op_memory(codes, stored, peak, states):
    """``(during, after)``: each stage's memory while each of its ops runs (its live stored activations plus
    the op's transient peak) and after it ends; it depends on the op order only."""
    S, n = codes.shape
    during = np.empty((S, n))
    after = np.empty((S, n))
    for s in range(S):
        live = states[s]
        for k in range(n):
            code = codes[s, k]
            m = code >> 1
            if code & 1:
                during[s, k] = live + peak[s, m]
                live -= stored[s, m]
            else:
                live += stored[s, m]
                during[s, k] = live + peak[s, m]
            after[s, k] = live
    return during, after


@njit(cache=True, nogil=True)
def adaptive_codes(order, fwd, bwd, stored, peak, send, states, limit, caps, lookahead, prev, nxt):
    """``(codes, ops per stage)``: the adaptive policy's per-stage op codes (``(S, 2M)``) by joint simulation in
    time; :func:`dynabatch.schedule.policies._list_schedule` states the rules. ``limit``: per stage (inf: none);
    ``caps``: per stage in-flight cap (-1: none); ``prev`` / ``nxt``: each micro-batch's previous and next token
    slice (-1: none).

    Each stage keeps its next decision: ``dec[s]``, the time it can start an op, and ``cand[s]``, the forward it
    would run (-1: none admitted). After an op only the stages it touched (itself and the neighbour it sent to)
    are re-decided, at the end of the iteration (a decision reads only its own stage's state and its upstream
    neighbour's forward ends). Everything is one function over flat arrays: per-op calls into helpers taking
    many arrays cost more than the work."""
    S, M = fwd.shape
    last = S - 1
    inf = np.inf
    free = np.zeros(S)
    f_end = np.full((S, M), -1.0)
    in_wait = np.ones(M, np.bool_)
    head = 0  # first position of ``order`` still waiting
    seq = np.empty(M, np.int64)  # stage 0's forward order
    n_seq = 0
    rank = np.zeros(M, np.int64)  # position in seq: backward priority
    next_f = np.zeros(S, np.int64)
    pend_ready = np.empty((S, M))  # backwards whose gradient arrived: (ready, rank, m) per stage
    pend_rank = np.empty((S, M), np.int64)
    pend_m = np.empty((S, M), np.int64)
    npend = np.zeros(S, np.int64)
    held = np.full((S, M), -1.0)  # gradient arrived, the later slice's backward has not run
    b_done = np.zeros((S, M), np.bool_)
    live = np.zeros((S, M), np.bool_)
    nlive = np.zeros(S, np.int64)
    live_stored = np.zeros(S)
    live_peak = np.zeros(S)  # largest op peak among the live micro-batches
    out = np.empty((S, 2 * M), np.int64)
    nout = np.zeros(S, np.int64)
    cand = np.full(S, -1, np.int64)
    dec = np.full(S, inf)
    dirty = np.zeros(3, np.int64)
    dirty[0], ndirty = 0, 1
    for _ in range(2 * M * S + 1):
        for j in range(ndirty):  # re-decide the touched stages
            d = dirty[j]
            t, m_next = inf, -1
            chained = d == 0 and n_seq > 0 and nxt[seq[n_seq - 1]] >= 0 and in_wait[nxt[seq[n_seq - 1]]]
            if d == 0:
                while head < M and not in_wait[order[head]]:
                    head += 1
            k, seen = head, 0
            while True:  # candidates in priority order; the first admitted is the stage's next forward
                if chained:
                    if seen == 1:
                        break
                    m, ready = nxt[seq[n_seq - 1]], 0.0
                elif d == 0:
                    while k < M and not in_wait[order[k]]:
                        k += 1
                    if k >= M or seen >= lookahead:
                        break
                    m, ready = order[k], 0.0
                    k += 1
                    if prev[m] >= 0:  # a chain's later slice enters only right after its previous slice
                        seen += 1
                        continue
                else:
                    if seen == 1 or next_f[d] >= n_seq:
                        break
                    m = seq[next_f[d]]
                    if f_end[d - 1, m] < 0:
                        break
                    ready = f_end[d - 1, m] + send[d - 1, m]
                seen += 1
                p, lp = peak[d, m], live_peak[d]
                if (nlive[d] == 0 or prev[m] >= 0
                        or ((caps[d] < 0 or nlive[d] < caps[d])
                            and states[d] + live_stored[d] + stored[d, m] + (p if p > lp else lp) <= limit[d])):
                    t, m_next = ready, m
                    break
            cand[d] = m_next
            for i in range(npend[d]):
                if pend_ready[d, i] < t:
                    t = pend_ready[d, i]
            dec[d] = t if (t == inf or t > free[d]) else free[d]
        ndirty = 0
        s, t = 0, dec[0]
        for k in range(1, S):
            if dec[k] < t:
                s, t = k, dec[k]
        if t == inf:  # every op ran (or stalled, which a stage holding nothing never lets happen)
            break
        best = -1
        for i in range(npend[s]):
            if pend_ready[s, i] <= t and (best < 0 or pend_rank[s, i] < pend_rank[s, best]):
                best = i
        arrive_s, arrive_m, arrive_t = -1, -1, 0.0
        if best >= 0:  # the ready backward of the earliest micro-batch
            m = pend_m[s, best]
            i = npend[s] - 1
            pend_ready[s, best], pend_rank[s, best], pend_m[s, best] = pend_ready[s, i], pend_rank[s, i], pend_m[s, i]
            npend[s] = i
            end = t + bwd[s, m]
            live[s, m] = False
            nlive[s] -= 1
            live_stored[s] -= stored[s, m]
            lp = 0.0
            for q in range(M):
                if live[s, q] and peak[s, q] > lp:
                    lp = peak[s, q]
            live_peak[s] = lp
            out[s, nout[s]] = 2 * m + 1
            nout[s] += 1
            b_done[s, m] = True
            p = prev[m]
            if p >= 0 and held[s, p] >= 0:  # the previous slice's key/value gradients are now complete
                i = npend[s]
                pend_ready[s, i] = held[s, p] if held[s, p] > end else end
                pend_rank[s, i], pend_m[s, i] = rank[p], p
                npend[s] = i + 1
                held[s, p] = -1.0
            if s > 0:
                arrive_s, arrive_m, arrive_t = s - 1, m, end + send[s - 1, m]
                dirty[ndirty], ndirty = s - 1, ndirty + 1
        else:  # the stage's admitted forward
            m = cand[s]
            if s == 0:
                in_wait[m] = False
                rank[m] = n_seq
                seq[n_seq] = m
                n_seq += 1
            else:
                next_f[s] += 1
            end = t + fwd[s, m]
            f_end[s, m] = end
            live[s, m] = True
            nlive[s] += 1
            live_stored[s] += stored[s, m]
            if peak[s, m] > live_peak[s]:
                live_peak[s] = peak[s, m]
            out[s, nout[s]] = 2 * m
            nout[s] += 1
            if s == last:
                arrive_s, arrive_m, arrive_t = s, m, end
            else:
                dirty[ndirty], ndirty = s + 1, ndirty + 1
        if arrive_s >= 0:  # the output gradient of arrive_m is at stage arrive_s (the loss, on the last stage)
            a, m = arrive_s, arrive_m
            if nxt[m] >= 0 and not b_done[a, nxt[m]]:
                held[a, m] = arrive_t
            else:
                i = npend[a]
                pend_ready[a, i], pend_rank[a, i], pend_m[a, i] = arrive_t, rank[m], m
                npend[a] = i + 1
        free[s] = end
        dirty[ndirty], ndirty = s, ndirty + 1
    return out, nout
