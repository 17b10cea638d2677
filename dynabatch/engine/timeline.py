"""Measured timelines: the executor's per-instruction times as :class:`~dynabatch.schedule.trace.TimelineOp`.

Every :class:`~dynabatch.engine.executor.StepResult` carries ``(key, start, end)`` for each
instruction, in ``time.perf_counter`` seconds. :func:`measured_ops` keeps the forwards and backwards
of one rank; :func:`gather_timelines` collects them on rank 0 per replica, relative to the earliest
start in that replica, so :func:`dynabatch.schedule.trace.write_chrome_trace` writes executed steps
exactly like simulated ones. ``perf_counter`` is the system-wide monotonic clock on Linux, so ranks of
one machine share a time base; across machines, offsets are only as good as their clocks' agreement.
"""

from __future__ import annotations

import re

from dynabatch.engine.dist import DistContext, gather_to_planner
from dynabatch.engine.executor import StepResult
from dynabatch.schedule.compute import Phase
from dynabatch.schedule.trace import TimelineOp

_COMPUTE_KEY = re.compile(r"(\d+)([FB])(\d+)\Z")


def measured_ops(timeline, origin: float = 0.0) -> list[TimelineOp]:
    """Forward/backward ops of one rank's ``(key, start, end)`` list, times relative to ``origin``."""
    ops = []
    for key, t0, t1 in timeline:
        m = _COMPUTE_KEY.match(key)
        if m:
            ops.append(TimelineOp(int(m.group(1)), Phase(m.group(2)), int(m.group(3)), t0 - origin, t1 - origin))
    return ops


def gather_timelines(ctx: DistContext, result: StepResult) -> dict[int, list[TimelineOp]] | None:
    """Collective over the world: rank 0 gets ``{replica: ops of all its stages}``, others ``None``."""
    gathered = gather_to_planner(ctx, result.timeline, f"step {result.step}'s timelines")
    if not ctx.is_planner:
        return None
    out: dict[int, list[TimelineOp]] = {}
    for p in range(ctx.num_replicas):
        lists = [gathered[ctx.rank_of(p, s)] for s in range(ctx.num_stages)]
        starts = [t0 for tl in lists for _, t0, _ in tl]
        origin = min(starts) if starts else 0.0
        out[p] = [op for tl in lists for op in measured_ops(tl, origin)]
    return out
