"""Online calibration: per-stage forward/backward times fitted to what the executor measures, as the run goes.

Every decision of the planner and the scheduler comes from predicted stage times. The analytic ``cpu``
preset is 8-50x optimistic on a real machine, and even a measured profile misses what a training step
adds (ranks sharing cores, transfers, the optimizer, the planner thread). The executor already times
every forward ``F`` and backward ``B`` instruction, so the run itself is the calibration data.

Model. For stage ``s`` and direction ``d`` (forward, backward) the time of a micro-batch is
``theta[s, d] . features``, with features (:data:`FEATURES`)

* ``base``: the warm-start model's own prediction for that stage and direction (the analytic preset,
  or a profile's tables when ``--cost-profile`` is given);
* ``micro_batch``: 1 (per-micro-batch fixed cost: Python, kernel launches, allocator);
* ``tokens`` (T5: ``enc_tokens``, ``dec_tokens``): padded tokens ``b E`` (``b D``), what every linear
  layer computes;
* ``pairs`` (T5: ``enc_pairs``, ``dec_pairs``, ``cross_pairs``): attention score pairs
  (:class:`~dynabatch.cost.pairs.AttentionPairs`; dense ``b E^2`` without per-segment attention);
* ``calls``: attention-core calls per layer (one per group of near-equal-length segments).

The warm start is ``theta0 = (1, 0, ..., 0)``: the base model exactly. The fit
(:func:`~dynabatch.cost.robust_fit.fit_relative`: relative error, Huber-weighted, non-negative, anchored to
the warm start with the weight of :attr:`OnlineFit.prior_weight` observations) moves from there as
measurements arrive: a scale on the base model, fixed costs per micro-batch, per token and per pair.
Only the last :attr:`OnlineFit.window_steps` steps count, so the fit follows a machine whose speed drifts.

Determinism. Planning step ``k`` uses the fit *as of* step ``k - plan_ahead - 1`` (every measurement of
steps up to that one, none after), which the training loop has always recorded by the time the
planner thread gets there; :meth:`OnlineFit.coefficients` is a pure function of the stored observations,
and the observations are part of the checkpoint, so a resumed run plans exactly as an uninterrupted one.

The step prediction adds what the simulated makespan of per-op times leaves out (delivery, bookkeeping
between ops, waits on transfers, the reduce and the optimizer step): the median of measured minus
predicted step time over the last :attr:`OnlineFit.overhead_steps` steps. Memory gets the same treatment:
per stage, the measured peak of saved activations over the predicted one; the planner scales its stored
bytes by the 90th percentile of that ratio over the window when it is above 1 (never below: a
prediction that was too high costs only some packing, one that was too low costs an out-of-memory). The
scale never makes a single sample infeasible that the base model admits (it cannot be split further; a run
that admitted it at start keeps admitting it): such a sample is priced at most at the budget's edge, and one the
run admitted only by recomputing activations (``--recompute auto``, whose recompute-mode bytes the scale raises as
well) keeps the memory it was admitted with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from dynabatch.cost.robust_fit import fit_relative
from dynabatch.cost.stages import StageCostModel, StageCosts, in_flight_buffer_bytes

FEATURES = {
    "causal": ("base", "micro_batch", "tokens", "pairs", "calls"),
    "seq2seq": ("base", "micro_batch", "enc_tokens", "dec_tokens", "enc_pairs", "dec_pairs", "cross_pairs", "calls"),
}
"""Feature names per sequence kind (decoder-only / encoder-decoder), in column order."""

DIRECTIONS = ("fwd", "bwd")


def shape_features(b, E, D, pairs=None) -> np.ndarray:
    """``(N, F - 1)`` shape features (every column of :data:`FEATURES` after ``base``) of micro-batches
    ``(b, E, D)``; ``D = None`` for decoder-only. ``pairs``: per-segment attention work (``None``: dense)."""
    b, E = (np.atleast_1d(np.asarray(x, dtype=np.float64)).ravel() for x in (b, E))
    seq2seq = D is not None
    D = np.atleast_1d(np.asarray(D if seq2seq else 0.0, dtype=np.float64)).ravel() * np.ones_like(b)
    if pairs is None:
        enc, dec, cross = b * E * E, b * D * D, b * D * E
        calls = np.full_like(b, 3.0 if seq2seq else 1.0)
    else:
        enc, dec, cross = (np.broadcast_to(np.asarray(p, dtype=np.float64).ravel(), b.shape) for p in
                           (pairs.encoder, pairs.decoder, pairs.cross))
        calls = (np.full_like(b, 3.0 if seq2seq else 1.0) if pairs.calls is None else
                 sum(np.broadcast_to(np.asarray(c, dtype=np.float64).ravel(), b.shape) for c in
                     (pairs.calls if seq2seq else pairs.calls[:1])))
    ones = np.ones_like(b)
    cols = [ones, b * E, b * D, enc, dec, cross, calls] if seq2seq else [ones, b * E, enc, calls]
    return np.stack(cols, axis=1)


def prior_coefficients(num_stages: int, seq2seq: bool) -> np.ndarray:
    """``(S, 2, F)`` warm start: the base model exactly."""
    theta = np.zeros((num_stages, 2, len(FEATURES["seq2seq" if seq2seq else "causal"])))
    theta[:, :, 0] = 1.0
    return theta


@dataclass(frozen=True)
class CalibratedStageCostModel(StageCostModel):
    """A :class:`StageCostModel` whose times are ``coefficients . features`` (module docstring) and whose
    stored bytes are scaled per stage by ``memory_scale``; with neither it is the base model exactly."""

    coefficients: np.ndarray | None = None
    """``(S, 2, F)``: per stage, forward and backward coefficients over :data:`FEATURES`."""
    memory_scale: tuple[float, ...] | None = None
    """Per stage, the factor on stored activation bytes (>= 1)."""

    @classmethod
    def of(cls, base: StageCostModel, coefficients=None, memory_scale=None) -> "CalibratedStageCostModel":
        base = base.base if isinstance(base, CalibratedStageCostModel) else base
        return cls(base.model, base.layout, base.device_memory_bytes, base.optimizer, base.memory_margin,
                   base.recompute, zero=base.zero, replicas=base.replicas,
                   moving_boundaries=base.moving_boundaries, coefficients=coefficients,
                   memory_scale=memory_scale)

    @property
    def base(self) -> StageCostModel:
        return StageCostModel(self.model, self.layout, self.device_memory_bytes, self.optimizer, self.memory_margin,
                              self.recompute, zero=self.zero, replicas=self.replicas,
                              moving_boundaries=self.moving_boundaries)

    @property
    def seq2seq(self) -> bool:
        return any("t5_decoder" in s for s in self.layout.stages)

    def features(self, b, E, D, pairs=None, base: StageCosts | None = None, modes=None) -> np.ndarray:
        """``(S, 2, N, F)``: every stage's forward and backward features of micro-batches ``(b, E, D)``
        (``base``: the base model's costs of them, when already at hand; else the base model's under the
        recompute ``modes`` they ran with, default none)."""
        bb, EE, DD = self._inputs(b, E, D)
        if base is None:
            base = self.base._priced(b, E, D, pairs) if modes is None else self.base.per_stage(b, E, D, pairs, modes)
        shape = shape_features(bb, EE, DD, pairs)  # (N, F - 1)
        n, num_stages = shape.shape[0], self.num_stages
        out = np.empty((num_stages, 2, n, shape.shape[1] + 1))
        out[:, :, :, 1:] = shape
        out[:, 0, :, 0] = np.asarray(base.fwd_s).reshape(num_stages, n)
        out[:, 1, :, 0] = np.asarray(base.bwd_s).reshape(num_stages, n)
        return out

    def _priced(self, b, E, D, pairs=None, layers: dict | None = None) -> StageCosts:
        costs = super()._priced(b, E, D, pairs, layers)
        if self.coefficients is not None:
            x = self.features(b, E, D, pairs, base=costs)
            t = np.einsum("sdnf,sdf->sdn", x, self.coefficients)
            shape = np.shape(costs.fwd_s)
            costs = replace(costs, fwd_s=t[:, 0].reshape(shape), bwd_s=t[:, 1].reshape(shape))
        if self.memory_scale is not None:
            costs = replace(costs, stored_bytes=self._scaled_stored(costs, b))
        return costs

    def _scaled_stored(self, costs: StageCosts, b) -> np.ndarray:
        """Stored bytes scaled per stage by :attr:`memory_scale`, except that the scale never makes a one-sample
        micro-batch infeasible that the base model admits: a single sample cannot be split further, so a run that
        admitted it at start (priced by the base model) must keep admitting it whatever the fit measures later.
        Such a sample's stored bytes are scaled only up to what still fits ``S`` in flight (the planner's bound:
        ``S (stored + buffers) + peak <= budget``); where the scale would push it over, it is priced at that edge.
        Micro-batches of several samples take the full scale (the planner can split them)."""
        stored = costs.stored_bytes
        scale = np.asarray(self.memory_scale, dtype=np.float64).reshape((-1,) + (1,) * (stored.ndim - 1))
        scaled = stored * scale
        single = np.broadcast_to(np.asarray(b, dtype=np.float64) == 1, stored.shape[1:])
        if not single.any():
            return scaled
        buffers = in_flight_buffer_bytes(costs).max(axis=0)
        peak = costs.peak_bytes.max(axis=0)
        edge = (self.memory_budget_bytes - peak) / self.num_stages - buffers  # largest stored that still fits
        base_fits = stored.max(axis=0) <= edge
        keep = single & base_fits
        return np.where(keep, np.minimum(scaled, np.maximum(stored, edge)), scaled)

    def per_stage(self, b, E, D, pairs=None, modes=None) -> StageCosts:
        costs = super().per_stage(b, E, D, pairs, modes)
        if self.memory_scale is None or modes is not None:
            return costs
        return self._keep_admitted(costs, b, E, D, pairs)

    def _keep_admitted(self, costs: StageCosts, b, E, D, pairs) -> StageCosts:
        """``costs`` where every one-sample micro-batch that fits unscaled still fits scaled: the stored-bytes clamp
        (:meth:`_scaled_stored`) prices a sample at the budget's edge without recomputation, but a sample the run
        admitted only by recomputing (``--recompute auto``) is priced in a recompute mode whose bytes the scale
        raises too (stored and peak), past the budget the start-up check admitted it under. Where the scaled
        pricing does not fit ``S`` in flight (the partition's own test on :meth:`reduce`) and the unscaled one does,
        the micro-batch keeps its unscaled memory (and the recompute mode it fits in), with the fitted times."""
        single = np.broadcast_to(np.asarray(b, dtype=np.float64) == 1, costs.fwd_s.shape[1:])
        if not single.any():
            return costs
        scaled_fits = self._fits(costs)
        if np.all(scaled_fits | ~single):
            return costs
        plain = replace(self, memory_scale=None).per_stage(b, E, D, pairs)
        back = single & ~scaled_fits & self._fits(plain)
        if not back.any():
            return costs

        def pick(kept, scaled):
            if kept is None and scaled is None:
                return None
            kept, scaled = (np.zeros(costs.fwd_s.shape, np.int8) if x is None else x for x in (kept, scaled))
            return np.where(back, kept, scaled)

        return StageCosts(*(pick(getattr(plain, f.name), getattr(costs, f.name)) for f in fields(StageCosts)))

    def _fits(self, costs: StageCosts) -> np.ndarray:
        """Per micro-batch: ``S stored + peak <= budget`` on the planner's view (:meth:`reduce`)."""
        _, stored, peak = self.reduce(costs)
        return self.num_stages * stored + peak <= self.memory_budget_bytes

    def evaluate(self, b, E, D, pairs=None):
        if self.coefficients is None and self.memory_scale is None:
            return super().evaluate(b, E, D, pairs)
        return self.reduce(self.per_stage(b, E, D, pairs))


@dataclass
class OnlineFit:
    """Measured stage times and memory of a run, and the fit of them as of any step (module docstring)."""

    num_stages: int
    seq2seq: bool
    window_steps: int = 50
    """Only observations of the last this-many steps (up to the as-of step) count."""
    prior_weight: float = 8.0
    """Weight of the warm start, in observations."""
    overhead_steps: int = 10
    """Steps whose measured - predicted step time give the step overhead."""
    theta0: np.ndarray | None = None
    """``(S, 2, F)`` warm start (default: the base model exactly, :func:`prior_coefficients`)."""
    observations: list[tuple[int, int, int, list[float], float]] = field(default_factory=list)
    """``(step, stage, direction, features, seconds)`` per measured forward / backward."""
    step_residuals: list[tuple[int, float]] = field(default_factory=list)
    """``(step, measured - predicted step seconds)``."""
    memory_ratios: list[tuple[int, int, float]] = field(default_factory=list)
    """``(step, stage, measured / predicted saved-activation peak)``."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.theta0 is None:
            self.theta0 = prior_coefficients(self.num_stages, self.seq2seq)
        self.theta0 = np.asarray(self.theta0, dtype=np.float64)

    @property
    def num_features(self) -> int:
        return self.theta0.shape[-1]

    @property
    def latest_step(self) -> int | None:
        steps = [o[0] for o in self.observations] + [r[0] for r in self.step_residuals]
        return max(steps) if steps else None

    def add_times(self, step: int, stage: int, direction: int, features: np.ndarray, seconds: np.ndarray) -> None:
        """Measured ``seconds`` (n,) of micro-batches with ``features`` (n, F) on ``stage``."""
        for x, t in zip(np.asarray(features, dtype=np.float64), np.asarray(seconds, dtype=np.float64)):
            if np.isfinite(t) and t > 0:
                self.observations.append((int(step), int(stage), int(direction), [float(v) for v in x], float(t)))
        self._cache.clear()

    def add_step(self, step: int, measured_s: float, predicted_s: float) -> None:
        if np.isfinite(measured_s) and np.isfinite(predicted_s):
            self.step_residuals.append((int(step), float(measured_s - predicted_s)))
            self._cache.clear()

    def add_memory(self, step: int, measured: list, predicted: list) -> None:
        for s, (m, p) in enumerate(zip(measured, predicted)):
            if m is not None and p and p > 0:
                self.memory_ratios.append((int(step), s, float(m) / float(p)))
        self._cache.clear()

    def _window(self, rows, as_of: int, length: int) -> list:
        return [r for r in rows if as_of - length < r[0] <= as_of]

    def coefficients(self, as_of: int) -> np.ndarray:
        """``(S, 2, F)`` fit of the observations of steps ``(as_of - window_steps, as_of]``."""
        key = ("theta", as_of)
        if key not in self._cache:
            rows = self._window(self.observations, as_of, self.window_steps)
            theta = self.theta0.copy()
            for s in range(self.num_stages):
                for d in range(2):
                    mine = [(x, t) for _, st, dd, x, t in rows if st == s and dd == d]
                    if mine:
                        x = np.array([m[0] for m in mine])
                        t = np.array([m[1] for m in mine])
                        theta[s, d] = fit_relative(x, t, self.theta0[s, d], self.prior_weight)
            self._cache[key] = theta
        return self._cache[key]

    def scales(self, as_of: int) -> np.ndarray:
        """``(S, 2, F)`` coefficients of the base model scaled per stage and direction (``--plan-costs scaled``): the
        fit's summed prediction over the micro-batches measured in the window divided by the base model's, as the
        ``base`` coefficient, every other coefficient zero (1, the base exactly, where nothing was measured).

        The scaled model keeps the base model's *ranking* of micro-batch shapes within a stage (FLOP counts or a
        profile: which cut of a global batch is cheaper) and takes from the measurements only what the base model
        gets wrong as a whole: each stage's and direction's time against the others' and against transfers. The
        full fit also re-weighs the shape terms (per micro-batch, per token, per pair) from the shapes the run's own
        plans produced, which predicts those plans well but can rank other cuts worse (docs/benchmarks/calibration/, *Online
        calibration*)."""
        key = ("scales", as_of)
        if key not in self._cache:
            theta = self.coefficients(as_of)
            out = np.zeros_like(theta)
            out[:, :, 0] = 1.0
            rows = self._window(self.observations, as_of, self.window_steps)
            for s in range(self.num_stages):
                for d in range(2):
                    x = np.array([r[3] for r in rows if r[1] == s and r[2] == d], dtype=np.float64)
                    if len(x) and x[:, 0].sum() > 0:
                        out[s, d, 0] = float((x @ theta[s, d]).sum() / x[:, 0].sum())
            self._cache[key] = out
        return self._cache[key]

    def overhead_s(self, as_of: int) -> float:
        """Median measured - predicted step seconds over the last :attr:`overhead_steps` steps up to ``as_of``."""
        rows = self._window(self.step_residuals, as_of, self.overhead_steps)
        return float(np.median([r[1] for r in rows])) if rows else 0.0

    def memory_scale(self, as_of: int) -> tuple[float, ...]:
        """Per stage, ``max(1, p90 of measured / predicted saved peak)`` over the window."""
        rows = self._window(self.memory_ratios, as_of, self.window_steps)
        out = []
        for s in range(self.num_stages):
            r = [v for _, st, v in rows if st == s]
            out.append(max(1.0, float(np.percentile(r, 90))) if r else 1.0)
        return tuple(out)

    def prune(self, keep_after: int) -> None:
        """Drop what no fit as of a step ``>= keep_after`` can use."""
        lo = keep_after - max(self.window_steps, self.overhead_steps)
        self.observations = [o for o in self.observations if o[0] > lo]
        self.step_residuals = [r for r in self.step_residuals if r[0] > lo]
        self.memory_ratios = [r for r in self.memory_ratios if r[0] > lo]
        self._cache.clear()

    def state_dict(self) -> dict:
        return {"num_stages": self.num_stages, "seq2seq": self.seq2seq, "window_steps": self.window_steps,
                "prior_weight": self.prior_weight, "overhead_steps": self.overhead_steps,
                "theta0": self.theta0.tolist(), "observations": [list(o) for o in self.observations],
                "step_residuals": [list(r) for r in self.step_residuals],
                "memory_ratios": [list(r) for r in self.memory_ratios]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "OnlineFit":
        return cls(state["num_stages"], state["seq2seq"], state["window_steps"], state["prior_weight"],
                   state["overhead_steps"], np.array(state["theta0"]),
                   [(int(o[0]), int(o[1]), int(o[2]), list(o[3]), float(o[4])) for o in state["observations"]],
                   [(int(r[0]), float(r[1])) for r in state["step_residuals"]],
                   [(int(r[0]), int(r[1]), float(r[2])) for r in state["memory_ratios"]])
