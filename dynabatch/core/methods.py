"""Batching methods: the dynamic planner and the baseline batchers, each name registered once.

``dynamic`` plans micro-batches with the cost model (:mod:`dynabatch.plan`); each baseline cuts a global batch
by a fixed rule, and its batcher, knob and tuning grid live in :data:`dynabatch.data.baselines.BASELINES`, keyed
by the names here. ``--method`` choices, ``DynaBatchDataLoader(method=...)`` and the ``plan`` / ``simulate``
method lists all read :data:`METHODS`.
"""

from __future__ import annotations

from dynabatch.core.registry import Registry

DYNAMIC = "dynamic"
PADDING, LENGTH_GROUPED, TOKEN_BUDGET, PACKING, PACKING_FREE = (
    "padding", "length_grouped", "token_budget", "packing", "packing_free")

BASELINE_METHODS = Registry("baseline method", [
    (PADDING, "fixed samples per micro-batch in stream order, padded to the micro-batch max"),
    (LENGTH_GROUPED, "sorted by length, then fixed samples per micro-batch (HF group_by_length)"),
    (TOKEN_BUDGET, "sorted, as many samples as fit a padded-token budget (fairseq max_tokens)"),
    (PACKING, "best-fit-decreasing rows of the max length, dense block-diagonal masks (DynaPipe's baseline)"),
    (PACKING_FREE, "the same rows, padding-free, attention per sample (TRL packing with padding_free)"),
])
"""The baseline batchers, in the order commands list them."""

METHODS = Registry("batching method", [(DYNAMIC, "the planner")]) + BASELINE_METHODS
"""Every batching method: ``dynamic`` then the baselines."""
