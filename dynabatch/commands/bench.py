"""``dynabatch bench``: measured training throughput of every batching method on the same executor.

What runs: one seeded model (``--model``, a ``dynabatch.models.presets`` name) cut into ``--stages``
pipeline stages; for each method (``dynamic``; for GPT models ``dynamic_sliced``, the same planner allowed
to cut long samples into token slices as ``dynamic train --slice-long`` does; and every baseline of
:data:`~dynabatch.data.baselines.BASELINES`: ``padding``, ``length_grouped``, ``token_budget``,
``packing``, ``packing_free``) every rank builds its own copy of its stage from the *same seed*
(identical initial weights), its own AdamW and its own :class:`~dynabatch.engine.executor.Executor`.
All methods train on the *same global batches* (drawn once on rank 0 from the built-in mixture, a
mixture spec, ``--data`` with ``--columns`` and ``--tokenizer`` read as ``train`` reads them, or a lengths
file ``.npz``/``.jsonl`` whose samples get random token ids of exactly those lengths), cut by :class:`~dynabatch.training.planner.StepPlanner` with the method, priced by the
planner's stage cost model (analytic, or ``--cost-profile``'s measured tables) and scheduled by
``--policy`` exactly as in ``dynabatch train``.

Fairness: the steps are interleaved -- step ``i`` of every method runs before step ``i + 1`` of any,
in an order rotated every step -- so slow phases of a shared machine hit all methods alike. Each
method really trains (its optimizer steps), so a method's step ``i`` sees its own weights; with equal
shapes the step time does not depend on the weights. Planning is done before the timed loop (in
``dynabatch train`` it runs ahead in a background thread) and is reported separately.

Timing: per step ``barrier; t0; train_step; barrier; t1`` (rank 0 reports), after ``--untimed-steps`` steps
that are not timed. Reported per method: real tokens/s (sum of real tokens / sum of step times, and the
median and the 10-90% range of the per-step rates), padding efficiency (real / computed tokens),
predicted bubble fraction (the simulated twin of the step), predicted peak memory per device (cost
model), measured peak memory (CUDA: max allocated over ranks; CPU: peak RSS of the process, shared by
all methods, so only one number), micro-batches per step, plan time, and the ratio of real tokens/s to
the best baseline. On our executor also the measured forward + backward seconds and busy fraction of each
device (JSON ``stage_compute_s_measured``, ``device_busy_fraction``) and ``efficiency_balanced`` (``eff
bal``): the median over the timed steps of :func:`~dynabatch.cost.ideal.balanced_efficiency`, the amortised
whole-model ideal over the plan's predicted work (one cost model) times the measured mean device busy
fraction (``None`` for ``dynamic_profiled``, planned with another profile, and for ``pipelining``).

Tuned baselines (``--tune-baselines``): each baseline in ``--methods`` also sweeps its knob over its
registry grid on the first global batches (``--tune-steps`` timed steps per value, after one untimed
step when ``--untimed-steps`` > 0, all values interleaved on one scratch executor; values over ``--memory-gib``
by the runtime's memory check, or with the same micro-batches as another value, are skipped and
reported), and its best value is then timed for the full ``--timed-steps`` with the others; the faster of
it and the default is the tuned setting (:mod:`dynabatch.commands.tuning`). ``tokens_per_s`` stays
keyed by ``--methods`` at their flags' values; ``tuned`` adds per baseline the knob, both values and
the tuned setting's tokens/s, and every method gets ``ratio_to_best_tuned_baseline``.

External peer (method ``pipelining``): ``torch.distributed.pipelining``'s ``Schedule1F1B`` over the same
stage modules (:mod:`dynabatch.engine.torch_pipelining`), fed packing's rows as fixed-shape
micro-batches (``--packing-rows`` rows of the maximal lengths each, fewer when a step has fewer than
``packing-rows x stages`` rows, as 1F1B needs a micro-batch per stage; the last micro-batch of a step is
filled with empty rows, PyTorch's schedules need equal chunks). Its step includes the same tied-gradient
sum, clipping and AdamW step. Its inputs are prepared before the timed loop (like the other methods'
plans); it is not counted as a baseline in ``best_baseline`` (the ratio targets are over the batching
methods) but every method also reports ``ratio_to_pipelining``.

Models: ``--model t5`` / ``gpt`` are the benchmark presets ``t5-d256`` (d_model 256, 4 + 4 layers) and
``gpt2-d256`` (d_model 256, 8 layers); any preset name or local checkpoint works.

Layer split (``--layer-split``, default ``data``): one split per placement, balanced over the micro-batches
every method cuts the first global batches into (:mod:`dynabatch.training.run_layout`), so all methods run on
the same stage modules; the JSON's ``layouts`` names them.

Launch: ``--stages 1`` runs in this process; with more stages and no torchrun environment the command
starts one process per stage on this machine (:func:`~dynabatch.engine.launch.launch_local`; gloo on CPU, NCCL on
GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from dynabatch.commands.bench_report import PACK_ROWS_OF, PEER, PLAN_VARIANTS
from dynabatch.commands.common import json_arg
from dynabatch.commands.tuning import SETTINGS_TRIED
from dynabatch.core.methods import DYNAMIC_SLICED
from dynabatch.data.baselines import BASELINES as BASELINE_SPECS
from dynabatch.data.baselines import option_users
from dynabatch.training.config.flags import add_fields, add_sections
from dynabatch.training.config.sections import arg


BASELINES = tuple(BASELINE_SPECS)
SLICED = DYNAMIC_SLICED
PROFILED = "dynamic_profiled"
"""``--compare-profile FILE``: dynamic planned with a `dynabatch profile` table and no calibration, next to the
calibrated methods (the online calibration's acceptance comparison)."""
UNCALIBRATED = "dynamic_uncalibrated"
"""dynamic planned with the base model alone (the analytic preset, or --cost-profile's tables), no calibration."""
NORECOMPUTE = "dynamic_norecompute"
"""dynamic planned and run with ``--recompute none`` (its plans are dynamic's under ``--plan-costs base``), next to
dynamic's ``--recompute``: what activation recomputation buys under a binding ``--memory-gib``."""
OWN_BASE = (PROFILED, UNCALIBRATED, NORECOMPUTE)
"""The dynamic variants planned ahead with their own base cost model and no calibration."""
METHODS = ("dynamic", SLICED, *BASELINES, PEER, UNCALIBRATED, NORECOMPUTE, *PACK_ROWS_OF, *PLAN_VARIANTS)
DEFAULT_METHODS = ("dynamic", SLICED, *BASELINES, PEER)
PEER_PLANS_AS = "packing"
"""The peer runs packing's rows: it is planned as packing."""


@dataclass(frozen=True)
class BenchArgs:
    """``bench``'s own flags (the others are the TrainConfig fields of :data:`BENCH_FIELDS`, as in ``train``)."""

    _argument_group_name = "bench"

    lengths: str | None = arg(None, "mixture spec (.yaml/.json/.toml) or lengths file (.npz/.jsonl with input_len, "
                                    "target_len; random token ids of exactly those lengths); default: the built-in mixture")
    methods: str | None = arg(None, f"comma list of {', '.join(METHODS)}; default: all ({SLICED}: decoder-only models only)")
    timed_steps: int = arg(8, "timed steps per method", "steps")
    untimed_steps: int = arg(2, "untimed steps per method first", "warmup")
    tune_baselines: bool = arg(False, f"also time each baseline at every value of its own setting ({SETTINGS_TRIED}) "
                                      "and report its best setting that fits memory")
    tune_steps: int = arg(2, "--tune-baselines: timed steps per value of a baseline's setting")
    compare_profile: str | None = arg(None, f"also run {PROFILED}: dynamic planned with this `dynabatch profile` "
                                            "JSON, no calibration")
    placements: str = arg("linear", "comma list of placements of pipeline stages on the devices, each method (but "
                                    f"{PEER}) run under each, interleaved: linear (one chunk per device), cyclic (T5: "
                                    "encoder chunk d and decoder chunk d on device d), interleaved:V (V chunks per "
                                    "device); a method under another than linear is reported as METHOD@PLACEMENT "
                                    "(calibrated like the linear methods, with one fit per placement)")
    moving_baselines: bool = arg(False, "with --moving-boundaries: the baselines' stage boundaries move per "
                                        "micro-batch too (default: only the dynamic methods', the baselines keep one "
                                        "split as users run them)")
    json: str | None = json_arg()
    quiet: bool = arg(False, "no table (with --json)")


BENCH_FIELDS = ("model", "tokenizer", "data", "columns", "dtype",
                "stages", "policy", "layer_split", "split_blocks", "pack_rows", "attention", "attention_kernel",
                "global_batch_tokens", "max_input_len",
                "max_target_len", *option_users(), "memory_gib", "moving_boundaries", "recompute", "threads", "cpu_allocator", "cost_profile",
                "calibrate", "plan_costs", "seed", "timeout_s")
"""The TrainConfig fields ``bench`` takes: the same flags as ``train``'s."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_fields(p, BENCH_FIELDS, defaults={"model": "t5", "stages": 2, "max_target_len": None}, helps={
        "model": "t5 (= t5-d256), gpt (= gpt2-d256), llama (= llama-d256), any model preset (t5-tiny, gpt2-mini, "
                 "llama-tiny, ...) or a local checkpoint folder",
        "max_target_len": "T5 decoder limit; default: max input length / 4",
        "recompute": "activation recomputation for every method: auto (per micro-batch and stage, the fastest mode "
                     "that fits --memory-gib), none, selective (attention cores) or full (every block)",
        "layer_split": "pipeline layer split of every placement, shared by all methods: balanced over the micro-batches "
                       "every method of --methods cuts the first global batches into (data), or over one reference "
                       "micro-batch (reference); the JSON's layouts",
    })
    add_sections(p, [BenchArgs])


def flag_names() -> tuple[str, ...]:
    """Every flag `bench` takes, as field names (the JSON config records them)."""
    return (*BENCH_FIELDS, *(f.name for f in dataclasses.fields(BenchArgs)))


def as_argv(args: argparse.Namespace) -> list[str]:
    """``args`` as flags again (the torchrun re-launch parses them)."""
    out = []
    for name in flag_names():
        v = getattr(args, name)
        if v is not None:
            out += ["--" + name.replace("_", "-"), str(v)]
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (:func:`dynabatch.commands.bench_run.run`)."""
    from dynabatch.commands.bench_run import run as run_bench  # lazy: keeps torch out of `dynabatch bench --help`

    return run_bench(args)
