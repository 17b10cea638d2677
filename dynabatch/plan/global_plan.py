"""The one planning path: a global batch and a batching method -> each data-parallel replica's micro-batches.

``dynabatch train`` (:class:`~dynabatch.training.planner.StepPlanner`), ``plan`` / ``simulate`` / ``bench``
(:func:`~dynabatch.training.workload.method_micro_batches`) and :class:`~dynabatch.integrations.dataloader.DynaBatchDataLoader`
all cut a global batch through :meth:`GlobalPlanner.plan`, so what ``plan`` and ``simulate`` describe and what
the DataLoader yields is what ``train`` runs for the same global batch, method and layout:

* ``dynamic``: the partition DP (:func:`~dynabatch.plan.step.plan_step`, split over the replicas by
  :mod:`dynabatch.plan.replicas`), then, with :attr:`GlobalPlanner.candidates`, the DP's plan or a baseline's
  (:mod:`dynabatch.plan.candidates`), whichever is priced lowest. The price is the caller's to give (the
  trainer's simulated step; ``simulate``'s simulated makespan; default the step formula under the cost model).
  With token slices (``dynamic_sliced``, ``--slice-long``) a plan that slices competes with the DP's plan of
  whole samples and the baselines' where the caller's price prices slice chains;
* a baseline of :data:`~dynabatch.data.baselines.BASELINES`: its batcher's micro-batches, dealt to the replicas
  by :func:`~dynabatch.plan.candidates.deal_to_replicas` (largest first to the least-loaded replica, each replica
  keeping the baseline's order): the one dealing rule, the same by which a baseline candidate of the dynamic
  method is dealt. Under ``--zero 2`` (the cost model's ``equal_micro_batch_counts``) the dealt micro-batches are
  then given equal counts per replica (:func:`~dynabatch.plan.candidates.even_counts`), as the DP's plans are, a
  baseline method's and the dynamic method's baseline candidates alike.

The result is a :class:`~dynabatch.plan.step_plan.StepPlan` (per replica, the pieces in execution order); its
:meth:`~dynabatch.plan.step_plan.StepPlan.to_row_groups` are the row groups every caller collates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynabatch.core.methods import METHODS
from dynabatch.data.baselines import BaselineOptions, RowGroup
from dynabatch.data.batching import LengthLimits
from dynabatch.data.pipeline import locate_sample_error
from dynabatch.data.sample import GlobalBatch
from dynabatch.plan.candidates import (DP, DP_WHOLE, Candidate, baseline_candidates, baseline_plan, baseline_settings, choose,
                                       formula_choice, price_settings)
from dynabatch.plan.formula import formula_prices
from dynabatch.plan.replicas import wants_equal_counts
from dynabatch.plan.step import plan_step
from dynabatch.plan.step_plan import StepPlan

DYNAMIC = "dynamic"


@dataclass(frozen=True)
class GlobalPlan:
    """One global batch cut by one method: per replica, its micro-batches in execution order."""

    plan: StepPlan
    candidate: str = ""
    """``dynamic``: which candidate plan was kept (``dp``, or a baseline's at a knob value such as
    ``packing_free=4``); ``""`` for a baseline method."""

    @property
    def num_replicas(self) -> int:
        return len(self.plan.replicas)

    def row_groups(self, replica: int) -> list[RowGroup]:
        """``replica``'s micro-batches as row groups (sample indices of each row, padded to the planned shape)."""
        return self.plan.to_row_groups(replica)


@dataclass(frozen=True)
class GlobalPlanner:
    """How a run cuts its global batches: the method and its options, the cost model, stages and replicas."""

    method: str
    limits: LengthLimits
    num_stages: int = 1
    num_replicas: int = 1
    cost_model: Any = None
    """``dynamic``: the partition DP's :class:`~dynabatch.plan.costs.MicroBatchCostModel` (a stage cost model)."""
    options: BaselineOptions = field(default_factory=BaselineOptions)
    """The baselines' knobs: a baseline method's own micro-batch size, and the run's value among the candidates'."""
    batcher_options: Mapping[str, Any] | None = None
    """A baseline method's batcher fields as given (the DataLoader's ``method_options``); ``None``: from
    :attr:`options`."""
    planner_options: Mapping[str, Any] = field(default_factory=dict)
    """Further keywords of :func:`~dynabatch.plan.step.plan_step` (``max_samples``, ``pack_rows``, ``in_flight``...)."""
    slice_cost_model: Any = None
    """``dynamic``, decoder-only: cut samples into token slices (:mod:`dynabatch.plan.slicing`)."""
    candidates: bool = True
    """``dynamic``: also consider the baselines' plans of each global batch (:mod:`dynabatch.plan.candidates`)."""
    padding_free: bool = True
    """Attention per segment (pad never computed): the DP and the candidates price pieces by the attention pairs
    their rows compute; on a dense run the candidates are only the baselines with one sample per row."""
    timed_candidates: bool = True
    """Give each baseline candidate's pieces their time under :attr:`cost_model`; ``False`` when the caller's
    ``choose_among`` prices whole plans itself (the trainer), which saves a cost-model call per step."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; valid: {', '.join(METHODS)}")
        if self.method == DYNAMIC and self.cost_model is None:
            raise ValueError("method 'dynamic' needs a cost model")

    @property
    def family(self) -> str:
        return self.limits.family

    def plan(self, batch: GlobalBatch, data=None, *, dp: Callable[[], StepPlan] | None = None,
             choose_among: Callable[[Sequence[Candidate]], Candidate] | None = None,
             price: Callable[[StepPlan], float] | None = None,
             dp_whole: Callable[[], StepPlan] | None = None) -> GlobalPlan:
        """``batch`` cut into each replica's micro-batches.

        ``dynamic`` only: ``dp()`` replaces the plain :func:`~dynabatch.plan.step.plan_step` call (the trainer plans
        with its simulated score and its recomputation choice); ``choose_among(candidates)`` picks among the DP's
        plan (listed first) and the baselines' (default: :func:`~dynabatch.plan.candidates.choose` by ``price``,
        default :func:`~dynabatch.plan.formula.formula_price`). When the DP's plan cuts samples into token slices
        and the caller prices plans (``price`` or ``choose_among``, which must price slice chains), the DP also
        plans the batch with every sample whole (``dp_whole()``, default the DP without its slice cost model) and
        the candidates are the sliced plan, that whole one (:data:`~dynabatch.plan.candidates.DP_WHOLE`) and the
        baselines'; a batch with a sample that fits only in slices, or priced by the step formula, keeps the
        sliced plan. A ``ValueError`` about a sample names its global batch and, with the run's ``data``, its
        source row."""
        if self.method != DYNAMIC:
            equal = wants_equal_counts(self.cost_model)  # --zero 2: the baseline's counts evened, priced
            return GlobalPlan(baseline_plan(self.method, batch.input_lens, batch.target_lens, self.limits,
                                            self.num_stages, num_replicas=self.num_replicas, options=self.options,
                                            batcher_options=self.batcher_options, equal_counts=equal,
                                            cost_model=self.cost_model if equal else None,
                                            padding_free=self.padding_free))
        try:
            plan = dp() if dp is not None else self._dp(batch)
        except ValueError as e:  # "sample K ..." -> which global batch, which source row
            raise locate_sample_error(e, batch, data) from e
        if not self.candidates:
            return GlobalPlan(plan, DP)
        sliced = None  # the DP's plan with token slices, a candidate beside its plan of whole samples
        if plan.sliced_samples:
            if choose_among is None and price is None:  # the step formula does not price slice chains
                return GlobalPlan(plan, DP)
            try:
                whole = dp_whole() if dp_whole is not None else self._dp(batch, sliced=False)
            except ValueError:  # a sample fits the memory only in slices: no whole-sample plan can run it
                return GlobalPlan(plan, DP)
            sliced, plan = plan, whole
        formula = choose_among is None and price is None
        equal = wants_equal_counts(self.cost_model)
        if formula and self.padding_free and not equal:  # every candidate priced from arrays, one plan built
            chosen = formula_choice(self._priced_settings(batch, plan), self.cost_model,
                                    self.planner_options.get("in_flight"), timed=self.timed_candidates)
            return GlobalPlan(chosen.plan, chosen.label)
        work: dict = {}  # each micro-batch's attention work, shared by the candidates' pricing
        # with the step formula, each distinct micro-batch (the DP's and the baselines') is priced once, in one call
        priced: dict | None = {} if formula and self.timed_candidates else None
        also = [(p.row_samples, p.shape) for pieces in plan.replicas for p in pieces if not p.is_slice] \
            if priced is not None and self.padding_free else []
        baselines = baseline_candidates(batch.input_lens, batch.target_lens, self.limits, plan.num_stages,
                                        num_replicas=self.num_replicas, options=self.options,
                                        padding_free=self.padding_free,
                                        cost_model=self.cost_model if self.timed_candidates else None, work=work,
                                        equal_counts=equal, priced=priced, also=also)
        candidates = [Candidate(DP, None, plan), *baselines] if sliced is None else \
            [Candidate(DP, None, sliced), Candidate(DP_WHOLE, None, plan), *baselines]
        if choose_among is not None:
            chosen = choose_among(candidates)
        else:
            if price is None:  # the step formula: every candidate priced in one cost-model call, then compared
                plans = [c.plan for c in candidates]
                prices = dict(zip(map(id, plans), formula_prices(
                    self.cost_model, batch.input_lens, batch.target_lens, plans, self.padding_free,
                    self.planner_options.get("in_flight"), work, priced)))
                price = lambda plan: prices[id(plan)]  # noqa: E731
            chosen = choose(candidates, price).candidate
        return GlobalPlan(chosen.plan, chosen.label)

    def _priced_settings(self, batch: GlobalBatch, plan: StepPlan):
        """The baselines' settings of ``batch`` (:func:`~dynabatch.plan.candidates.baseline_settings`) and the DP's
        ``plan``, every micro-batch priced in one cost-model call."""
        settings = baseline_settings(batch.input_lens, batch.target_lens, self.limits, num_replicas=self.num_replicas,
                                     options=self.options, padding_free=self.padding_free)
        return price_settings(self.cost_model, plan, settings, batch.input_lens, batch.target_lens, self.family)

    def _dp(self, batch: GlobalBatch, sliced: bool = True) -> StepPlan:
        """The partition DP's plan, its runs priced as the run computes them: per segment on a padding-free run
        (``segment_pricing``, as ``train`` plans), unless :attr:`planner_options` says otherwise; ``sliced=False``:
        every sample kept whole."""
        options = {"segment_pricing": self.padding_free, **self.planner_options}
        return plan_step(batch.input_lens, batch.target_lens, self.cost_model, self.num_stages, family=self.family,
                         num_replicas=self.num_replicas, slice_cost_model=self.slice_cost_model if sliced else None,
                         **options)


__all__ = ["GlobalPlan", "GlobalPlanner"]
