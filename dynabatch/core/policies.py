"""Schedule, placed-schedule and recomputation policies: each name registered once.

:data:`SCHEDULE_POLICIES` order one pipeline's micro-batches (:mod:`dynabatch.schedule.policies`);
:data:`POLICY_CHOICES` adds ``auto`` (the best simulated per step) for ``--policy``. :data:`PLACED_POLICIES`
order virtual stages (:mod:`dynabatch.schedule.virtual`), :data:`RECOMPUTE_POLICIES` are ``--recompute``.
"""

from __future__ import annotations

from dynabatch.core.registry import Registry

AUTO = "auto"

SCHEDULE_POLICIES = Registry("policy", [
    ("gpipe", "all forwards, then all backwards"),
    ("1f1b", "one forward, one backward"),
    ("adaptive", "memory-aware list schedule"),
])
"""Policies a schedule is computed with."""

POLICY_CHOICES = SCHEDULE_POLICIES + Registry("policy", [(AUTO, "best simulated per step")])
"""``--policy``: a schedule policy or ``auto``."""

PLACED_POLICIES = Registry("placed policy", [
    (AUTO, "whichever simulates shorter"),
    ("list", "the list scheduler"),
    ("interleaved_1f1b", "interleaved 1F1B"),
    ("wait_free_cyclic", "DynaPipe's wait-free cyclic order"),
])
"""Orders of a step on virtual stages (placements with more than one chunk per device): the list scheduler,
interleaved 1F1B (when the micro-batches make whole rounds of the devices), DynaPipe's wait-free cyclic order
(:mod:`dynabatch.schedule.wait_free_cyclic`), or ``auto``, the shortest of them by the replay (one that fits memory
first; ties keep the earlier in this list)."""

RECOMPUTE_MODES = Registry("recompute mode", [
    ("none", "store every activation"),
    ("selective", "recompute the attention cores in backward (their inputs stay stored)"),
    ("full", "store only each transformer block's inputs and rerun the block's forward in backward"),
])
"""Activation recomputation of one micro-batch on one stage, cheapest in time first; a plan codes a mode as its
index here (:mod:`dynabatch.schedule.ir`, :mod:`dynabatch.cost.recompute`)."""

RECOMPUTE_POLICIES = Registry("recompute policy", [
    ("none", "keep every activation"),
    (AUTO, "per micro-batch and stage, the fastest of none / selective / full that fits memory"),
    ("selective", "recompute attention cores"),
    ("full", "recompute every block"),
])
"""``--recompute``: a fixed mode (``none``, ``selective``, ``full``) or ``auto`` (per micro-batch)."""
