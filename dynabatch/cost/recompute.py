"""Activation recomputation in the cost model: what each mode costs, and the mode each micro-batch runs.

Modes (:data:`~dynabatch.core.policies.RECOMPUTE_MODES`, cheapest in time first), per micro-batch and stage:

* ``none``: every activation the forward makes is stored until the backward.
* ``selective``: the attention cores (scores, softmax, dropout, weighted values) run again in backward;
  their Q, K, V inputs stay stored. Extra time: the cores' forward. Freed: what the cores alone store
  (with a fused kernel only its log-sum-exp, with unfused attention the ``h Tq Tk`` probabilities).
* ``full``: each transformer block stores only its input hidden states and runs its whole forward
  again in backward. Extra time: the blocks' forward. Freed: every block's stored bytes but its input.

While one block (core) runs its backward its activations exist again, so a recomputing mode adds the
largest block's (core's) stored bytes to the stage's transient peak. A layer-level model provides these
numbers with ``recompute_terms(kinds, b, E, D, pairs) -> RecomputeTerms`` (the analytic model does);
:class:`~dynabatch.cost.stages.StageCostModel` applies them (:func:`apply_mode`) and, under the policy
``auto``, :func:`choose_modes` picks per micro-batch and stage the fastest mode whose memory fits the
same bound the partition DP uses: ``in_flight (stored + message buffers) + peak <= budget`` with
``in_flight = S`` (1F1B's first stage) on every stage. A micro-batch that fits without recomputation is
never slowed down, so ``auto`` changes nothing where memory does not bind; where it binds, larger
micro-batches fit (the DP sees the recomputing costs through ``evaluate``) and samples too long to
store whole run with recomputation instead of being refused.

Policies (``--recompute``): ``none`` (the default before this module), ``auto``, and ``selective`` /
``full`` (that mode for every micro-batch on every stage). ``auto`` is the dynamic planner's: a baseline
batcher under ``auto`` runs without recomputation (the resolver's rule, :mod:`dynabatch.training.config.resolve`; its knob
is what a user tunes to fit memory), while an explicit ``selective`` / ``full`` applies to every method (``full`` is what Hugging
Face's ``gradient_checkpointing`` does). A token slice (TeraPipe piece) runs the mode chosen for its own
``(1, slice length)`` shape, its costs scaled by the slice cost model like an unsliced piece's
(:func:`~dynabatch.plan.slice_costs.slice_stage_costs`); the runtime recomputes slices exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dynabatch.core.policies import RECOMPUTE_MODES, RECOMPUTE_POLICIES  # mode codes; ``--recompute`` choices

NONE = RECOMPUTE_MODES.index("none")
"""Mode codes are indices into :data:`RECOMPUTE_MODES`."""


@dataclass(frozen=True)
class RecomputeTerms:
    """Per stage-shaped arrays: what the ``selective`` and ``full`` modes add and free (module docstring)."""

    selective_extra_s: np.ndarray
    """Backward seconds added: the attention cores' forward."""
    selective_freed_bytes: np.ndarray
    """Stored bytes the cores no longer keep."""
    selective_peak_bytes: np.ndarray
    """The largest core's stored bytes, live again during its backward."""
    full_extra_s: np.ndarray
    """Backward seconds added: the blocks' forward."""
    full_freed_bytes: np.ndarray
    """Stored bytes the blocks no longer keep (all but their input hidden states)."""
    full_peak_bytes: np.ndarray
    """The largest block's stored bytes, live again during its backward."""

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def check_policy(policy: str) -> str:
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; valid: {', '.join(RECOMPUTE_POLICIES)}")
    return policy


def apply_mode(costs, terms: RecomputeTerms, mode: int):
    """``costs`` (:class:`~dynabatch.cost.stages.StageCosts`, all ``none``) with every entry run in ``mode``;
    ``terms`` are stacked like the costs' arrays."""
    if mode == NONE:
        return costs
    name = RECOMPUTE_MODES[mode]
    extra, freed, again = (getattr(terms, f"{name}_{f}") for f in ("extra_s", "freed_bytes", "peak_bytes"))
    return dataclasses.replace(costs, bwd_s=costs.bwd_s + extra,
                               stored_bytes=np.maximum(costs.stored_bytes - freed, 0.0),
                               peak_bytes=costs.peak_bytes + again)


def choose_modes(by_mode: list, buffers: np.ndarray, in_flight, budget_bytes: float) -> np.ndarray:
    """Per entry of the ``(S, ...)`` costs, the first mode of ``by_mode`` (costs under each mode, fastest
    first) whose ``in_flight (stored + buffers) + peak`` fits ``budget_bytes`` (``in_flight``: an int, or an
    array broadcast against one stage's entries); where none fits, the mode needing the least memory (the
    planner then drops or refuses that micro-batch as before)."""
    need = np.stack([in_flight * (c.stored_bytes + buffers) + c.peak_bytes for c in by_mode])  # (K, S, ...)
    fits = need <= budget_bytes
    first = np.argmax(fits, axis=0)
    return np.where(fits.any(axis=0), first, np.argmin(need, axis=0)).astype(np.int8)


def select(by_mode: list, modes: np.ndarray):
    """The costs of ``by_mode`` entry by entry as ``modes`` (codes into it) says, with ``recompute`` set (what
    ``np.choose`` picks; nested ``np.where`` on one comparison per code is 2-3x faster on the planner's arrays)."""
    base = by_mode[0]
    modes = np.asarray(modes)
    if modes.size and (modes.min() < 0 or modes.max() >= len(by_mode)):
        raise ValueError(f"recompute mode codes must be in [0, {len(by_mode)}), got {modes.min()}..{modes.max()}")
    where = [modes == k for k in range(len(by_mode) - 1)]

    def pick(field: str) -> np.ndarray:
        values = [getattr(c, field) for c in by_mode]
        out = values[-1]
        for k in range(len(values) - 2, -1, -1):
            out = np.where(where[k], values[k], out)
        return out if len(values) > 1 else np.array(np.broadcast_to(out, modes.shape), dtype=np.float64)

    picked = {f: pick(f) for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes")}
    return dataclasses.replace(base, **picked, recompute=modes if np.any(modes) else None)

