"""numba kernel of the lowering passes (:mod:`dynabatch.schedule.lower`): one call from compute orders to
per-stage instruction rows with slots.

It runs passes 1-5 of :mod:`dynabatch.schedule.lower` (dataflow times, link orders, communication, send
waits and frees, slots) on integer arrays, step for step as the pure-Python passes there do, which stay the
readable reference: ``lower`` builds the same instructions from these rows (tested equal, text and binary
forms, on random compute orders). Inputs: ``codes[s, k] = 2 m + 1`` for the backward of micro-batch ``m``,
``2 m`` for its forward (every stage runs ``2 M`` ops, :mod:`dynabatch.schedule._kernels`' convention), and
``(S, M)`` float64 forward and backward durations.

Output rows ``(code, micro-batch, peer stage, slot)`` per stage, codes :data:`ROW_CODES` (``REDUCE`` and
``STEP`` are not rows: they end every list). A kernel error code other than 0 means the pure-Python passes
must run instead, which raise the readable error (1: the compute orders deadlock; 2: a link order is
inconsistent with a stage's compute order; 3: the communication lowering deadlocked).
"""

from __future__ import annotations

import numpy as np
from numba import njit

LOAD, FWD, BWD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = 0, 1, 2, 3, 4, 5, 6
WAIT_SEND_ACT, WAIT_RECV_ACT, WAIT_SEND_GRAD, WAIT_RECV_GRAD, FREE = 7, 8, 9, 10, 11
ROW_CODES = ("LOAD", "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
             "WAIT_SEND_F", "WAIT_RECV_F", "WAIT_SEND_B", "WAIT_RECV_B", "FREE")
"""Row code -> instruction key name (:attr:`dynabatch.schedule.ir.Instr.key` without stage and micro-batch)."""


@njit(cache=True, nogil=True)
def _dataflow(codes, fwd, bwd):
    """Pass 1: ``(start, end, order, ran)`` per op; ``order`` is the global topological counter of the
    dataflow loop (stages in turn, each as far as its inputs allow); ``ran < 2M`` on a stage: deadlock."""
    S, n = codes.shape
    M = fwd.shape[1]
    end_f = np.full((S, M), -1.0)
    end_b = np.full((S, M), -1.0)
    start = np.zeros((S, n))
    end = np.zeros((S, n))
    order = np.zeros((S, n), np.int64)
    pos = np.zeros(S, np.int64)
    free_at = np.zeros(S)
    counter = 0
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pos[s] < n:
                code = codes[s, pos[s]]
                m = code >> 1
                if code & 1:
                    dep = end_b[s + 1, m] if s < S - 1 else end_f[s, m]
                    dur = bwd[s, m]
                else:
                    dep = end_f[s - 1, m] if s > 0 else 0.0
                    dur = fwd[s, m]
                if dep < 0:
                    break
                t0 = free_at[s] if free_at[s] >= dep else dep
                t1 = t0 + dur
                free_at[s] = t1
                if code & 1:
                    end_b[s, m] = t1
                else:
                    end_f[s, m] = t1
                start[s, pos[s]], end[s, pos[s]], order[s, pos[s]] = t0, t1, counter
                counter += 1
                pos[s] += 1
                progress = True
    return start, end, order, pos


@njit(cache=True, nogil=True)
def _link_orders(codes, end, order):
    """Pass 2: per link ``(s, s + 1)``, its ``2 M`` messages sorted by (send time, topological index):
    ``(kind, micro-batch, sender, time)`` arrays ``(S - 1, 2M)``, kind 0 an activation, 1 a gradient;
    ``at[link, kind, m]``: the message's position on its link.

    A link's messages are stage ``s``'s forwards and stage ``s + 1``'s backwards, each already in that order
    along its stage's list (a stage's ops end one after another and the index grows), so one merge of the two
    sorts them; the keys are unique (the index is), so this is the sort of the reference pass."""
    S, n = codes.shape
    L = max(S - 1, 0)
    kind = np.zeros((L, n), np.int64)
    mb = np.zeros((L, n), np.int64)
    src = np.zeros((L, n), np.int64)
    time = np.zeros((L, n))
    at = np.zeros((L, 2, n // 2), np.int64)
    for link in range(L):
        a, b = 0, 0  # next op of stage link (its forwards) and of stage link + 1 (its backwards)
        for p in range(n):
            while a < n and codes[link, a] & 1:
                a += 1
            while b < n and codes[link + 1, b] & 1 == 0:
                b += 1
            take_a = b == n or (a < n and (end[link, a] < end[link + 1, b] or (
                end[link, a] == end[link + 1, b] and order[link, a] < order[link + 1, b])))
            s, i = (link, a) if take_a else (link + 1, b)
            k = codes[s, i] & 1
            kind[link, p], mb[link, p], src[link, p], time[link, p] = k, codes[s, i] >> 1, s, end[s, i]
            at[link, k, codes[s, i] >> 1] = p
            if take_a:
                a += 1
            else:
                b += 1
    return kind, mb, src, time, at


@njit(cache=True, nogil=True)
def _issue(link, upto, ptr, s, kind, mb, src, rows, cnt):
    """Append stage ``s``'s ops on ``link`` up to link position ``upto``; ``(ptr, cnt, ok)``."""
    while ptr <= upto:
        k, m = kind[link, ptr], mb[link, ptr]
        if src[link, ptr] == s:
            if ptr != upto:  # an own send must be the target: it follows its compute
                return ptr, cnt, False
            rows[cnt, 0], rows[cnt, 2] = (SEND_ACT, s + 1) if k == 0 else (SEND_GRAD, s - 1)
        else:
            rows[cnt, 0], rows[cnt, 2] = (RECV_ACT if k == 0 else RECV_GRAD), src[link, ptr]
        rows[cnt, 1] = m
        cnt += 1
        ptr += 1
    return ptr, cnt, True


@njit(cache=True, nogil=True)
def _add_comms(codes, start, kind, mb, src, time, at, rows, counts):
    """Pass 3 into ``rows[s]`` (``(code, m, peer stage, -)``); ``False`` when a link order is inconsistent."""
    S, n = codes.shape
    for s in range(S):
        ptr = np.zeros(2, np.int64)  # progress on link s - 1 (index 0) and link s (index 1)
        cnt = 0
        r = rows[s]
        for i in range(n):
            code = codes[s, i]
            m = code >> 1
            for side in range(2):  # post receives of messages sent by this op's start
                link = s - 1 + side
                if 0 <= link < S - 1:
                    while ptr[side] < n and src[link, ptr[side]] != s and time[link, ptr[side]] <= start[s, i]:
                        ptr[side], cnt, ok = _issue(link, ptr[side], ptr[side], s, kind, mb, src, r, cnt)
            if code & 1 == 0:
                if s > 0:
                    ptr[0], cnt, ok = _issue(s - 1, at[s - 1, 0, m], ptr[0], s, kind, mb, src, r, cnt)
                    if not ok:
                        return False
                r[cnt, 0], r[cnt, 1] = LOAD, m
                cnt += 1
                if s > 0:
                    r[cnt, 0], r[cnt, 1], r[cnt, 2] = WAIT_RECV_ACT, m, s - 1
                    cnt += 1
                r[cnt, 0], r[cnt, 1] = FWD, m
                cnt += 1
                if s < S - 1:
                    ptr[1], cnt, ok = _issue(s, at[s, 0, m], ptr[1], s, kind, mb, src, r, cnt)
                    if not ok:
                        return False
            else:
                if s < S - 1:
                    ptr[1], cnt, ok = _issue(s, at[s, 1, m], ptr[1], s, kind, mb, src, r, cnt)
                    if not ok:
                        return False
                    r[cnt, 0], r[cnt, 1], r[cnt, 2] = WAIT_RECV_GRAD, m, s + 1
                    cnt += 1
                r[cnt, 0], r[cnt, 1] = BWD, m
                cnt += 1
                if s > 0:
                    ptr[0], cnt, ok = _issue(s - 1, at[s - 1, 1, m], ptr[0], s, kind, mb, src, r, cnt)
                    if not ok:
                        return False
        if (s > 0 and ptr[0] != n) or (s < S - 1 and ptr[1] != n):
            return False
        counts[s] = cnt
    return True


@njit(cache=True, nogil=True)
def _receive_clocks(rows, counts, M):
    """Vector clocks of :func:`dynabatch.schedule.lower._receive_clocks`: ``(positions, clocks, n, ok)``, per
    stage the index of each receive wait and the clock after it (``clocks[s, k, q]``: ops ``q`` executed)."""
    S = rows.shape[0]
    cap = 2 * M
    clocks = np.zeros((S, S), np.int64)
    sent = np.zeros((S, 2, M, S), np.int64)
    has_sent = np.zeros((S, 2, M), np.bool_)
    positions = np.zeros((S, cap), np.int64)
    cps = np.zeros((S, cap, S), np.int64)
    ncp = np.zeros(S, np.int64)
    pc = np.zeros(S, np.int64)
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pc[s] < counts[s]:
                code, m, q = rows[s, pc[s], 0], rows[s, pc[s], 1], rows[s, pc[s], 2]
                if code == WAIT_RECV_ACT or code == WAIT_RECV_GRAD:
                    k = 0 if code == WAIT_RECV_ACT else 1
                    if not has_sent[q, k, m]:
                        break
                    for x in range(S):
                        if sent[q, k, m, x] > clocks[s, x]:
                            clocks[s, x] = sent[q, k, m, x]
                    clocks[s, s] = pc[s] + 1
                    positions[s, ncp[s]] = pc[s]
                    for x in range(S):  # explicit loops: slice assignment costs seconds of compile time
                        cps[s, ncp[s], x] = clocks[s, x]
                    ncp[s] += 1
                clocks[s, s] = pc[s] + 1
                if code == SEND_ACT or code == SEND_GRAD:
                    k = 0 if code == SEND_ACT else 1
                    for x in range(S):
                        sent[s, k, m, x] = clocks[s, x]
                    has_sent[s, k, m] = True
                pc[s] += 1
                progress = True
    ok = True
    for s in range(S):
        if pc[s] != counts[s]:
            ok = False
    return positions, cps, ncp, ok


@njit(cache=True, nogil=True)
def _bisect_right(a, n, x):
    """Insertion point of ``x`` after any equal entries in the sorted ``a[:n]`` (``bisect.bisect_right``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(cache=True, nogil=True)
def _add_send_waits(rows, counts, M, out, out_counts):
    """Pass 4 (:func:`dynabatch.schedule.lower.add_send_waits` without ``REDUCE``/``STEP``) from ``rows`` into
    ``out``; ``False`` when the communication lowering deadlocked. Each send's wait goes right after the
    first receive wait whose clock shows the peer posted the matching receive (or to the end); the waits
    of one anchor keep their sends' order (``first``/``after`` chain them per anchor, ``n``: the end)."""
    S = rows.shape[0]
    positions, cps, ncp, ok = _receive_clocks(rows, counts, M)
    if not ok:
        return False
    recv_pos = np.zeros((S, 2, M), np.int64)
    for s in range(S):
        for i in range(counts[s]):
            code = rows[s, i, 0]
            if code == RECV_ACT or code == RECV_GRAD:
                recv_pos[s, 0 if code == RECV_ACT else 1, rows[s, i, 1]] = i
    for s in range(S):
        n, nc = counts[s], ncp[s]
        first = np.full(n + 1, -1, np.int64)  # per anchor, its first and last wait
        last = np.full(n + 1, -1, np.int64)
        after = np.full(n, -1, np.int64)  # per wait (indexed by its send), the next wait of its anchor
        clock_q = np.empty(nc, np.int64)
        pending = np.zeros(M, np.int64)
        for i in range(n):
            code = rows[s, i, 0]
            if code != SEND_ACT and code != SEND_GRAD:
                continue
            m, q = rows[s, i, 1], rows[s, i, 2]
            j = recv_pos[q, 0 if code == SEND_ACT else 1, m]
            for c in range(nc):
                clock_q[c] = cps[s, c, q]  # clocks only grow along the list
            k = max(_bisect_right(positions[s], nc, i), _bisect_right(clock_q, nc, j))
            anchor = positions[s, k] if k < nc else n
            if first[anchor] < 0:
                first[anchor] = i
            else:
                after[last[anchor]] = i
            last[anchor] = i
            pending[m] += 1
        done = np.zeros(M, np.bool_)
        o = out[s]
        c = 0
        for i in range(n + 1):
            if i < n:
                o[c, 0], o[c, 1], o[c, 2] = rows[s, i, 0], rows[s, i, 1], rows[s, i, 2]
                c += 1
                if rows[s, i, 0] == BWD:
                    m = rows[s, i, 1]
                    done[m] = True
                    if pending[m] == 0:
                        o[c, 0], o[c, 1] = FREE, m
                        c += 1
            w = first[i]
            while w >= 0:
                m = rows[s, w, 1]
                o[c, 0] = WAIT_SEND_ACT if rows[s, w, 0] == SEND_ACT else WAIT_SEND_GRAD
                o[c, 1], o[c, 2] = m, rows[s, w, 2]
                c += 1
                pending[m] -= 1
                if done[m] and pending[m] == 0:
                    o[c, 0], o[c, 1] = FREE, m
                    c += 1
                w = after[w]
        out_counts[s] = c
    return True


@njit(cache=True, nogil=True)
def _assign_slots(out, out_counts, M):
    """Pass 5 for one stage per list (:func:`dynabatch.schedule.lower.assign_slots`): column 3 gets each
    micro-batch's slot, the lowest free one at its first row, released at its ``FREE``; slots per stage."""
    S = out.shape[0]
    num_slots = np.zeros(S, np.int64)
    for s in range(S):
        slot_of = np.full(M, -1, np.int64)
        free = np.zeros(M + 1, np.bool_)
        n_slots = 0
        for i in range(out_counts[s]):
            m = out[s, i, 1]
            slot = slot_of[m]
            if slot < 0:
                slot = n_slots
                for j in range(n_slots):
                    if free[j]:
                        slot = j
                        break
                if slot == n_slots:
                    n_slots += 1
                free[slot] = False
                slot_of[m] = slot
            out[s, i, 3] = slot
            if out[s, i, 0] == FREE:
                free[slot] = True
                slot_of[m] = -1
        num_slots[s] = n_slots
    return num_slots


@njit(cache=True, nogil=True)
def lower_rows(codes, fwd, bwd):
    """Passes 1-5: ``(rows (S, 12M, 4), counts (S,), slots (S,), error)``; ``error`` as the module says."""
    S, n = codes.shape
    M = n // 2
    cap = 12 * M + 2
    rows = np.full((S, cap, 4), -1, np.int64)
    counts = np.zeros(S, np.int64)
    out = np.full((S, cap, 4), -1, np.int64)
    out_counts = np.zeros(S, np.int64)
    start, end, order, ran = _dataflow(codes, fwd, bwd)
    for s in range(S):
        if ran[s] < n:
            return out, out_counts, counts, 1
    kind, mb, src, time, at = _link_orders(codes, end, order)
    if not _add_comms(codes, start, kind, mb, src, time, at, rows, counts):
        return out, out_counts, counts, 2
    if not _add_send_waits(rows, counts, M, out, out_counts):
        return out, out_counts, counts, 3
    return out, out_counts, _assign_slots(out, out_counts, M), 0
