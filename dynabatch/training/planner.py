"""Rank 0's step planner: global batch -> micro-batches per replica -> shapes, costs and plans, ahead of time.

:class:`StepPlanner` makes one :class:`PlannedStep` per call: it draws the next global batch, cuts it
with the configured method through the planning path ``plan``, ``simulate`` and the DataLoader share
(:class:`~dynabatch.plan.global_plan.GlobalPlanner`; ``dynamic``: :func:`dynabatch.plan.step.plan_step` with the
stage cost model, scored by the simulated step; a baseline: its batcher, micro-batches dealt to replicas
longest-first), lays out each replica's micro-batches as :class:`Unit` s (rows of sample indices, token-slice
bounds) and their shapes, without collating them (:attr:`PlannedStep.replica_micro_batches` collates where the
tensors are used), prices them per stage (with ``attention=segments``, attention by the pairs
each micro-batch's rows really compute, :func:`units_pairs`), picks the compute schedule the runtime will run
and simulates it (the *predicted* step time and bubble, the measured step's twin).

:mod:`dynabatch.training.plan_ahead` runs a planner a few steps ahead of training (a thread or a process). The
batcher position recorded with each step is the position *after* its global batch, which is what a checkpoint
taken after that step must store. Plans are deterministic, so planning ahead delivers exactly the plans of the
synchronous planner (tested).
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import replace

import numpy as np

from dynabatch.training.config import Found, TrainConfig, decide, lower
from dynabatch.cost.pairs import row_work, stacked_pairs
from dynabatch.cost.stages import StageCostModel
from dynabatch.data.baselines import BaselineOptions, RowGroup, group_shape, make_batcher
from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.data.sample import GlobalBatch
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.plan.candidates import Candidate, choose
from dynabatch.plan.formula import step_lower_bound
from dynabatch.plan.global_plan import GlobalPlanner
from dynabatch.plan.replicas import wants_equal_counts
from dynabatch.plan.step import flat_row_limit, plan_step
from dynabatch.engine.dist import device_type
from dynabatch.schedule.step import compute_schedule
from dynabatch.schedule.chains import chains
from dynabatch.schedule.simulate import simulate, with_message_buffers
from dynabatch.schedule.step import lower_step
from dynabatch.cost.online import CalibratedStageCostModel
from dynabatch.schedule.placement import Placement
from dynabatch.schedule.virtual import chunk_schedule, placed_step, replayed_step
from dynabatch.plan.slice_costs import AnalyticSliceCostModel, piece_costs
from dynabatch.plan.boundary_choice import MOVE_CHOOSERS
from dynabatch.cost.boundary_prices import move_ratios, moved_features
from dynabatch.training.planned_step import PlannedStep
from dynabatch.training.step_score import fits_without_recompute, replica_columns, send_time_of, simulated_step_time
from dynabatch.training.units import (
    Unit, plan_units, synthetic_units, units_layout, units_pairs)



class StepPlanner:
    """Deterministic producer of :class:`PlannedStep` (see the module docstring)."""

    def __init__(self, batcher: GlobalBatcher, cfg: TrainConfig, cost_model: StageCostModel, tokens: TokenizerInfo,
                 calibration=None, spec=None):
        self.batcher, self.cfg, self.tokens = batcher, cfg, tokens
        self.recompute = lower("recompute", decide(cfg, "recompute"))
        """The activation recomputation this run's method plans with (a baseline: none), kept on every cost model
        the planner is given: one shared by several methods (``dynabatch bench``'s base model and online fit, set up
        for the dynamic method) would otherwise have a baseline recompute wherever ``auto`` would."""
        self.cost_model = self._own(cost_model)
        self.calibration = calibration
        """:class:`~dynabatch.training.calibration.RunCalibration` (online calibration) or ``None``."""
        self.spec = spec
        """The run's :class:`~dynabatch.schedule.ir.PipelineSpec`: with it, every training step is also lowered and
        validated here (:attr:`PlannedStep.plans`), off the training loop; ``None``: the loop lowers it."""
        self.predict_model = self.cost_model
        """The model predictions are made with: the online fit when calibrating (``cost_model`` plans: the fit too
        with ``plan_costs="calibrated"``, the base model scaled to it with ``"scaled"``, else the base model)."""
        self.limits: LengthLimits = batcher.limits
        self.family = self.limits.family
        self.step = batcher.step
        # Attention per segment (pad never computed): micro-batches are priced by their attention pairs and
        # the dynamic planner may pack rows (cfg.pack_rows); the dense path computes whole padded rows.
        self.padding_free = getattr(cfg, "attention_path", "segments") == "segments"
        run_device = device_type(getattr(cfg, "device", "auto"))
        self.flat_row = flat_row_limit(run_device, self.family, cfg.max_input_len, cfg.max_target_len)
        """The bound on a flat micro-batch's tokens on the run's device type (:data:`~dynabatch.plan.step.FLAT_ROW_LIMITS`)."""
        self.pack_rows = lower("pack_rows", decide(cfg, "pack_rows", Found(cuda_available=run_device == "cuda")))
        """``--pack-rows`` as the resolver decides it on the run's device (``device``: auto on CUDA, off on CPU)."""
        self.placement = _virtual_placement(cfg)
        """Virtual stages (``--placement`` other than linear): steps are predicted by the placement's list
        schedule, the order the runtime lowers; ``None`` on the linear placement."""
        self.slice_model = None
        if cfg.slice_long:
            self.slice_model = AnalyticSliceCostModel.from_stage_model(  # padding-free: causal kernels, whole or sliced
                cost_model, ref_length=cfg.max_input_len, attention="causal" if self.padding_free else "dense")

    def _own(self, model: StageCostModel) -> StageCostModel:
        """``model`` with this method's :attr:`recompute` and ``--moving-boundaries`` (the same object when it has
        them already)."""
        moving = bool(getattr(self.cfg, "moving_boundaries", False))
        if getattr(model, "recompute", self.recompute) == self.recompute and \
                getattr(model, "moving_boundaries", moving) == moving:
            return model
        return replace(model, recompute=self.recompute, moving_boundaries=moving)

    @property
    def plan_costs(self) -> str:
        """``--plan-costs`` as the resolver decides it for this run's sequence kind (:mod:`dynabatch.training.config.resolve`)."""
        return decide(self.cfg, "plan_costs", Found(sequence_kind=self.family))

    def __call__(self) -> PlannedStep:
        _maybe_crash(self.step)
        if self.calibration is not None and self.calibration.enabled:  # may wait for the measurements it needs
            self.predict_model = self._own(self.calibration.cost_model_for(self.step))
            costs = self.plan_costs
            self.cost_model = (self._own(self.calibration.base) if costs == "base" else self.predict_model
                               if costs == "calibrated" else self._own(self.calibration.cost_model_for(self.step, scaled=True)))
        start = time.perf_counter()
        drawn = self.batcher.next_batch()
        batch = self._baseline_batch(drawn)
        state = copy.deepcopy(self.batcher.state_dict())
        units, candidate, recompute = self._units(batch)
        planned = replace(self._planned(self.step, batch, units, state, start, recompute), candidate=candidate,
                          drawn=drawn.rows())
        if self.spec is not None:
            planned = replace(planned, plans=self._lowered(planned), plan_time_s=time.perf_counter() - start)
        self.step += 1
        return planned

    def _lowered(self, planned: PlannedStep) -> dict:
        """Every rank's validated plans of ``planned``: what :func:`~dynabatch.engine.step.train_step` would lower
        on rank 0 from the same step (:func:`~dynabatch.engine.step.plan_step`, memory checked)."""

        return lower_step([list(s) for s in planned.shapes], self.spec, policy=lower("policy", self.cfg.policy), step=planned.step,
                          costs=planned.costs, memory_limit_bytes=self.cfg.memory_gib * 2**30,
                          schedules=planned.schedules, slice_links=planned.slice_links,
                          model_state_bytes=planned.model_state_bytes, placement=self.placement)

    def with_data(self, planned: PlannedStep) -> PlannedStep:
        """``planned`` with its batch rebuilt from this planner's data when it holds it by reference
        (:meth:`PlannedStep.without_data`: a step from the planner process): the same samples, as the method
        prepared them, so :attr:`PlannedStep.replica_micro_batches` collates what the planner planned."""
        if isinstance(planned.batch, GlobalBatch):
            return planned
        return replace(planned, batch=self._baseline_batch(self.batcher.resolve(planned.batch)))

    def preview(self, batch: GlobalBatch) -> PlannedStep:
        """``batch`` planned and predicted as a training step would be, the stream and the step count left
        alone (the start-up choice of the layer split and placement, :mod:`dynabatch.training.run_layout`)."""
        start = time.perf_counter()
        batch = self._baseline_batch(batch)
        units, candidate, recompute = self._units(batch)
        return replace(self._planned(self.step, batch, units, {}, start, recompute), candidate=candidate)

    def _baseline_batch(self, batch: GlobalBatch) -> GlobalBatch:
        return prepared_batch(self.cfg, self.limits, self.tokens, batch)

    def synthetic_step(self, step: int) -> PlannedStep:
        """A step of synthetic micro-batches spanning the run's lengths (:func:`synthetic_units`), planned with
        the current cost model, for the start-up calibration; the data stream does not move."""
        batch, units = synthetic_units(self.limits, self.tokens, self.cfg.global_batch_tokens)
        return self._planned(step, batch, [units] * self.cfg.replicas, {}, time.perf_counter())

    def _planned(self, step: int, batch: GlobalBatch, replica_units, state, start: float,
                 recompute: str | None = None) -> PlannedStep:
        """The step of ``replica_units``, priced and predicted; ``recompute="none"``: priced without activation
        recomputation (a candidate that fits only that way under ``--recompute auto``, :meth:`_choose`)."""
        plan_model, predict_model = self.cost_model, self.predict_model
        if recompute is not None:
            plan_model, predict_model = (replace(m, recompute=recompute) for m in (plan_model, predict_model))
        shapes, links, contexts, pairs = [], [], [], []
        for units in replica_units:
            sh, lk, ctx = units_layout(batch, units, self.family)
            shapes.append(sh)
            links.append(lk)
            contexts.append(ctx)
            pairs.append(units_pairs(batch, units, self.family) if self.padding_free else None)
        shapes = tuple(shapes)
        if wants_equal_counts(self.cost_model) and len({len(s) for s in shapes}) > 1:  # would hang under --zero 2
            raise ValueError(f"step {step}: --zero 2 needs as many micro-batches on every replica, but the plan has "
                             f"{[len(s) for s in shapes]}")
        costs, schedules, predicted_costs, predicted, bubble = self._priced_moves(
            shapes, links, contexts, pairs, plan_model, predict_model)
        saved = simulate(schedules[0], replace(predicted_costs[0],
                                               peak_bytes=np.zeros_like(predicted_costs[0].peak_bytes)))
        computed = sum(b * (e + d) for s in shapes for b, e, d in s)
        features = ()
        overhead = 0.0
        if self.calibration is not None and self.calibration.enabled:
            features = tuple(self._features(s, lk, pr, c.recompute, c.moves)
                             for s, lk, pr, c in zip(shapes, links, pairs, costs))
            overhead = self.calibration.overhead_for(step)
        return PlannedStep(
            step=step, batch=batch, drawn=None, replica_units=tuple(tuple(u) for u in replica_units), shapes=shapes,
            costs=costs,
            schedules=schedules, slice_links=tuple(links), predicted_step_s=max(predicted + overhead, 0.5 * predicted),
            bubble_fraction=bubble, computed_tokens=computed, plan_time_s=time.perf_counter() - start,
            batcher_state_after=state, model_state_bytes=tuple(self.cost_model.model_state_bytes),
            predicted_saved_bytes=tuple(float(x) for x in saved.peak_memory_bytes), predicted_makespan_s=predicted,
            features=features, predicted_costs=predicted_costs, pairs=tuple(pairs), plan_model=self.cost_model,
            family=self.family, tokens=self.tokens,
        )

    def _priced_moves(self, shapes, links, contexts, pairs, plan_model, predict_model):
        """One step's ``(costs, schedules, predicted_costs, predicted_s, bubble)``: planned with ``plan_model``,
        predicted with ``predict_model``, with the boundary moves that simulate shortest. Without moving boundaries
        only the layout's cuts; with them, each chooser's moves too (:data:`~dynabatch.plan.boundary_choice.
        MOVE_CHOOSERS`), chosen by the online fit where it predicts (how the stages' work compares is what the fit
        measures and a base model misjudges: the output head on a CPU), else by the planning model (which plans come
        from measured times alone: ``--full-determinism``). Ties keep the cuts, then the earlier chooser."""
        candidates = {_moves_key([None] * len(shapes)): [None] * len(shapes)}  # by moves, the cuts first
        if getattr(plan_model, "moving_boundaries", False):
            fit_chooses = self.predict_model is not self.cost_model and not getattr(self.cfg, "full_determinism", False)
            chooser = predict_model if fit_chooses else plan_model
            for name in MOVE_CHOOSERS:
                moves = [piece_costs(chooser, self.slice_model, s, ctx, lk, pr, moves=name).moves
                         for s, lk, ctx, pr in zip(shapes, links, contexts, pairs)]
                candidates.setdefault(_moves_key(moves), moves)
        best = None
        for moves in candidates.values():
            costs, schedules, predicted, bubble = self._predict(shapes, links, contexts, pairs, plan_model,
                                                                moves_in=moves)
            predicted_costs = costs
            if self.predict_model is not self.cost_model:  # planned with the base model, predicted with the fit
                predicted_costs, _, predicted, bubble = self._predict(
                    shapes, links, contexts, pairs, predict_model, schedules, moves_in=[c.moves for c in costs])
            if best is None or predicted < best[3]:
                best = (costs, schedules, predicted_costs, predicted, bubble)
        return best

    def _features(self, shapes, links, pairs, recompute=None, moves=None) -> np.ndarray:
        """(S, 2, M, F) calibration features of one replica's micro-batches (NaN for token slices), priced
        with the ``recompute`` modes they run with; with the ``moves`` they run with (moving stage boundaries),
        each row scaled by its move's time ratio, so the fit learns the layout's times
        (:func:`~dynabatch.cost.boundary_prices.moved_features`)."""

        arr = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
        model = CalibratedStageCostModel.of(self.cost_model)
        x = model.features(arr[:, 0], arr[:, 1], arr[:, 2], pairs, modes=recompute)
        if moves is not None:
            x = moved_features(x, move_ratios(model, arr[:, 0], arr[:, 1], arr[:, 2], pairs), moves)
        for chain in chains(links) if links else ():
            x[:, :, list(chain), :] = np.nan
        return x

    def _units(self, batch: GlobalBatch) -> tuple[list[list[Unit]], str, str | None]:
        """Per replica, the units of ``batch`` to collate (:attr:`global_planner`: the DP's plan priced against the
        baselines' by :meth:`_choose`, or a baseline's micro-batches dealt to replicas), which candidate they come
        from (:attr:`PlannedStep.candidate`) and the recomputation the chosen plan was priced with."""
        planner, picked = self.global_planner, {}

        def choose_among(candidates) -> Candidate:
            chosen, picked["recompute"] = self._choose(batch, candidates)
            return chosen

        planned = planner.plan(batch, getattr(self.batcher, "data", None),
                               dp=lambda: self._plan(batch, self.cost_model), choose_among=choose_among,
                               dp_whole=lambda: self._plan(batch, self.cost_model, sliced=False))
        units = [plan_units(planned.plan, r) for r in range(planner.num_replicas)]
        return units, planned.candidate if planner.method == "dynamic" else "", picked.get("recompute")

    @property
    def global_planner(self) -> GlobalPlanner:
        """How this run cuts a global batch (:class:`~dynabatch.plan.global_plan.GlobalPlanner`, the path ``plan``,
        ``simulate`` and the DataLoader share): the method, its options, stages and replicas; candidates (the
        ``dynamic`` method) unless ``plan_candidates="off"`` or on virtual stages. The DP itself runs as
        :meth:`_plan` (the simulated score) and candidates are priced by :meth:`_choose`."""
        cfg = self.cfg
        candidates = getattr(cfg, "plan_candidates", "baselines") != "off" and self.placement is None
        return GlobalPlanner(cfg.method, self.limits, cfg.stages, cfg.replicas, self.cost_model,
                             BaselineOptions.of(cfg), candidates=candidates, padding_free=self.padding_free,
                             timed_candidates=False)

    def _choose(self, batch: GlobalBatch, candidates: list[Candidate]) -> tuple[Candidate, str | None]:
        """The DP's plan of ``batch`` (``candidates[0]``; with token slices, also its plan of whole samples) or a
        baseline's (:func:`~dynabatch.plan.candidates.baseline_candidates`), whichever this planner predicts shortest
        (:meth:`_price`: the step the runtime would run, priced as :meth:`_planned` predicts it, memory checked)."""
        cfg = self.cfg
        candidates = list(candidates)
        # whole plans are compared by the best prediction of their step at hand: the online fit when calibrating
        # (what the run reports as predicted), which may differ from the model the DP searched with (--plan-costs);
        # under --full-determinism by the planning model, which does not depend on measured times. A plan runs the
        # schedule the planning model orders (_planned), so that is the schedule each candidate is priced with
        model = self.cost_model if getattr(cfg, "full_determinism", False) else self.predict_model
        parts: dict[int, tuple] = {}  # per plan: its costs under `model`
        ordered: dict[int, tuple] = {}  # per plan: its costs under the planning model, which orders its schedule

        def price(plans, recompute=None) -> None:
            def under(m):
                return m if recompute is None else replace(m, recompute=recompute)
            priced = self._plan_costs(batch, plans, under(model))
            parts.update(zip(map(id, plans), priced))
            ordered.update(zip(map(id, plans), priced if model is self.cost_model
                               else self._plan_costs(batch, plans, under(self.cost_model))))

        price([c.plan for c in candidates])
        without: set[int] = set()  # the plans priced without recomputation
        if getattr(model, "recompute", "none") == "auto":
            # auto recomputes a micro-batch that does not fit S in flight; the simulated schedule admits by actual
            # memory, so the same plan may fit without recomputation (faster): price each plan that way too, as
            # _plan does for the DP's own plans, and let the memory check decide
            plain = [replace(c, plan=replace(c.plan)) for c in candidates  # only those that recompute somewhere
                     if any(cost.recompute is not None for cost in parts[id(c.plan)][0])]
            if plain:
                price([c.plan for c in plain], "none")
            candidates += plain
            without = {id(c.plan) for c in plain}

        def bound(p) -> float:
            return max(step_lower_bound(c.fwd_s, c.bwd_s) for c in parts[id(p)][0])

        chosen = choose(candidates, lambda p: self._price(parts[id(p)], model, ordered[id(p)][0]), bound).candidate
        return chosen, "none" if id(chosen.plan) in without else None

    def _plan_costs(self, batch: GlobalBatch, plans, model: StageCostModel | None = None) -> list[tuple]:
        """Per plan, ``(costs, shapes, links, contexts, pairs)`` per replica as :meth:`_planned` prices them (under
        ``model``, default the planner's): every piece of every plan of whole samples priced in one cost-model call
        (a call costs several ms of Python on the analytic model; the pieces' prices do not depend on one another),
        a plan with token slices through its units, with its links and contexts, as :meth:`_planned` lays it out."""
        model = model or self.cost_model
        sliced = {id(p): self._sliced_costs(batch, p, model) for p in plans if p.sliced_samples}
        whole = iter(self._whole_costs(batch, [p for p in plans if not p.sliced_samples], model))
        return [sliced[id(p)] if id(p) in sliced else next(whole) for p in plans]

    def _sliced_costs(self, batch: GlobalBatch, plan, model: StageCostModel) -> tuple:
        """``(costs, shapes, links, contexts, pairs)`` per replica of a plan with token slices."""
        replicas = []
        for r in range(len(plan.replicas)):
            units = plan_units(plan, r)
            shapes, links, contexts = units_layout(batch, units, self.family)
            pairs = units_pairs(batch, units, self.family) if self.padding_free else None
            replicas.append((piece_costs(model, self.slice_model, shapes, contexts, links, pairs), shapes, links,
                             contexts, pairs))
        return tuple(map(list, zip(*replicas)))

    def _whole_costs(self, batch: GlobalBatch, plans, model: StageCostModel) -> list[tuple]:
        """:meth:`_plan_costs` of plans of whole-sample pieces, priced in one cost-model call."""
        if not plans:
            return []
        work_of: dict = {}
        shapes, pairs_work, spans = [], [], []
        for plan in plans:
            for pieces in plan.replicas:
                lo = len(shapes)
                for p in pieces:
                    shapes.append(tuple(int(x) for x in p.shape))
                    if self.padding_free:
                        rows = p.row_samples
                        if rows not in work_of:
                            work_of[rows] = row_work(rows, batch.input_lens, batch.target_lens, self.family)
                        pairs_work.append(work_of[rows])
                spans.append((lo, len(shapes)))
        pairs = stacked_pairs(pairs_work) if self.padding_free else None
        costs = piece_costs(model, None, shapes, [0] * len(shapes), (), pairs, moves=None)
        out, k = [], 0
        for plan in plans:
            replicas = []
            for _ in plan.replicas:
                lo, hi = spans[k]
                k += 1
                replicas.append((replica_columns(model, costs, shapes, pairs, lo, hi), shapes[lo:hi], (),
                                 [0] * (hi - lo), None if pairs is None else pairs[lo:hi]))
            out.append(tuple(map(list, zip(*replicas))))
        return out

    def _price(self, parts: tuple, model: StageCostModel | None = None, ordered_by=None) -> float:
        """The predicted makespan of a plan (:meth:`_predict` of its :meth:`_plan_costs` under ``model``), ``inf``
        when a replica's simulated step does not fit the memory limit. ``ordered_by``: per replica, the costs under
        the planning model, whose schedule the plan runs (:meth:`_planned`); default ``parts``' own."""
        costs, shapes, links, contexts, pairs = parts
        schedules = None
        if ordered_by is not None and ordered_by is not costs:
            schedules = tuple(self._schedule(s, lk, c, self.cost_model) for s, lk, c in zip(shapes, links, ordered_by))
        _, _, predicted, _, fits = self._predict(shapes, links, contexts, pairs, model, schedules_in=schedules,
                                                 costs_in=costs, check_memory=True)
        return predicted if fits else float("inf")

    def _plan(self, batch: GlobalBatch, model: StageCostModel, sliced: bool = True):
        """The dynamic planner's plan of ``batch`` under ``model``, judged by the simulated step (``sliced=False``:
        every sample whole, even with ``--slice-long``). Under
        ``recompute="auto"``, when the plan holds a micro-batch that fits only with recomputation (or only by
        the per-stage bound), the batch is also planned without recomputation and the better-scoring plan kept,
        so auto is never slower than none by the simulated step (as in ``dynabatch simulate``)."""
        cfg = self.cfg
        lengths = (batch.input_lens, batch.target_lens) if self.padding_free else None
        score = simulated_step_time(model, self.slice_model, cfg.memory_gib * 2**30, lengths, self.placement)
        plan = plan_step(
            batch.input_lens, batch.target_lens, model, cfg.stages, family=self.family,
            num_replicas=cfg.replicas, max_samples=cfg.max_micro_batch_samples,
            slice_cost_model=self.slice_model if sliced else None, score=score, pack_rows=self.pack_rows if self.padding_free else "off",
            segment_pricing=self.padding_free, flat_row=self.flat_row,
        )
        if getattr(model, "recompute", "none") != "auto" or fits_without_recompute(plan, model):
            return plan
        try:
            other = self._plan(batch, replace(model, recompute="none"), sliced)
        except ValueError:  # a sample fits only with recomputation
            return plan
        return other if score(other) < score(plan) else plan

    def _tokens(self, batch: GlobalBatch, g: RowGroup) -> int:
        b, e, d = group_shape(batch, g, self.family)
        return b * (e + d)

    def _schedule(self, shapes, links, costs, model, buffered=None):
        """The compute schedule of one replica's micro-batches of ``shapes`` under ``costs`` (priced by ``model``:
        its send time and model states; ``buffered``: ``costs`` with their message buffers, when at hand) for the
        run's policy: what :meth:`_predict` orders and the runtime runs (linear placement)."""
        buffered = with_message_buffers(costs) if buffered is None else buffered
        return compute_schedule(lower("policy", self.cfg.policy), np.asarray(shapes, dtype=np.int64).reshape(-1, 3),
                                self.cfg.stages, buffered, self.cfg.memory_gib * 2**30, links, send_time=send_time_of(model),
                                model_state_bytes=np.array(model.model_state_bytes))

    def _predict(self, shapes, links, contexts, pairs, model=None, schedules_in=None, costs_in=None,
                 check_memory: bool = False, moves_in=None):
        """Per replica: costs under ``model`` (default the planning model; ``costs_in``: already priced; ``moves_in``:
        priced with these boundary moves, the planning model's choice the step runs, not ``model``'s own), the
        compute schedule (``schedules_in``, or chosen under those costs) and its simulation (makespan, bubble).
        With ``check_memory`` a fifth value says whether every replica's simulated step fits the memory limit."""

        model = model or self.cost_model
        costs, schedules, makespans, bubbles = [], [], [], []
        fits = True
        memory = self.cfg.memory_gib * 2**30
        states, send = np.array(model.model_state_bytes), send_time_of(model)
        first = None  # --zero 2 on virtual stages: replica 0's placed step, whose device orders every replica runs
        for k, (s, lk, ctx, pr) in enumerate(zip(shapes, links, contexts, pairs)):
            c = costs_in[k] if costs_in is not None else piece_costs(
                model, self.slice_model, s, ctx, lk, pr, **({} if moves_in is None else {"moves": moves_in[k]}))
            if self.placement is not None:  # virtual stages: the placed order plan_step lowers
                if first is not None:
                    result = replayed_step(first, c, self.placement, states, memory, send, links=lk)
                    if result is None:
                        raise ValueError(f"--zero 2 runs every replica of a device in one chunk order, and replica {k}'s "
                                         "token slices cannot run in replica 0's: drop --slice-long or use --zero 1")
                else:
                    result = placed_step(c, self.placement, states, memory, send, links=lk)
                    first = result if wants_equal_counts(self.cost_model) else None
                schedule = chunk_schedule(result.order, self.placement.num_stages, len(s), result.policy)
            else:
                buffered = with_message_buffers(c)  # what `dynabatch simulate` prices; the validator counts buffers itself
                schedule = schedules_in[k] if schedules_in is not None else self._schedule(s, lk, c, model, buffered)
                result = simulate(schedule, buffered, send_time=send, model_state_bytes=states,
                                  memory_limit_bytes=memory if check_memory else None)
            fits = fits and bool(result.fits_memory)
            costs.append(c)
            schedules.append(schedule)
            makespans.append(result.makespan_s)
            bubbles.append(result.bubble_fraction)
        out = tuple(costs), tuple(schedules), float(max(makespans)), float(np.mean(bubbles))
        return (*out, fits) if check_memory else out


def _moves_key(moves) -> tuple:
    """Replicas' moves (``None``: the cuts) as a key equal for the same moves; all zeros is the cuts."""
    return tuple(None if m is None or not np.any(m) else np.asarray(m).tobytes() for m in moves)


def prepared_batch(cfg: TrainConfig, limits: LengthLimits, tokens: TokenizerInfo, batch: GlobalBatch) -> GlobalBatch:
    """``batch`` as the run's baseline method groups it (:meth:`~dynabatch.data.baselines.Batcher.prepare`:
    ``packing_free_split`` cuts long samples into chunks, each its own sample); ``dynamic``: ``batch``. What the
    planner's units index, on whichever process rebuilds the batch."""
    if cfg.method == "dynamic":
        return batch
    options = BaselineOptions.of(cfg)
    return make_batcher(cfg.method, limits, tokens, **options.batcher_options(cfg.method, limits)).prepare(batch)


def _virtual_placement(cfg: TrainConfig):
    """The :class:`~dynabatch.schedule.placement.Placement` of ``cfg.placement`` when it holds several chunks per
    device, else ``None``."""

    text = getattr(cfg, "placement", "linear")
    if text == "linear":
        return None
    placement = Placement.parse(text, cfg.stages)
    return placement if placement.chunks_per_device > 1 else None


def _maybe_crash(step: int) -> None:
    """Fault injection for tests: ``DYNABATCH_PLANNER_CRASH_AT=STEP`` makes planning that step raise."""
    at = os.environ.get("DYNABATCH_PLANNER_CRASH_AT")
    if at and int(at) == step:
        raise RuntimeError(f"injected planner crash at step {step} (DYNABATCH_PLANNER_CRASH_AT)")
