"""One step's lowering: each replica's micro-batch shapes -> a compute schedule -> validated per-rank plans.

:func:`lower_step` is what rank 0 (the trainer's planner, ``bench``, the tests) calls to turn a step's
micro-batches into every rank's :class:`~dynabatch.schedule.ir.ExecutionPlan`: per replica it builds the compute
schedule of the chosen policy (:func:`compute_schedule`), lowers it to instructions
(:func:`dynabatch.schedule.lower.lower`, or :func:`~dynabatch.schedule.virtual.lower_placed` on virtual stages)
and validates every plan, with memory when the costs price it (:func:`check_step_memory`). Pure: no process
group, no tensors; the engine (:mod:`dynabatch.engine.step`) runs what comes out.

Policies (:data:`dynabatch.core.policies.POLICY_CHOICES`): ``gpipe``, ``1f1b``, ``adaptive`` (memory-aware list
schedule) and ``auto`` (:func:`~dynabatch.schedule.policies.choose_schedule`: best simulated makespan over
policies and orders). Without a measured cost model, ``adaptive``/``auto`` use :func:`token_costs`, which prices a
micro-batch by its computed tokens (enough to order work; the trainer passes real stage costs).
:func:`without_update` and :func:`forward_only_plan` derive a step without the optimizer update and an evaluation
pass from a validated plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from dynabatch.core.policies import POLICY_CHOICES
from dynabatch.cost.planner_model import INFEASIBLE
from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.ir import ExecutionPlan, Op, PipelineSpec
from dynabatch.schedule.lower import lower
from dynabatch.schedule.placement import Placement
from dynabatch.schedule.policies import adaptive, choose_schedule, gpipe, one_f_one_b
from dynabatch.schedule.simulate import per_stage_values, with_message_buffers
from dynabatch.schedule.validate import PlanValidationError, validate, validate_or_raise
from dynabatch.schedule.virtual import lower_placed, placed_step

POLICIES = POLICY_CHOICES


def token_costs(shapes, num_stages: int) -> StageCosts:
    """Stand-in stage costs proportional to computed tokens ``b (E + D)`` (forward 1, backward 2 per
    token, 1 KB stored per token); for policies that need costs when no cost model is at hand."""
    arr = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    tokens = arr[:, 0] * (arr[:, 1] + arr[:, 2])  # (M,)
    per_stage = np.tile(tokens, (num_stages, 1))  # (S, M)
    return StageCosts(
        fwd_s=per_stage * 1e-6,
        bwd_s=per_stage * 2e-6,
        stored_bytes=per_stage * 1024.0,
        peak_bytes=per_stage * 2048.0,
        send_bytes=per_stage * 4.0,
    )


def compute_schedule(
    policy: str, shapes, num_stages: int, costs: StageCosts | None = None, memory_limit_bytes=None, links=(),
    *, send_time=None, model_state_bytes=0.0,
) -> ComputeSchedule:
    """The compute schedule of one replica's micro-batches under ``policy`` (one of :data:`POLICIES`);
    ``links``: token-slice chains (:mod:`dynabatch.schedule.chains`). The memory-aware policies price
    memory as ``dynabatch simulate`` does: ``memory_limit_bytes`` is the whole device, of which each
    stage's ``model_state_bytes`` (scalar or per stage) are taken first; ``costs.stored_bytes`` should
    include the message buffers (:func:`~dynabatch.schedule.simulate.with_message_buffers`); ``send_time``
    (seconds per message, or a function of its bytes) delays the receiving stage."""
    num_mb = len(shapes)
    if policy == "gpipe":
        return gpipe(num_mb, num_stages, links=links)
    if policy == "1f1b":
        return one_f_one_b(num_mb, num_stages, links=links)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    costs = costs if costs is not None else token_costs(shapes, num_stages)
    if policy == "adaptive":
        return adaptive(costs, memory_limit_bytes, links=links, send_time=send_time, model_state_bytes=model_state_bytes)
    return choose_schedule(costs, memory_limit_bytes, links=links, send_time=send_time,
                           model_state_bytes=model_state_bytes)[0]


def lower_step(
    replica_shapes: Sequence,
    spec: PipelineSpec,
    *,
    policy: str = "1f1b",
    step: int = 0,
    costs: Sequence[StageCosts] | None = None,
    memory_limit_bytes=None,
    schedules: Sequence[ComputeSchedule] | None = None,
    slice_links: Sequence[Sequence[int]] | None = None,
    model_state_bytes=0.0,
    placement: Placement | None = None,
) -> dict[int, ExecutionPlan]:
    """Validated plans of every rank: replica ``p`` runs the micro-batches of shapes ``replica_shapes[p]``
    (``(M_p, 3)``, each ``M_p >= 1``); ``costs[p]`` (default :func:`token_costs`) drives the adaptive
    policies and the order of messages on links. ``schedules[p]``, when given (the trainer's planner
    already chose them ahead of time), is used instead of computing the policy's schedule again.
    ``slice_links[p]``: replica ``p``'s token-slice chains (:mod:`dynabatch.schedule.chains`).

    Every plan is validated (pairing, deadlock, data dependencies); with ``costs`` and
    ``memory_limit_bytes`` (the whole device, of which each stage's ``model_state_bytes`` are taken
    first) the validator also checks every rank's memory: the exact message and load buffers of the
    plan plus the stored and peak activation bytes of ``costs`` (:func:`check_step_memory`).

    ``placement`` with several chunks per device (virtual stages, :mod:`dynabatch.schedule.placement`): ``spec``
    and ``costs`` describe the chunks; each replica's ops are ordered by the placement's list scheduler (memory
    admission under ``memory_limit_bytes``; ``policy`` is not used) and lowered onto the devices
    (:func:`~dynabatch.schedule.virtual.lower_placed`)."""
    placed = placement is not None and placement.chunks_per_device > 1
    num_replicas = len(replica_shapes)
    plans: dict[int, ExecutionPlan] = {}
    for p, shapes in enumerate(replica_shapes):
        shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        if len(shapes) == 0:
            raise ValueError(f"replica {p} has no micro-batches; every replica needs at least one")
        links = tuple(slice_links[p]) if slice_links is not None else ()
        c = costs[p] if costs is not None else token_costs(shapes, spec.num_stages)
        if placed:
            if c.moves is not None and np.any(c.moves):
                raise ValueError("moving stage boundaries need one chunk per device; use --placement linear")
            plans.update(_lower_placed(shapes, spec, c, placement, p, num_replicas, step, links, memory_limit_bytes,
                                       model_state_bytes, schedules[p] if schedules is not None else None))
            continue
        if schedules is not None:
            schedule = schedules[p]
        else:
            schedule = compute_schedule(policy, shapes, spec.num_stages, with_message_buffers(c), memory_limit_bytes,
                                        links, model_state_bytes=model_state_bytes)
        plans.update(
            lower(
                schedule,
                shapes,
                spec,
                replica_index=p,
                num_replicas=num_replicas,
                step=step,
                fwd_s=c.fwd_s,
                bwd_s=c.bwd_s,
                links=links,
                check=False,
                recompute=c.recompute,
                moves=c.moves,
            )
        )
    if costs is not None and memory_limit_bytes is not None and all(_priced(c) for c in costs):
        check_step_memory(plans, costs, memory_limit_bytes, model_state_bytes, step=step, policy=policy)
    else:  # no limit, or a shape the cost model cannot price (outside a profile's grid): no memory check
        validate_or_raise(plans)
    return plans


def _lower_placed(shapes, spec: PipelineSpec, costs: StageCosts, placement: Placement, replica: int, num_replicas: int,
                  step: int, links, memory_limit_bytes, model_state_bytes,
                  schedule: ComputeSchedule | None = None) -> dict[int, ExecutionPlan]:
    """One replica's device plans on a virtual-stage placement, lowered (not yet validated) from ``schedule``'s
    device orders (the planner's, :func:`~dynabatch.schedule.virtual.chunk_schedule`) or else list-scheduled here
    with free sends."""
    orders = schedule.device_orders if schedule is not None and schedule.device_orders else \
        placed_step(costs, placement, model_state_bytes, memory_limit_bytes, links=links).order
    return lower_placed(orders, shapes, spec, placement, replica_index=replica, num_replicas=num_replicas,
                        step=step, fwd_s=costs.fwd_s, bwd_s=costs.bwd_s, check=False, links=links,
                        recompute=costs.recompute)


def _priced(costs: StageCosts) -> bool:
    """Every micro-batch's memory is known (a profile prices shapes beyond its grid as ``INFEASIBLE``)."""
    arrays = (np.asarray(costs.stored_bytes), np.asarray(costs.peak_bytes))
    return all(bool(np.all(np.isfinite(a) & (a < INFEASIBLE))) for a in arrays)


def check_step_memory(plans, costs: Sequence[StageCosts], memory_limit_bytes, model_state_bytes, *, step: int,
                      policy: str) -> None:
    """Validate ``plans`` with memory: each stage may hold ``memory_limit_bytes - model_state_bytes[s]`` of
    buffers and activations. A plan over it is a one-line ``ValueError`` naming the step, the stage and
    the bytes; any other finding raises :class:`~dynabatch.schedule.validate.PlanValidationError`."""
    first = next(iter(plans.values()))
    num_stages, num_devices = first.num_stages, first.num_devices
    states = per_stage_values(model_state_bytes, num_stages, "model_state_bytes")
    device_states = np.array([states[d::num_devices].sum() for d in range(num_devices)])  # every chunk a device holds
    states = device_states[np.arange(num_stages) % num_devices]
    limits = per_stage_values(memory_limit_bytes, num_stages, "memory_limit_bytes") - states
    report = validate(plans, stored_bytes={p: c.stored_bytes for p, c in enumerate(costs)},
                      peak_bytes={p: c.peak_bytes for p, c in enumerate(costs)}, memory_limit_bytes=limits)
    if report.ok:
        return
    memory = [e for e in report.errors if "> limit" in e]
    if len(memory) != len(report.errors):
        raise PlanValidationError(report)
    gib = 2**30
    placed = num_devices < num_stages  # virtual stages: the placement's schedule, not --policy, ordered the ops
    what = f"{num_stages // num_devices}-chunk placement's" if placed else f"{policy}"
    advice = ("raise --memory-gib, use more devices or --placement linear" if placed else
              "use --policy adaptive or auto (memory-aware), raise --memory-gib or use more stages")
    raise ValueError(
        f"step {step}: the {what} schedule does not fit the device memory ({np.max(memory_limit_bytes) / gib:.3f} "
        f"GiB, model states {np.max(states) / gib:.3f} GiB on the largest {'device' if placed else 'stage'}): "
        f"{memory[0]}; {advice}"
    )


def without_update(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` without its ``REDUCE`` and ``STEP`` instructions."""
    skip = (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP)
    return replace(plan, instructions=tuple(i for i in plan.instructions if i.op not in skip))


def forward_only_plan(plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` as an evaluation pass: only its loads, forwards and activation transfers (their starts and
    waits), in their order, each micro-batch's ``FREE`` moved right after its last remaining instruction
    (no backward, gradient transfer, ``REDUCE`` or ``STEP``). The executor runs a plan without backwards
    under ``no_grad`` with the stage in eval mode (:class:`~dynabatch.engine.executor.Executor`).

    Why it is safe: the training plan it comes from was validated, and both ends of each link still issue
    its activation messages in the same order (dropping the gradient messages keeps the relative order of
    the others). Activations only flow downstream, so a rank can wait only on an earlier stage, whose sends
    do not wait on anything later: the dependencies cannot form a cycle."""
    dropped = (Op.BACKWARD, Op.SEND_GRAD, Op.RECV_GRAD, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP, Op.FREE)
    kept = [i for i in plan.instructions
            if i.op not in dropped and not (i.op is Op.WAIT and i.waits_on in (Op.SEND_GRAD, Op.RECV_GRAD))]
    frees = {(i.stage, i.micro_batch): i for i in plan.instructions if i.op is Op.FREE}
    last = {(i.stage, i.micro_batch): k for k, i in enumerate(kept)}
    out = []
    for k, ins in enumerate(kept):
        out.append(ins)
        key = (ins.stage, ins.micro_batch)
        if last[key] == k and key in frees:
            out.append(frees[key])
    return replace(plan, instructions=tuple(out))
