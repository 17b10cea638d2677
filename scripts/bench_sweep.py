"""Max-length sweep: where the dynamic method's throughput gain over the baselines comes from (simulated).

The FLAN-like lengths of ``scripts/bench_schedule.py`` (fixed seed), cut at each max length (T5: encoder
limit L, decoder limit L/4; GPT: sequence limit L), 65,536-token global batches, every method
(each baseline at its best micro-batch size of :data:`KNOBS` unless ``--no-tune``) planned, scheduled
by ``choose_schedule`` and simulated with the analytic model (``dynabatch simulate``).
Per model, max length and method it prints real tokens/s, padding efficiency (real / computed tokens),
the bubble fraction, and dynamic's ratio to packing split into three factors whose product is the ratio:

    ratio = (pad_eff_dyn / pad_eff_pack)                 fewer padded tokens
          * ((1 - bubble_dyn) / (1 - bubble_pack))       less pipeline idle time
          * (busy time per computed token, pack / dyn)   cheaper tokens (shorter attention rows, bigger GEMMs)

The third factor is what is left (ratio / the first two). ``--plot`` draws tokens/s relative to packing
per method over the max length (one panel per model), with measured CPU points overlaid when
``--measured L=file.json`` (``dynabatch bench`` JSON files) are given.

    python scripts/bench_sweep.py --lengths 512,1024,2048 --plot docs/benchmarks/simulated/max_length_sweep.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_schedule import write_flan_like  # noqa: E402

from dynabatch.commands.common import add_workload_arguments, resolve  # noqa: E402
from dynabatch.training.workload import global_batches  # noqa: E402
from dynabatch.core.methods import whole_sample_baselines  # noqa: E402


from dynabatch.data.baselines import BASELINES  # noqa: E402

KNOBS = {name: (spec.option, spec.grid) for name, spec in BASELINES.items()}
"""Each baseline's micro-batch size knob and the values tried (--tune): the registry's grids."""


SWEPT = ("dynamic", *whole_sample_baselines("causal"))
"""The methods swept: dynamic and the baselines that train on whole samples (the same for T5 and GPT;
``packing_free_split`` changes the objective and is left out)."""


def simulate_tuned(batches, w, options=None, tune: bool = True) -> dict:
    """``{method: (MethodSummary, knob value)}``; with ``tune`` each baseline keeps its fastest knob value
    among those that fit memory (all of them if none fits), else the defaults of ``w.options``."""
    import dataclasses

    from dynabatch.commands.simulate import SimulateOptions, simulate_method

    options = options or SimulateOptions()
    out = {"dynamic": (simulate_method("dynamic", batches, w, options), None)}
    for m in whole_sample_baselines(w.family):
        name, values = KNOBS[m]
        if not tune:
            values = (getattr(w.options, name),)
        tried = []
        for v in values:
            wv = dataclasses.replace(w, options=dataclasses.replace(w.options, **{name: v}))
            tried.append((simulate_method(m, batches, wv, options), v))
        fitting = [t for t in tried if t[0].fits_memory] or tried
        out[m] = max(fitting, key=lambda t: t[0].tokens_per_s)
    return out


def sweep_point(path: str, model: str, max_len: int, num_batches: int, hardware: str, stages: int,
                preset: str | None = None, tune: bool = True) -> dict:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    argv = ["--lengths", path, "--model", model, "--max-input-len", str(max_len), "--max-target-len",
            str(max(64, max_len // 4)), "--num-batches", str(num_batches), "--hardware", hardware,
            "--stages", str(stages)]
    if preset:
        argv += ["--preset", preset]
    args = parser.parse_args(argv)
    w = resolve(args)
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches)
    rows = simulate_tuned(batches, w, tune=tune)
    return {m: {"tokens_per_s": r.tokens_per_s, "padding_efficiency": r.padding_efficiency,
                "bubble_fraction": r.bubble_fraction, "fits_memory": r.fits_memory,
                "computed_tokens": r.computed_tokens, "step_s": r.step_s, "knob": knob,
                "micro_batches": r.micro_batches} for m, (r, knob) in rows.items()}


def factors(rows: dict, ref: str = "packing") -> dict:
    d, p = rows["dynamic"], rows[ref]
    ratio = d["tokens_per_s"] / p["tokens_per_s"]
    pad = d["padding_efficiency"] / p["padding_efficiency"]
    bubble = (1 - d["bubble_fraction"]) / (1 - p["bubble_fraction"])
    return {"ratio": ratio, "padding": pad, "bubble": bubble, "per_token": ratio / (pad * bubble)}


def plot(results: dict, measured: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        lens = sorted(results[model])
        for m in SWEPT:
            y = [results[model][L][m]["tokens_per_s"] / results[model][L]["packing"]["tokens_per_s"] for L in lens]
            ax.plot(lens, y, marker="o", label=m, lw=2.5 if m == "dynamic" else 1.2)
        for L, (mname, path) in measured.get(model, {}).items():
            with open(path) as f:
                r = json.load(f)["methods"]
            ax.scatter([L], [r["dynamic"]["tokens_per_s"] / r["packing"]["tokens_per_s"]], marker="*", s=160,
                       color="black", zorder=5, label=f"measured CPU ({mname}), dynamic" if L == min(measured[model]) else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens)
        ax.set_xticklabels([str(L) for L in lens])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("max length (T5: encoder; GPT: sequence)")
        ax.set_ylabel("real tokens/s relative to packing")
        ax.set_title(f"{model.upper()} (simulated, analytic model)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,1024,2048", help="comma list of max lengths")
    p.add_argument("--models", default="t5,gpt")
    p.add_argument("--hardware", default="a100-40gb")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--plot", default=None, help="write the plot here (PNG)")
    p.add_argument("--measured", action="append", default=[],
                   help="MODEL:L:NAME=bench.json, e.g. t5:512:t5-tiny=/tmp/t5.json (repeatable; overlaid on the plot)")
    p.add_argument("--no-tune", action="store_true",
                   help="baselines keep their default micro-batch sizes instead of the best of KNOBS")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    path = os.path.join(tempfile.mkdtemp(prefix="bench-sweep-"), "flan_like.npz")
    write_flan_like(path)
    results: dict = {}
    start = time.perf_counter()
    print(f"{'model':<5} {'L':>5} | " + " ".join(f"{m[:12]:>12}" for m in SWEPT)
          + " | dyn/pack = padding x bubble x per-token | dyn/best")
    for model in a.models.split(","):
        results[model] = {}
        for L in (int(x) for x in a.lengths.split(",")):
            rows = sweep_point(path, model, L, a.num_batches, a.hardware, a.stages, tune=not a.no_tune)
            results[model][L] = rows
            f = factors(rows)
            fitting = [r["tokens_per_s"] for m, r in rows.items() if m != "dynamic" and r["fits_memory"]]
            best = max(fitting) if fitting else float("nan")
            cells = " ".join(f"{rows[m]['tokens_per_s'] / 1e3:>6.1f}k/{rows[m]['padding_efficiency']:.2f}"
                             + ("" if rows[m]["fits_memory"] else "*") for m in SWEPT)
            print(f"{model:<5} {L:>5} | {cells} | {f['ratio']:.2f} = {f['padding']:.2f} x {f['bubble']:.2f} x "
                  f"{f['per_token']:.2f} | {rows['dynamic']['tokens_per_s'] / best:.2f}")
            sys.stdout.flush()
    print("cells: real tokens/s / padding efficiency (* = does not fit memory); baselines "
          + ("at their defaults" if a.no_tune else "tuned: best micro-batch size of KNOBS") + "; "
          f"total {time.perf_counter() - start:.0f} s")
    measured: dict = {}
    for item in a.measured:
        key, _, file = item.partition("=")
        model, L, name = key.split(":")
        measured.setdefault(model, {})[int(L)] = (name, file)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({m: {str(L): v for L, v in r.items()} for m, r in results.items()}, f, indent=1)
    if a.plot:
        plot(results, measured, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
