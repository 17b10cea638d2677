"""Measured real-token throughput of every batching method on the same executor (``dynabatch bench``).

    python scripts/bench_throughput.py --model t5 --max-input-len 2048 --steps 10 --json t5.json
    python scripts/bench_throughput.py --model gpt --lengths my_lengths.npz --json gpt.json
    python scripts/bench_throughput.py --plot docs/benchmarks/cpu_dense_masks/bench_cpu.png t5.json gpt.json   # plot saved results

See :mod:`dynabatch.commands.bench` for what is measured and how the methods are interleaved (``dynamic``,
the four baselines and the external peer ``pipelining``, torch.distributed.pipelining's Schedule1F1B).
The last line printed is a JSON object with every method's real tokens/s. The plot
shows, per results file, each method's real tokens/s relative to the best baseline (bars: the ratio of
summed tokens over summed time; whiskers: the 10-90% range of the per-step paired ratios).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dynabatch.cli import main  # noqa: E402
from dynabatch.commands.bench import METHODS  # noqa: E402


def plot(out: str, files: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = []
    for path in files:
        with open(path) as f:
            results.append(json.load(f))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(results)), 4))
    width = 0.8 / len(METHODS)
    for k, m in enumerate(METHODS):
        x = np.arange(len(results)) + (k - (len(METHODS) - 1) / 2) * width
        rows = [r["methods"].get(m) for r in results]
        y = [row["ratio_to_best_baseline"] if row else np.nan for row in rows]
        lo = [row["ratio_to_best_baseline"] - row["paired_ratio_to_best_baseline"]["p10"] if row else 0 for row in rows]
        hi = [row["paired_ratio_to_best_baseline"]["p90"] - row["ratio_to_best_baseline"] if row else 0 for row in rows]
        ax.bar(x, y, width, label=m, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=2)
    labels = []
    for r in results:
        c = r["config"]
        src = os.path.basename(c["lengths"]) if c["lengths"] else "built-in"
        labels.append(f"{c['model']}\n{src}, L={c['max_input_len']}")
    ax.set_xticks(np.arange(len(results)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("real tokens/s / best baseline")
    ax.set_title(f"measured on CPU ({results[0]['machine']['cpus']} cores, 2 stages, gloo), interleaved steps")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    sys.exit(main(["bench", *sys.argv[1:]]))
