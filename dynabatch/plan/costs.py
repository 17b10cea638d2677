"""What the planner needs to know about a micro-batch: its time and its activation memory.

The planner never profiles anything. It asks a :class:`MicroBatchCostModel` about *padded* micro-batch
shapes ``(b, E, D)``: ``b`` samples padded to encoder length ``E`` and decoder length ``D`` (decoder-only
models: ``E`` is the sequence length, inputs + targets, and ``D = 0``). One vectorised call answers for
every candidate micro-batch at once, so a cost model can be a dense table lookup, an analytic roofline or
the polynomial below; the profiled tables of :mod:`dynabatch.cost` are adapted to this interface.

Contract (the planner relies on it):

* ``evaluate`` returns three float64 arrays shaped like ``b``: the forward + backward time in seconds of
  the *bottleneck* pipeline stage, the activation bytes that stage stores per micro-batch until its
  backward, and the extra transient (peak) bytes while it runs one micro-batch's forward or backward.
* All three are finite, >= 0 and non-decreasing in ``b``, ``E`` and ``D`` (a bigger or longer micro-batch
  never costs less). The planner makes times non-decreasing along each run anyway, so a slightly noisy
  table only loses exactness, never feasibility.
* ``memory_budget_bytes`` is the activation memory of one stage: device memory minus model states
  (parameters, gradients, optimizer states) minus a safety margin.
* Optionally ``evaluate(b, E, D, pairs=...)`` takes :class:`~dynabatch.cost.pairs.AttentionPairs` shaped
  like ``b``: the score pairs per-segment (padding-free) attention computes, summed over the rows and the
  samples packed in them. Without it a model prices dense ``b x Tq x Tk`` attention. The planner passes
  pairs only when it packs rows (``plan_step(pack_rows="auto")``); every cost model of ``dynabatch.cost``
  and :class:`PolynomialCostModel` accept them.

:class:`PolynomialCostModel` is a small analytic stand-in for tests and benchmarks. Its defaults describe
one stage of a T5-base-sized model (d = 768, 6 layers per stage of 4) on an accelerator sustaining
1e14 FLOP/s, activations after Korthikanti et al. 2022 (16-bit, no recomputation)::

    time   = overhead + time_per_token * b (E + D) + time_per_token_pair * b (E^2 + D^2 + E D)
    stored = stored_per_token * b (E + D) + stored_per_token_pair * b (E^2 + D^2 + E D)
    peak   = peak_per_token * b (E + D) + peak_per_token_pair * b (E^2 + D^2 + E D)

``E^2``, ``D^2`` and ``E D`` are encoder self-, decoder self- and cross-attention; with ``pairs`` the
``b (E^2 + D^2 + E D)`` term is their sum ``pairs.encoder + pairs.decoder + pairs.cross``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class MicroBatchCostModel(Protocol):
    """Time and activation memory of padded micro-batches on the bottleneck pipeline stage."""

    memory_budget_bytes: float
    """Activation memory available per stage (device memory left after model states)."""

    def evaluate(self, b: np.ndarray, E: np.ndarray, D: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(time_s, stored_bytes, peak_bytes)`` for micro-batches of ``b`` samples padded to ``(E, D)``.

        Inputs are int64 arrays of one shape; outputs are float64 arrays of that shape.
        """
        ...


@dataclass(frozen=True)
class PolynomialCostModel:
    """Analytic cost of one pipeline stage, polynomial in the padded shape (see the module docstring)."""

    memory_budget_bytes: float = 16 * 2**30
    """Activation memory per stage in bytes (default 16 GiB)."""
    overhead_s: float = 5e-4
    """Fixed time per micro-batch: kernel launches, p2p latency, small-batch inefficiency."""
    time_per_token_s: float = 2.5e-6
    """Linear layers, fwd + bwd: 72 d^2 FLOPs per padded token per layer x 6 layers / 1e14 FLOP/s."""
    time_per_token_pair_s: float = 5.5e-10
    """Attention scores, fwd + bwd: 12 d FLOPs per (query, key) pair per layer x 6 layers / 1e14 FLOP/s."""
    stored_per_token_bytes: float = 6 * 34 * 768
    """Korthikanti Eq. 1 linear term: 34 d bytes per token per layer x 6 layers."""
    stored_per_token_pair_bytes: float = 6 * 5 * 12
    """Korthikanti Eq. 1 attention term: 5 bytes per head per (query, key) pair, 12 heads, 6 layers."""
    peak_per_token_bytes: float = 8 * 768 * 2
    """Transient backward buffers: a few hidden-state gradients (16-bit) per token."""
    peak_per_token_pair_bytes: float = 2 * 2 * 12
    """Attention-score gradient of one layer: 16-bit, 12 heads, twice."""

    def __post_init__(self) -> None:
        check_non_negative_fields(self)

    def evaluate(self, b: np.ndarray, E: np.ndarray, D: np.ndarray, pairs=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = np.asarray(b, dtype=np.float64)
        E = np.asarray(E, dtype=np.float64)
        D = np.asarray(D, dtype=np.float64)
        tokens = b * (E + D)
        if pairs is None:
            pairs = b * (E * E + D * D + E * D)
        else:
            pairs = pairs.encoder + pairs.decoder + pairs.cross
        time_s = self.overhead_s + self.time_per_token_s * tokens + self.time_per_token_pair_s * pairs
        stored = self.stored_per_token_bytes * tokens + self.stored_per_token_pair_bytes * pairs
        peak = self.peak_per_token_bytes * tokens + self.peak_per_token_pair_bytes * pairs
        return time_s, stored, peak


# --------------------------------------------------------------------------- checks shared by the planners


def check_int(name: str, value) -> None:
    """``ValueError`` unless ``value`` is an int >= 1 (``bool`` is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_non_negative(name: str, value) -> None:
    """``ValueError`` unless ``value`` is finite and >= 0."""
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def check_non_negative_fields(obj) -> None:
    """:func:`check_non_negative` on every dataclass field of ``obj``, named ``Class.field``."""
    for f in dataclasses.fields(obj):
        check_non_negative(f"{type(obj).__name__}.{f.name}", getattr(obj, f.name))


def evaluate_costs(
    cost_model, b, x, y, *, what: str = "cost model", axes: tuple[str, str] = ("E", "D"), pairs=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``cost_model.evaluate(b, x, y)`` as three float64 arrays shaped like ``b``, checked against the contract.

    Serves :class:`MicroBatchCostModel` (``x, y = E, D``) and the slice cost model (``what="slice cost
    model", axes=("s", "c")``). ``pairs`` (per-segment attention work, module docstring) is passed on
    only when given. Raises ``ValueError`` on a wrong return type or shape, and names the first query
    whose output is not finite and >= 0.
    """
    if pairs is None:
        out = cost_model.evaluate(b, x, y)
    else:
        try:
            out = cost_model.evaluate(b, x, y, pairs=pairs)
        except TypeError as e:
            if "pairs" not in str(e):
                raise
            raise ValueError(f"{what} {type(cost_model).__name__} does not price per-segment attention "
                             f"(evaluate has no pairs argument); plan with pack_rows='off'") from e
    return checked_costs(out, b, x, y, what=what, axes=axes)


def checked_costs(out, b, x, y, *, what: str = "cost model", axes: tuple[str, str] = ("E", "D")):
    """``out``, what a cost model's ``evaluate`` returned for the queries ``(b, x, y)``, as three float64 arrays
    shaped like ``b``, checked against the contract (:func:`evaluate_costs`)."""
    if not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(f"{what} evaluate must return (time_s, stored_bytes, peak_bytes), got {type(out)}")
    arrays = tuple(np.asarray(a, dtype=np.float64) for a in out)
    for name, a in zip(("time_s", "stored_bytes", "peak_bytes"), arrays):
        if a.shape != b.shape:
            raise ValueError(f"{what} {name} has shape {a.shape}, expected {b.shape}")
        if a.size and a.min() >= 0 and a.max() < np.inf:  # two passes, no temporaries (NaN fails the first)
            continue
        bad = ~(np.isfinite(a) & (a >= 0))
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(
                f"{what} {name} must be finite and >= 0; got {a.flat[k]} for shape "
                f"(b={b.flat[k]}, {axes[0]}={x.flat[k]}, {axes[1]}={y.flat[k]})"
            )
    return arrays  # type: ignore[return-value]
