"""One planned step (:class:`PlannedStep`): what the step planner (:mod:`dynabatch.training.planner`) hands the
training loop, and what rank 0 needs to run and report the step: the samples, each replica's micro-batches as rows
of sample indices (collated where they are used, never shipped as tensors), their priced costs, the schedules the
runtime runs, the prediction and its parts, and which candidate plan ran."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from dynabatch.cost.stages import StageCosts
from dynabatch.data.baselines import RowGroup
from dynabatch.data.microbatch import MicroBatch
from dynabatch.data.sample import BatchRows, GlobalBatch
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.schedule.chains import chains
from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.ir import RECOMPUTE_MODES
from dynabatch.training.units import Unit, collate_group, micro_batches_of


@dataclass(frozen=True)
class PlannedStep:
    """Everything rank 0 needs to run and report one step."""

    step: int
    batch: GlobalBatch
    """The step's samples (as the method prepared them: ``packing_free_split`` cuts long ones); on its way out of the
    planner process, :attr:`drawn` (:meth:`without_data`, :meth:`~dynabatch.training.planner.StepPlanner.with_data`)."""
    drawn: BatchRows | None
    """The global batch as the batcher drew it, by ``(source, row)`` ids (before the method prepared it: ``batch``
    may hold chunks of its samples): what rebuilds ``batch`` elsewhere (:meth:`~dynabatch.training.planner.StepPlanner.with_data`,
    :mod:`dynabatch.training.step_data`); ``None`` for a step of samples not drawn from the data (the start-up
    calibration's)."""
    replica_units: tuple[tuple[Unit, ...], ...]
    """Per replica, its micro-batches as rows of ``batch`` sample indices (and token-slice bounds): what
    :attr:`replica_micro_batches` collates."""
    shapes: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per replica, the ``(b, E, D)`` of each micro-batch."""
    costs: tuple[StageCosts, ...]
    """Per replica, predicted per-stage costs of its micro-batches (drive the schedule)."""
    schedules: tuple[ComputeSchedule, ...]
    """Per replica, the compute schedule chosen for ``policy`` (the runtime runs exactly these)."""
    slice_links: tuple[tuple[int, ...], ...]
    """Per replica, token-slice links of its micro-batches (:mod:`dynabatch.schedule.chains`); ``()`` when none."""
    predicted_step_s: float
    """Simulated makespan of the slowest replica under the schedule the runtime will run."""
    bubble_fraction: float
    computed_tokens: int
    plan_time_s: float
    batcher_state_after: dict[str, Any]
    """Global batcher position after this step's batch: what a checkpoint taken after this step stores."""
    predicted_saved_bytes: tuple[float, ...] = ()
    """Replica 0, per stage: the simulated peak of the activations its schedule keeps for backward
    (stored bytes only: what :class:`~dynabatch.engine.memory.SavedActivationMeter` measures)."""
    model_state_bytes: tuple[float, ...] = ()
    """Per stage, the parameter, gradient and optimizer bytes the schedule's memory was priced with
    (the validator takes them off the device memory)."""
    predicted_costs: tuple[StageCosts, ...] = ()
    """Per replica, the per-stage costs predictions are made with (the online fit when calibrating; the same
    as ``costs`` otherwise, or with ``plan_costs="calibrated"``)."""
    predicted_makespan_s: float = 0.0
    """The simulated makespan alone; ``predicted_step_s`` adds the calibrated step overhead to it."""
    pairs: tuple = ()
    """Per replica, the attention pairs of its micro-batches (:func:`~dynabatch.training.units.units_pairs`; ``None`` on the dense path)."""
    features: tuple[np.ndarray, ...] = ()
    """With online calibration, per replica, ``(S, 2, M, F)`` features of each micro-batch's forward and
    backward on every stage (:meth:`~dynabatch.cost.online.CalibratedStageCostModel.features`; NaN rows for
    token slices, which the slice cost model prices); ``()`` without calibration."""
    plans: dict | None = None
    """Every rank's lowered, validated :class:`~dynabatch.schedule.ir.ExecutionPlan` (by rank), when the planner
    has the run's pipeline spec (:attr:`~dynabatch.training.planner.StepPlanner.spec`); ``plan_time_s`` then includes the lowering."""
    candidate: str = ""
    """Which plan of the global batch ran (the ``dynamic`` method, :mod:`dynabatch.plan.candidates`): ``dp`` (the
    partition DP's) or a baseline's at one knob value (``packing_free=4``); ``""`` for a baseline method."""
    family: str = ""
    """The sequence kind :attr:`replica_micro_batches` collates for (``seq2seq`` or ``causal``)."""
    tokens: TokenizerInfo | None = None
    """The pad and decoder-start ids :attr:`replica_micro_batches` collates with."""
    plan_model: Any = None
    """The stage cost model this step was planned with (the online fit as of its step with
    ``plan_costs="calibrated"``, the base model scaled to it with ``"scaled"``): what its measured efficiencies are priced with. The planner's own ``cost_model``
    moves on with the steps it plans ahead (and stays in the planner's process with ``--planner process``)."""

    @cached_property
    def replica_micro_batches(self) -> tuple[tuple[MicroBatch, ...], ...]:
        """Per replica, its micro-batches collated from :attr:`batch` (in execution order; token slices cut), made
        on first use, in the process (and thread) that uses them: the planner ships the units, never tensors."""
        if not isinstance(self.batch, GlobalBatch):
            raise TypeError(f"step {self.step} holds its batch by reference ({type(self.batch).__name__}); resolve it "
                            "against the data first (StepPlanner.with_data)")
        def collate(g: RowGroup) -> MicroBatch:
            return collate_group(self.batch, g, self.family, self.tokens)

        return tuple(tuple(micro_batches_of(list(units), collate)[0]) for units in self.replica_units)

    @property
    def replica_rows(self) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]:
        """Per replica, per micro-batch (token slices each), its rows of :attr:`batch` sample indices: the
        ``sample_ids`` of :attr:`replica_micro_batches`, without collating them."""
        return tuple(tuple(u.group.rows for u in units for _ in range(len(u.bounds) - 1 if u.bounds else 1))
                     for units in self.replica_units)

    def without_data(self) -> PlannedStep:
        """This step without token data: :attr:`batch` as :attr:`drawn`, the ids it was drawn as (what the planner
        process sends; :meth:`~dynabatch.training.planner.StepPlanner.with_data` rebuilds the batch from the same data)."""
        if self.drawn is None:
            raise ValueError(f"step {self.step} holds samples not drawn from the data; only its own process can use it")
        return replace(self, batch=self.drawn)

    @property
    def real_tokens(self) -> int:
        return self.batch.num_tokens

    @property
    def num_micro_batches(self) -> int:
        return sum(len(s) for s in self.shapes)

    @property
    def moved_micro_batches(self) -> dict[str, int]:
        """Moving stage boundaries: how many (micro-batch, boundary) pairs of the step ran a unit on the stage after
        the cut (``down``) or before it (``up``); ``{}`` when none moved."""
        moves = [np.asarray(c.moves) for c in self.costs if c.moves is not None]
        down = sum(int((m < 0).sum()) for m in moves)
        up = sum(int((m > 0).sum()) for m in moves)
        return {"down": down, "up": up} if down or up else {}

    @property
    def recompute_counts(self) -> dict[str, int]:
        """How many (micro-batch, stage) forwards of the step run each recomputing mode (``{}``: none)."""

        codes = [c.recompute.ravel() for c in self.costs if c.recompute is not None]
        counts = np.bincount(np.concatenate(codes), minlength=len(RECOMPUTE_MODES)) if codes else ()
        return {m: int(n) for m, n in zip(RECOMPUTE_MODES, counts) if m != "none" and n}

    @property
    def num_sliced_samples(self) -> int:
        """Samples that run as chains of token slices (each chain's first slice has no link)."""
        return sum(len(chains(links)) for links in self.slice_links)


__all__ = ["PlannedStep"]
