"""How the planner lays samples into rows (``--pack-rows``), torch-free."""

from __future__ import annotations

from dynabatch.core.registry import Registry

PACK_ROWS = Registry("pack_rows", [
    ("device", "resolved per device (the pack_rows rule of dynabatch.training.config.resolve)"),
    ("auto", "plan with and without packed rows, per-segment pricing; keep the best"),
    ("off", "one sample per row"),
    ("flat", "every micro-batch one row of its samples back to back: no pad computed"),
])
"""``--pack-rows`` choices; :mod:`dynabatch.plan.step` uses this list."""

PLAN_CANDIDATES = Registry("plan_candidates", [
    ("baselines", "also price the baselines' plans of each global batch (dynabatch.plan.candidates) and run the "
                  "best predicted one"),
    ("off", "run the partition DP's plan alone"),
])
"""``--plan-candidates`` choices."""
