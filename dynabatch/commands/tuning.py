"""``--tune-baselines`` of ``dynabatch plan``, ``simulate`` and ``bench``: each baseline at its best knob.

A baseline's speed depends on its micro-batch size knob (samples per micro-batch for ``padding`` and
``length_grouped``, the token budget of ``token_budget``, rows per micro-batch for ``packing`` and
``packing_free``), so comparing against its default alone is unfair. For each baseline the values of its
registry grid (:attr:`~dynabatch.data.baselines.BaselineSpec.grid`, plus the default) are tried on the
same global batches; a value whose micro-batches equal an earlier value's on those batches is not run
again, and a value that does not fit the memory limit is skipped. Both are reported.

- ``plan``: every value is planned and priced like the default (the predicted real tokens/s over the predicted
  steps ``sum(t) + (S - 1) max(t)``); feasible means what it means in ``simulate``: the schedule
  ``choose_schedule`` gives each step keeps every device's peak within the device memory
  (:mod:`dynabatch.commands.scheduled`, the one check of both commands).
- ``simulate``: every value is priced by the cost model and scheduled exactly like the default (the
  predicted real tokens/s of :func:`~dynabatch.commands.simulate.simulate_method`); feasible means
  every step's simulated peak fits the device memory (``--memory-gib``, else the hardware preset's).
- ``bench``: every value is planned as ``dynabatch train`` plans it, checked against ``--memory-gib``
  by the runtime's own memory validation, then measured for ``--tune-steps`` steps, all values
  interleaved on one scratch executor (step time does not depend on the weights); the best value is
  then timed for the full ``--timed-steps`` next to the default, and the faster of the two is the tuned one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dynabatch.core.methods import objective_note
from dynabatch.data.baselines import BaselineOptions, Trial, baseline_spec, best_trial, grid_settings, with_twins
from dynabatch.training.config.resolve import lower
from dynabatch.schedule.step import lower_step
from dynabatch.training.config.sections import arg


def _values(method: str) -> str:
    grid = baseline_spec(method).grid
    return f"{grid[0]} to {grid[-1]}" if len(grid) > 5 else ", ".join(map(str, grid))


SETTINGS_TRIED = (f"packing_free: {_values('packing_free')} rows per micro-batch; padding: {_values('padding')} "
                  "samples; ...")
"""What ``--tune-baselines`` tries, in words for its help text (from the baselines' own grids)."""


def tune_baselines_arg(how: str):
    """The ``--tune-baselines`` field of a command's arguments, which ``how`` each knob value (``plan``, ``simulate``)."""
    return arg(False, f"also {how} each baseline at every value of its own setting ({SETTINGS_TRIED}) on the same "
                      "global batches and report its best setting that fits memory")


@dataclass(frozen=True)
class Tuned:
    """The tuning of one baseline: its default and best feasible knob value, and every value tried."""

    method: str
    option: str
    """The knob's option field (the flag ``--packing-rows`` sets ``packing_rows``)."""
    default: int
    trials: tuple[Trial, ...]
    value: int | None = None
    """Best feasible value; ``None`` when no value fits."""
    tokens_per_s: float | None = None
    """Real tokens/s at ``value`` (bench: its full ``--timed-steps`` run)."""
    sweep_value: int | None = None
    """Bench: the sweep's pick, when its full run was slower than the default's (``value`` is then the default)."""
    extra: dict = field(default_factory=dict)
    """Bench: the full result row of the sweep's pick."""

    def to_dict(self) -> dict:
        out = {"knob": self.option, "default": self.default, "value": self.value, "tokens_per_s": self.tokens_per_s,
               "trials": [t.to_dict() for t in self.trials]}
        if self.sweep_value is not None:
            out["sweep_value"] = self.sweep_value
        if self.extra:
            out["measured"] = self.extra
        return out


def tune(method: str, batches, limits, options: BaselineOptions, run) -> Tuned:
    """Try every distinct grid value of ``method``: ``run(value) -> (tokens_per_s, note)``, ``note``
    non-empty for a value that does not fit memory (its tokens/s is then ignored)."""
    trials, twins = {}, {}
    for value, same_as in grid_settings(method, batches, limits, options):
        if same_as is not None:
            twins[value] = same_as
            continue
        tokens_per_s, note = run(value)
        trials[value] = Trial(value, tokens_per_s, feasible=not note, note=note)
    return _tuned(method, options, with_twins(trials, twins))


def _tuned(method: str, options: BaselineOptions, trials: tuple[Trial, ...]) -> Tuned:
    best = best_trial(trials)
    return Tuned(method, baseline_spec(method).option, options.value(method), trials, best.value if best else None,
                 best.tokens_per_s if best else None)


def describe(method: str, tuned: dict, default_tokens_per_s: float | None) -> str:
    """One line of a :meth:`Tuned.to_dict`: default -> tuned value and tokens/s, and the values skipped."""
    skipped = "; ".join(f"{t['value']}: {t['note']}" for t in tuned["trials"] if t["note"])
    if tuned["value"] is None:
        best = "no value fits memory"
    else:
        default = "n/a" if default_tokens_per_s is None else f"{default_tokens_per_s:.0f}"  # off a profile's grid
        best = (f"{tuned['default']} -> {tuned['value']}: {default} -> "
                f"{tuned['tokens_per_s']:.0f} tok/s")
    if tuned.get("sweep_value") is not None:
        best += f" (the sweep's {tuned['sweep_value']} was slower over the full run)"
    return f"{method:<15} {tuned['knob']} {best}" + (f" (skipped {skipped})" if skipped else "")


def tuned_summary(tuned: dict[str, Tuned], planner_tokens_per_s: float | None) -> tuple[dict, float | None]:
    """A command's JSON entries of ``--tune-baselines`` (every baseline's :meth:`Tuned.to_dict`, labelled where it
    changes the objective, and the best whole-sample one, :func:`best_tuned`) and the dynamic planner's real tokens/s
    over the best tuned baseline's (``None`` when none fits or no planner ran)."""
    top = best_tuned(tuned)
    entries = {"tuned": {m: {**t.to_dict(), **({"changes_objective": objective_note(m)} if objective_note(m) else {})}
                         for m, t in tuned.items()},
               "best_tuned_baseline": top}
    return entries, (planner_tokens_per_s / tuned[top].tokens_per_s if top and planner_tokens_per_s else None)


def print_tuned(tuned: dict[str, Tuned], default_tokens_per_s: dict[str, float | None], what: str) -> None:
    """One :func:`describe` line per tuned baseline (``what``: how its tokens/s were had, e.g. ``simulated``)."""
    print(f"tuned baselines (best knob value that fits memory, {what} tokens/s):")
    for m, t in tuned.items():
        print("  " + describe(m, t.to_dict(), default_tokens_per_s[m]) + (" *" if objective_note(m) else ""))


def best_tuned(tuned: dict[str, Tuned]) -> str | None:
    """The whole-sample baseline whose tuned setting is fastest (``None`` when none fits); a baseline that changes
    the objective (``packing_free_split``) is tuned and reported but never the best."""
    ran = {m: t.tokens_per_s for m, t in tuned.items() if t.tokens_per_s is not None and not objective_note(m)}
    return max(ran, key=ran.get) if ran else None


# ------------------------------------------------------------------------------------------------ bench


def memory_error(planned_steps, cfg, spec) -> str:
    """Why the runtime would refuse these planned steps under ``cfg.memory_gib`` ('' when they fit): the
    same validation :func:`~dynabatch.engine.step.train_step` runs on rank 0."""
    for p in planned_steps:
        try:
            lower_step([list(s) for s in p.shapes], spec, policy=lower("policy", cfg.policy), step=p.step, costs=p.costs,
                      memory_limit_bytes=cfg.memory_gib * 2**30, schedules=p.schedules, slice_links=p.slice_links,
                      model_state_bytes=p.model_state_bytes)
        except ValueError as e:
            return f"does not fit memory ({str(e).split(';')[0]})"
    return ""


def sweep_settings(methods, cfgs, args, batches, limits, plan, spec) -> tuple[dict, list]:
    """Rank 0, before the sweep: per baseline the values to measure and those not to.

    ``plan(cfg) -> planned steps`` (the sweep's steps). Returns ``(skipped, candidates)``: ``skipped[m]``
    is ``(refused, twins)``, the trials of values over memory and, for values with the same micro-batches
    as another, that value; ``candidates`` lists ``(method, value, cfg, planned steps)`` to measure. A
    default that does not fit is a ``ValueError`` (every method also runs at its flags' values)."""
    skipped: dict[str, tuple[dict, dict]] = {}
    candidates = []
    options = BaselineOptions.of(args)
    for m in methods:
        option = baseline_spec(m).option
        refused, twins = {}, {}
        for value, same_as in grid_settings(m, batches, limits, options):
            if same_as is not None:
                twins[value] = same_as
                continue
            cfg = replace(cfgs[m], **{option: value})
            try:
                planned = plan(cfg)
                note = memory_error(planned, cfg, spec)
            except ValueError as e:
                planned, note = None, f"cannot be planned ({e})"
            if note and value == getattr(cfgs[m], option):
                raise ValueError(f"{m}: the default {option}={value} {note}; every method in --methods runs at "
                                 "its flags' values, so lower it or raise --memory-gib")
            if note:
                refused[value] = Trial(value, feasible=False, note=note)
            else:
                candidates.append((m, value, cfg, planned))
        skipped[m] = (refused, twins)
    return skipped, candidates


def sweep_results(methods, args, skipped, candidates, times) -> dict[str, Tuned]:
    """Rank 0, after the sweep: per baseline every trial (measured ones with the sweep's real tokens/s) and
    the best feasible value. ``times[k]``: the timed step seconds of candidate ``k``."""
    options = BaselineOptions.of(args)
    out = {}
    for m in methods:
        refused, twins = skipped[m]
        trials = dict(refused)
        for k, (cm, value, _, planned) in enumerate(candidates):
            if cm == m:
                timed = planned[len(planned) - len(times[k]):]
                trials[value] = Trial(value, sum(p.real_tokens for p in timed) / sum(times[k]))
        out[m] = replace(_tuned(m, options, with_twins(trials, twins)), tokens_per_s=None)  # set by the full run
    return out


def tuned_key(method: str) -> str:
    """The bench's internal name of a baseline's tuned run."""
    return f"{method}[tuned]"


def with_tuned(result: dict, tuned: dict) -> dict:
    """Move the tuned runs' rows out of ``methods`` into ``tuned`` (with every baseline's sweep) and add each
    method's ratio to the best tuned baseline. A baseline's tuned value is the sweep's pick or, when the pick's
    full run was slower than the default's (same steps, same batches), the default. (``dynabatch bench``'s
    result, ``tuned`` from its sweep.)"""
    rows = result["methods"]
    for m, t in list(tuned.items()):
        row = rows.pop(tuned_key(m), None)
        default = rows[m]["tokens_per_s"]
        if row is not None and row["tokens_per_s"] >= default:
            tuned[m] = replace(t, tokens_per_s=row["tokens_per_s"], extra=row)
        elif row is not None:
            tuned[m] = replace(t, value=t.default, tokens_per_s=default, sweep_value=t.value, extra=row)
        elif t.value is not None:  # the default is the best value: its own full run
            tuned[m] = replace(t, tokens_per_s=default)
    top = best_tuned(tuned)
    result["tuned"] = {m: t.to_dict() for m, t in tuned.items()}
    result["best_tuned_baseline"] = top
    if top is not None:
        for row in rows.values():
            row["ratio_to_best_tuned_baseline"] = row["tokens_per_s"] / tuned[top].tokens_per_s
    return result
