"""The files a run's ``--timeline`` writes: the last step's measured timeline next to its simulated twin
(``timeline.json``, a Chrome trace of both; ``timeline_measured.png``, ``timeline_simulated.png`` and the two
stacked in ``timeline.png``)."""

from __future__ import annotations

import json
import os

import numpy as np

from dynabatch.engine.timeline import gather_timelines
from dynabatch.schedule.placement import timeline_ops
from dynabatch.schedule.simulate import simulate
from dynabatch.schedule.trace import plot_timeline, to_chrome_trace


def write_timeline(run, result, planned) -> None:
    """Collective: the last step's measured timeline (replica 0) next to its simulated twin (``run``: the
    trainer's run, for its context, configuration and placement)."""

    measured = gather_timelines(run.ctx, result)
    if not run.ctx.is_planner:
        return
    shapes = np.asarray(planned.shapes[0], dtype=np.int64).reshape(-1, 3)
    costs = (planned.predicted_costs or planned.costs)[0]
    if run.placement is not None:  # virtual stages: the planner's list schedule, the order plan_step lowered
        simulated = timeline_ops(planned.schedules[0].device_orders)
        makespan = max(op.end_s for op in simulated)
    else:
        simulated = simulate(planned.schedules[0], costs)
        makespan = simulated.makespan_s
    out = run.cfg.output_dir
    trace = to_chrome_trace(measured[0], shapes=shapes, pid=0, process_name=f"measured step {planned.step}")
    twin = to_chrome_trace(simulated, shapes=shapes, pid=1, process_name=f"simulated step {planned.step}")
    trace["traceEvents"] += twin["traceEvents"]
    with open(os.path.join(out, "timeline.json"), "w", encoding="utf-8") as f:
        json.dump(trace, f)
    paths = [os.path.join(out, "timeline_measured.png"), os.path.join(out, "timeline_simulated.png")]
    plot_timeline(measured[0], paths[0], title=f"measured step {planned.step} ({run.cfg.method})", memory=False)
    plot_timeline(simulated, paths[1], title=f"simulated twin (cost model), makespan {makespan:.3f} s",
                  memory=False)
    _stack_pngs(paths, os.path.join(out, "timeline.png"))


def _stack_pngs(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = [plt.imread(p) for p in paths]
    fig, axes = plt.subplots(len(images), 1, figsize=(12, 3.2 * len(images)))
    for ax, img in zip(axes, images):
        ax.imshow(img)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
