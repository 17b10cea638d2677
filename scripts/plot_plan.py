"""Draw one dynamic plan: micro-batch shapes over a global batch (docs/plan_example.png).

Each micro-batch is a box as wide as its sample count, as tall as its padded encoder length
(above the axis) and decoder length (below); dots are the samples' own lengths, so the gap between
a dot and its box edge is padding. The same global batch cut by the token-budget baseline is drawn
underneath for comparison.

    python scripts/plot_plan.py [--lengths FILE] [--out docs/plan_example.png]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dynabatch.commands.common import add_workload_arguments, resolve  # noqa: E402
from dynabatch.training.workload import global_batches, method_micro_batches  # noqa: E402


def predicted_step(plan, cost_model, stages: int) -> float:
    """The step formula ``sum(t) + (S - 1) max(t)`` over the plan's micro-batches, each priced as ``dynabatch plan``
    prices it: per-segment (padding-free) attention, as the runtime computes it (``plan.pairs``). Without the pairs a
    packed row was priced as dense attention over its whole length, and the figure's dynamic plan looked slower than
    the baseline it beats."""
    t, _, _ = cost_model.evaluate(plan.shapes[:, 0], plan.shapes[:, 1], plan.shapes[:, 2], pairs=plan.pairs)
    return float(t.sum() + (stages - 1) * t.max())


def draw(ax, batch, plan, cost_model, stages: int, title: str) -> None:
    e, d = batch.input_lens, batch.target_lens
    x = 0
    for k, (g, (b, E, D)) in enumerate(zip(plan.groups, plan.shapes.tolist())):
        color = plt.cm.viridis(k / max(1, len(plan.groups) - 1))
        ax.add_patch(plt.Rectangle((x, 0), b, E, fill=True, alpha=0.25, color=color, lw=0))
        ax.add_patch(plt.Rectangle((x, -D), b, D, fill=True, alpha=0.25, color=color, lw=0))
        ax.add_patch(plt.Rectangle((x, -D), b, E + D, fill=False, color=color, lw=0.8))
        ids = [i for row in g.rows for i in row]
        xs = x + 0.5 + np.arange(len(ids)) * (b / max(len(ids), 1))
        ax.scatter(xs, e[ids], s=3, color="black")
        ax.scatter(xs, -d[ids], s=3, color="tab:red")
        x += b
    step = predicted_step(plan, cost_model, stages)
    ax.set_title(f"{title}: {len(plan.groups)} micro-batches, padding efficiency {plan.efficiency:.2f}, "
                 f"predicted step {step:.3f} s")
    ax.set_xlim(0, x)
    ax.set_ylim(-plan.shapes[:, 2].max() * 1.1, plan.shapes[:, 1].max() * 1.05)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_ylabel("encoder len (up) / decoder len (down)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p)
    p.add_argument("--out", default="docs/plan_example.png")
    args = p.parse_args()
    w = resolve(args)
    batch = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, 1, args.tokenizer)[0]
    stages = w.cost_model.num_stages
    fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharex=False)
    for ax, method in zip(axes, ("dynamic", "token_budget")):
        plan = method_micro_batches(method, batch, w.limits, w.cost_model, stages, w.options)
        draw(ax, batch, plan, w.cost_model, stages, method)
    axes[-1].set_xlabel("samples of one global batch (rows for packing), in micro-batch order")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
