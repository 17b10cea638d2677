"""One distributed training step: plan on rank 0, deliver, execute everywhere.

:func:`train_step` is what the trainer and the multi-process tests call on every rank. On rank 0 it
takes each replica's micro-batches and lowers them to validated per-rank plans
(:func:`dynabatch.schedule.step.lower_step`, a policy's compute schedule per replica; the trainer's background
planner does this ahead and hands the plans in), cuts each rank's host tensors out of the micro-batches (only the
tensors the rank's stage loads), and starts delivering them (:mod:`dynabatch.engine.delivery`); then every rank
runs its plan on its :class:`~dynabatch.engine.executor.Executor`. Rank 0 waits for its deliveries at the end of
its own step, so it never waits for a slow last stage before starting its forwards.

A caller whose every rank holds the data passes, instead of rank 0's micro-batches, each replica's *layout* (its
own bytes naming the samples and rows of the replica's micro-batches) and, on every rank, ``collate`` (layout ->
micro-batches): rank 0 then sends each rank its plan and its replica's layout, and each rank collates its own
micro-batches (:func:`own_inputs`); no token travels. The engine never reads a layout.

The lowering lives in :mod:`dynabatch.schedule.step` (pure, no process group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dynabatch.cost.stages import StageCosts
from dynabatch.data.microbatch import CausalMicroBatch, MicroBatch
from dynabatch.engine.delivery import StepInputs, check_inputs, receive_step, send_step
from dynabatch.engine.dist import DistContext, PipelineError
from dynabatch.engine.executor import Executor, StepResult
from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.ir import ExecutionPlan, PipelineSpec
from dynabatch.schedule.placement import Placement
from dynabatch.schedule.step import forward_only_plan, lower_step, without_update
from dynabatch.models.split import micro_batch_inputs

def micro_batch_shape(mb: MicroBatch) -> tuple[int, int, int]:
    """Padded ``(b, E, D)`` of a micro-batch (``D = 0`` for decoder-only)."""
    if isinstance(mb, CausalMicroBatch):
        b, t = mb.shape
        return (b, t, 0)
    return mb.shape


InputsFn = Callable[[MicroBatch, PipelineSpec, int], dict]
"""``(micro_batch, spec, stage_index) -> loaded dict`` (:func:`dynabatch.models.split.micro_batch_inputs`)."""
Collate = Callable[[bytes], Sequence[MicroBatch]]
"""``layout -> micro-batches``: a rank's micro-batches of one step, in execution order, collated from the caller's
description of them (:attr:`~dynabatch.engine.delivery.StepInputs.layout`)."""


def step_payloads(
    plans: dict[int, ExecutionPlan],
    replica_micro_batches: Sequence[Sequence[MicroBatch]],
    spec: PipelineSpec,
    inputs_fn: InputsFn | None = None,
    global_loss_tokens: int | None = None,
) -> dict[int, StepInputs]:
    """Per rank, its plan and the host tensors its stage loads for its replica's micro-batches
    (``replica_micro_batches[p]``; a mapping may hold only the replicas of ``plans``). ``global_loss_tokens``:
    the whole step's loss tokens, default those of ``replica_micro_batches``."""
    if inputs_fn is None:
        inputs_fn = micro_batch_inputs
    tokens = global_loss_tokens
    if tokens is None:
        tokens = sum(mb.num_loss_tokens for mbs in replica_micro_batches for mb in mbs)
    out = {}
    for rank, plan in plans.items():
        mbs = replica_micro_batches[plan.replica_index]
        loaded = {m: {k: v for s in plan.stages for k, v in inputs_fn(mb, spec, s).items()} for m, mb in enumerate(mbs)}
        out[rank] = StepInputs(plan, loaded, tokens)
    return out


def layout_payloads(plans: dict[int, ExecutionPlan], replica_layouts: Sequence[bytes],
                    global_loss_tokens: int) -> dict[int, StepInputs]:
    """Per rank, its plan and its replica's layout (no tensors: the rank collates them, :func:`own_inputs`)."""
    return {rank: StepInputs(plan, {}, int(global_loss_tokens), replica_layouts[plan.replica_index])
            for rank, plan in plans.items()}


def own_inputs(inputs: StepInputs, spec: PipelineSpec, collate: Collate | None,
               inputs_fn: InputsFn | None = None) -> StepInputs:
    """``inputs`` with the tensors its plan loads: as delivered, or, when a layout came, collated here from it
    (``collate``) and cut for this rank's stages as :func:`step_payloads` cuts them on rank 0."""
    if not inputs.layout:
        return inputs
    if collate is None:
        raise PipelineError(f"rank {inputs.plan.rank}, step {inputs.plan.step}: rank 0 sent a layout of the "
                            "micro-batches, but this rank was given no collate to make them")
    mbs = collate(inputs.layout)
    own = step_payloads({inputs.plan.rank: inputs.plan}, {inputs.plan.replica_index: mbs}, spec, inputs_fn,
                        global_loss_tokens=inputs.global_loss_tokens)[inputs.plan.rank]
    check_inputs(own)
    return own


def receive_failure(rank: int, step: int, timeout_s: float | None, error: Exception) -> str:
    """The message of a failed plan receive; a first-step timeout points at rank 0's data loading."""
    if timeout_s is not None and "Timed out" in str(error):
        return (f"rank {rank}, step {step}: rank 0 did not finish loading the data and planning the first step "
                f"within startup_timeout_s={timeout_s:g} s; raise --startup-timeout-s if the mixture takes longer "
                f"to load and tokenize ({error})")
    return f"rank {rank}, step {step}: receiving the plan from rank 0 (the planner) failed: {error}"


def train_step(
    executor: Executor,
    ctx: DistContext,
    step: int,
    replica_micro_batches: Sequence[Sequence[MicroBatch]] | None = None,
    *,
    spec: PipelineSpec | None = None,
    policy: str = "1f1b",
    costs: Sequence[StageCosts] | None = None,
    memory_limit_bytes=None,
    schedules: Sequence[ComputeSchedule] | None = None,
    inputs_fn: InputsFn | None = None,
    slice_links: Sequence[Sequence[int]] | None = None,
    receive_timeout_s: float | None = None,
    model_state_bytes=0.0,
    forward_backward_only: bool = False,
    forward_only: bool = False,
    placement: Placement | None = None,
    plans: dict[int, ExecutionPlan] | None = None,
    replica_layouts: Sequence[bytes] | None = None,
    global_loss_tokens: int | None = None,
    collate: Collate | None = None,
) -> StepResult:
    """Run training step ``step`` on this rank (every rank calls it).

    Rank 0 passes ``replica_micro_batches`` (one list per replica, in execution order) and ``spec``;
    other ranks pass neither and receive their plan and tensors from rank 0. ``slice_links[p]``
    (rank 0): for each micro-batch of replica ``p``, the micro-batch whose keys/values it extends
    (a token slice, :func:`dynabatch.data.microbatch.token_slices`) or -1. ``receive_timeout_s`` (other
    ranks): how long to wait for rank 0's plan instead of the group timeout; the trainer passes
    ``TrainConfig.startup_timeout_s`` on a run's first step, while rank 0 is still loading the data.
    ``forward_backward_only`` (rank 0): drop the ``REDUCE`` and ``STEP`` instructions from every plan, so the
    step computes (and times) forwards and backwards but changes no weight, optimizer or scheduler state;
    its gradients are dropped at the start of the next step (the start-up calibration's passes).
    ``forward_only`` (rank 0): run every plan as an evaluation pass (:func:`~dynabatch.schedule.step.forward_only_plan`): no gradient,
    no state change; the result's ``loss`` is the global token-normalised loss, ``segment_losses`` per row.
    ``placement`` (rank 0): virtual stages (:func:`~dynabatch.schedule.step.lower_step`); ``spec`` and ``costs`` then describe the chunks.
    ``plans`` (rank 0): every rank's plans, already lowered and validated by :func:`~dynabatch.schedule.step.lower_step` from exactly these
    arguments (the background planner's, :attr:`~dynabatch.training.planned_step.PlannedStep.plans`); else lowered here.
    ``replica_layouts`` (rank 0, with ``plans`` and ``global_loss_tokens``, instead of ``replica_micro_batches``):
    each replica's layout, sent to its ranks; ``collate`` (every rank, ``spec`` too): makes a rank's micro-batches
    of its layout (:func:`own_inputs`), so each rank collates its own and no token is delivered.
    """
    if ctx.is_planner:
        if spec is None:
            raise ValueError("rank 0 (the planner) needs spec")
        if replica_layouts is not None:
            if plans is None or global_loss_tokens is None or len(replica_layouts) != ctx.num_replicas:
                raise ValueError("rank 0 (the planner) with replica_layouts needs one per replica, plans and "
                                 "global_loss_tokens")
        elif replica_micro_batches is None:
            raise ValueError("rank 0 (the planner) needs replica_micro_batches (or replica_layouts)")
        elif len(replica_micro_batches) != ctx.num_replicas:
            raise ValueError(
                f"got micro-batches for {len(replica_micro_batches)} replicas, the world has {ctx.num_replicas}"
            )
        if plans is None:
            shapes = [[micro_batch_shape(mb) for mb in mbs] for mbs in replica_micro_batches]
            plans = lower_step(shapes, spec, policy=policy, step=step, costs=costs, memory_limit_bytes=memory_limit_bytes,
                              schedules=schedules, slice_links=slice_links, model_state_bytes=model_state_bytes,
                              placement=placement)
        if forward_backward_only:
            plans = {r: without_update(p) for r, p in plans.items()}
        if forward_only:
            plans = {r: forward_only_plan(p) for r, p in plans.items()}
        payloads = (layout_payloads(plans, replica_layouts, global_loss_tokens) if replica_layouts is not None
                    else step_payloads(plans, replica_micro_batches, spec, inputs_fn))
        own, pending = send_step(payloads, ctx.delivery_group, ctx.world_size)
        result = executor.run(own_inputs(own, spec, collate, inputs_fn))  # a layout: rank 0 collates its own too
        try:
            pending.wait()
        except Exception as e:
            raise PipelineError(f"rank 0, step {step}: delivering plans to the other ranks failed: {e}") from e
        return result
    try:
        inputs = receive_step(ctx.delivery_group, receive_timeout_s)
    except Exception as e:
        raise PipelineError(receive_failure(ctx.rank, step, receive_timeout_s, e)) from e
    if inputs.plan.step != step:
        raise PipelineError(f"rank {ctx.rank} expected the plan of step {step}, rank 0 sent step {inputs.plan.step}")
    return executor.run(own_inputs(inputs, spec, collate, inputs_fn))

