"""The one memory check of ``dynabatch plan`` and ``dynabatch simulate``: a plan fits the device memory when the
schedule :func:`~dynabatch.schedule.policies.choose_schedule` gives it (every policy and micro-batch order, then
the seeded search) keeps every device's simulated peak, model states included, within the device limit (the
device memory less the cost model's margin). ``simulate`` reports that schedule's step; ``plan`` reports the step
formula beside the same check, so the two commands agree on whether a plan fits (the planner's admission bound,
``S x stored + peak``, is stricter than the schedule, which admits micro-batches by their actual memory)."""

from __future__ import annotations

from dynabatch.plan.slice_costs import piece_costs
from dynabatch.schedule.policies import choose_schedule
from dynabatch.schedule.simulate import with_message_buffers

DEFAULT_LINK = "intra"
"""The link between pipeline neighbours ``plan`` checks with (``simulate``'s ``--link`` default)."""
DEFAULT_SEARCH_STEPS = 24
"""``choose_schedule``'s local-search moves ``plan`` checks with (``simulate``'s ``--search-steps`` default)."""


def memory_limit_bytes(cost_model) -> float:
    """The device limit a schedule must stay within: the device memory less the cost model's margin."""
    return cost_model.device_memory_bytes * (1 - cost_model.memory_margin)


def send_times(cost_model, send_bytes, link: str = DEFAULT_LINK):
    """Seconds of each message of ``send_bytes`` to a pipeline neighbour over ``link``, as the layer model prices
    it (the analytic model's); ``None`` (free) for a model without link costs (``--cost-profile``'s tables, as the
    trainer's planner takes them: :func:`~dynabatch.training.step_score.send_time_of`)."""
    send_time = getattr(cost_model.model, "send_time", None)
    return None if send_time is None else send_time(send_bytes, link)


def schedule_pieces(cost_model, slicer, shapes, contexts, links, pairs, *, seed: int,
                    link: str = DEFAULT_LINK, search_steps: int = DEFAULT_SEARCH_STEPS):
    """``(schedule, result)`` of micro-batches ``shapes`` (per segment: ``pairs``; token slices with their
    ``contexts`` and chain ``links``, priced by ``slicer``) under ``cost_model`` on the linear placement:
    ``result.fits_memory`` and ``result.peak_memory_bytes`` are the check."""
    costs = with_message_buffers(piece_costs(cost_model, slicer, shapes, contexts, links, pairs))
    send = send_times(cost_model, costs.send_bytes, link)
    return choose_schedule(costs, memory_limit_bytes(cost_model), send_time=send,
                           model_state_bytes=cost_model.model_state_bytes, num_search_steps=search_steps,
                           seed=seed, links=links)


def schedule_plan(cost_model, slicer, plan, seed: int, *, link: str = DEFAULT_LINK,
                  search_steps: int = DEFAULT_SEARCH_STEPS):
    """:func:`schedule_pieces` of a :class:`~dynabatch.training.workload.MethodPlan`."""
    return schedule_pieces(cost_model, slicer, plan.shapes, plan.contexts, plan.slice_links, plan.pairs, seed=seed,
                           link=link, search_steps=search_steps)
