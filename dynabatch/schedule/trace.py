"""Timelines of a training step: Chrome-trace JSON (open in Perfetto / chrome://tracing) and a PNG.

One format for simulated and executed steps: a step is a list of :class:`TimelineOp` (stage, phase,
micro-batch, start and end in seconds, optionally the stage's memory while it ran). The simulator's
:class:`~dynabatch.schedule.simulate.SimResult` converts with :func:`timeline_ops`; the runtime builds
the same list from measured times, so both go through :func:`to_chrome_trace` and
:func:`read_chrome_trace` and can be compared op by op.

Chrome trace layout: ``pid`` = one pipeline (simulated or executed step), ``tid`` = stage; each op is a
complete event (``ph: "X"``) named ``F3`` / ``B3`` with category ``forward`` / ``backward``, ``ts`` and
``dur`` in microseconds and ``args`` holding ``micro_batch``, ``stage``, the micro-batch ``shape``
``[rows, E, D]`` when known and ``memory_gib`` when known. Memory also appears as one counter track
per stage (``ph: "C"``, named ``memory stage s``, value in GiB while each op runs and after it ends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from dynabatch.schedule.compute import Phase
from dynabatch.schedule.simulate import SimResult

_CATEGORY = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward"}
_COLORS = {Phase.FORWARD: "#4C78A8", Phase.BACKWARD: "#F58518"}
GIB = 2**30


@dataclass(frozen=True, slots=True)
class TimelineOp:
    """One forward or backward as it ran (or was simulated) on one stage."""

    stage: int
    phase: Phase
    micro_batch: int
    start_s: float
    """Start, seconds from the start of the step."""
    end_s: float
    """End, seconds from the start of the step."""
    memory_bytes: float | None = None
    """Memory of the stage while the op ran (simulated, or measured by the runtime), if known."""
    after_memory_bytes: float | None = None
    """Memory of the stage after the op ended, if known."""

    @property
    def name(self) -> str:
        return f"{self.phase.value}{self.micro_batch}"


Timeline = Union[SimResult, Sequence[TimelineOp]]


def timeline_ops(timeline: Timeline) -> list[TimelineOp]:
    """The ops of a simulated step (in stage, then list order), or ``timeline`` itself as a list."""
    if not isinstance(timeline, SimResult):
        return list(timeline)
    r = timeline
    ops = []
    for s, stage_ops in enumerate(r.schedule.stages):
        for k, op in enumerate(stage_ops):
            ops.append(TimelineOp(s, op.phase, op.micro_batch, float(r.start_s[s, k]), float(r.end_s[s, k]),
                                  float(r.op_memory_bytes[s, k]), float(r.after_memory_bytes[s, k])))
    return ops


def to_chrome_trace(timeline: Timeline, *, shapes=None, pid: int = 0, process_name: str = "simulated step") -> dict:
    """Chrome-trace dict (``{"traceEvents": [...], ...}``) of a step; ``shapes``: optional ``(M, 3)``
    micro-batch shapes ``(rows, E, D)`` added to each op's ``args``."""
    ops = timeline_ops(timeline)
    shapes = None if shapes is None else np.asarray(shapes).tolist()
    stages = sorted({op.stage for op in ops})
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}]
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": s, "args": {"name": f"stage {s}"}} for s in stages]
    for op in ops:
        args = {"micro_batch": op.micro_batch, "stage": op.stage}
        if shapes is not None:
            if not 0 <= op.micro_batch < len(shapes):
                raise ValueError(f"micro-batch {op.micro_batch} has no shape; shapes has {len(shapes)} rows")
            args["shape"] = [int(x) for x in shapes[op.micro_batch]]
        if op.memory_bytes is not None:
            args["memory_gib"] = op.memory_bytes / GIB
        events.append({
            "name": op.name, "cat": _CATEGORY[op.phase], "ph": "X", "pid": pid, "tid": op.stage,
            "ts": op.start_s * 1e6, "dur": (op.end_s - op.start_s) * 1e6, "args": args,
        })
        for ts, value in ((op.start_s, op.memory_bytes), (op.end_s, op.after_memory_bytes)):
            if value is not None:
                events.append({"name": f"memory stage {op.stage}", "ph": "C", "pid": pid, "ts": ts * 1e6,
                               "args": {"GiB": value / GIB}})
    other = {}
    if isinstance(timeline, SimResult):
        other = {"policy": timeline.schedule.policy, "makespan_s": timeline.makespan_s,
                 "bubble_fraction": timeline.bubble_fraction, "fits_memory": timeline.fits_memory,
                 "schedule": str(timeline.schedule)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(timeline: Timeline, path: str, **kwargs) -> None:
    """Write :func:`to_chrome_trace` of ``timeline`` as JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_chrome_trace(timeline, **kwargs), f)


def read_chrome_trace(trace: Union[str, dict], pid: int | None = None) -> list[TimelineOp]:
    """The ops of a trace written by :func:`write_chrome_trace` (or by the runtime), for comparison;
    ``pid`` selects one pipeline when a trace holds several."""
    if isinstance(trace, str):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    ops = []
    for ev in trace["traceEvents"]:
        if ev.get("ph") != "X" or ev.get("cat") not in ("forward", "backward"):
            continue
        if pid is not None and ev["pid"] != pid:
            continue
        mem = ev.get("args", {}).get("memory_gib")
        ops.append(TimelineOp(int(ev["tid"]), Phase.FORWARD if ev["cat"] == "forward" else Phase.BACKWARD,
                              int(ev["args"]["micro_batch"]), ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6,
                              None if mem is None else mem * GIB))
    return ops


def plot_timeline(timeline: Timeline, path: str, *, title: str | None = None, memory: bool = True,
                  memory_limit_bytes=None, software: str = "dynabatch") -> None:
    """Gantt chart of a step, one row per stage (forwards blue, backwards orange, labelled with the
    micro-batch), and below it each stage's memory over time when known. Writes a PNG to ``path``, its
    ``Software`` text ``software`` (how a later run knows the file as dynabatch's to replace:
    :data:`dynabatch.commands.output_files.PNG_MARK`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = timeline_ops(timeline)
    if not ops:
        raise ValueError("cannot plot an empty timeline")
    stages = max(op.stage for op in ops) + 1
    show_mem = memory and all(op.memory_bytes is not None for op in ops)
    if memory_limit_bytes is None and isinstance(timeline, SimResult) and timeline.memory_limit_bytes is not None:
        memory_limit_bytes = float(timeline.memory_limit_bytes.min())
    height = 1.2 + 0.55 * stages + (2.6 if show_mem else 0)
    fig, axes = plt.subplots(2 if show_mem else 1, 1, figsize=(13, height), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [stages, 3] if show_mem else [1]})
    ax = axes[0, 0]
    scale, unit = (1e3, "ms") if max(op.end_s for op in ops) < 10 else (1.0, "s")
    end = max(op.end_s for op in ops) * scale
    for op in ops:
        x0, w = op.start_s * scale, (op.end_s - op.start_s) * scale
        ax.broken_barh([(x0, w)], (op.stage - 0.4, 0.8), facecolors=_COLORS[op.phase], edgecolor="white", linewidth=0.4)
        if w > end / 90:
            ax.text(x0 + w / 2, op.stage, str(op.micro_batch), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_xlim(0, end)
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLORS[p]) for p in (Phase.FORWARD, Phase.BACKWARD)]
    ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=7, ncol=2)
    if title:
        ax.set_title(title, fontsize=9)
    if show_mem:
        mx = axes[1, 0]
        for s in range(stages):
            pts = []
            for op in sorted((o for o in ops if o.stage == s), key=lambda o: o.start_s):
                pts += [(op.start_s, op.memory_bytes), (op.end_s, op.after_memory_bytes if op.after_memory_bytes
                                                         is not None else op.memory_bytes)]
            t, v = zip(*pts, strict=True)
            mx.step(np.array(t) * scale, np.array(v) / GIB, where="post", label=f"stage {s}", linewidth=1)
        if memory_limit_bytes is not None:
            mx.axhline(memory_limit_bytes / GIB, color="red", linestyle="--", linewidth=0.8, label="limit")
        mx.set_ylabel("memory (GiB)")
        mx.legend(loc="upper right", fontsize=7, ncol=stages + 1)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": software})
    plt.close(fig)
