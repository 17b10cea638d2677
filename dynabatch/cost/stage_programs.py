"""A layout's per-stage costs as compiled max-plus programs (:mod:`dynabatch.cost.symbolic`).

:class:`~dynabatch.cost.stages.StageCostModel` prices micro-batches on every stage of a layout through its layer
model's ``stage_cost``, ``send_bytes`` and ``recompute_terms``. For the analytic model each call runs hundreds of
numpy operations, so the planner's calls (a partition DP prices thousands of runs a global batch, in a few calls)
are dominated by their fixed cost. :class:`StagePrograms` traces those methods once per *signature* (which of the
decoder length, attention pairs, call counts and longest segments the query has) on symbolic inputs, compiles
every stage's outputs into one program, and evaluates it in one numba pass per call. A layer model the tracer
cannot follow (:class:`~dynabatch.cost.symbolic.NotTraceable`) is priced by its methods as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.cost.analytic import checked_memo
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.recompute import RecomputeTerms
from dynabatch.cost.symbolic import VARIABLES, NotTraceable, Program, Sym, compile_forms

PRICED = ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes", "send_bytes")
"""The per-stage outputs of :meth:`StagePrograms.priced`, in order (the fields of
:class:`~dynabatch.cost.stages.StageCosts` a layer model prices)."""


@dataclass(frozen=True)
class Signature:
    """Which inputs a query has: the program traced for one signature prices every query with it."""

    decoder: bool
    """A decoder length ``D`` (an encoder-decoder layout)."""
    pairs: bool
    calls: bool
    longest: bool

    @classmethod
    def of(cls, D, pairs: AttentionPairs | None) -> "Signature":  # noqa: N803
        return cls(D is not None, pairs is not None, pairs is not None and pairs.calls is not None,
                   pairs is not None and pairs.longest is not None)


def _symbols(signature: Signature):
    """Symbolic ``(b, E, D, pairs)`` of a signature."""
    v = {name: Sym.variable(name) for name in VARIABLES}
    pairs = None
    if signature.pairs:  # made field by field: AttentionPairs checks values, which forms do not have
        pairs = object.__new__(AttentionPairs)
        for field in ("encoder", "decoder", "cross"):
            object.__setattr__(pairs, field, v[f"pairs_{field}"])
        object.__setattr__(pairs, "calls", tuple(v[f"calls_{k}"] for k in ("encoder", "decoder", "cross"))
                           if signature.calls else None)
        object.__setattr__(pairs, "longest", (v["longest_input"], v["longest_target"]) if signature.longest else None)
    return v["b"], v["E"], v["D"] if signature.decoder else None, pairs


class StagePrograms:
    """The per-stage costs of ``model`` (a layer model sharing its layer costs over stages: the analytic model) on
    the layout ``stages``, compiled per :class:`Signature` on first use."""

    def __init__(self, model, stages) -> None:
        self.model = model
        self.stages = tuple(tuple(s) for s in stages)
        self._programs: dict = {}

    def priced(self, b, E, D, pairs: AttentionPairs | None):  # noqa: N803
        """``(len(PRICED), S, *b.shape)``: the stages' :data:`PRICED` for inputs already checked and broadcast
        (``D`` None: a decoder-only layout), or ``None`` when the model cannot be traced."""
        return self._run("priced", b, E, D, pairs)

    def terms(self, b, E, D, pairs: AttentionPairs | None):  # noqa: N803
        """``(6, S, *b.shape)``: the stages' :class:`~dynabatch.cost.recompute.RecomputeTerms` fields in order, or
        ``None``."""
        return self._run("terms", b, E, D, pairs)

    def _run(self, what: str, b, E, D, pairs):  # noqa: N803
        signature = Signature.of(D, pairs)
        values = self.rows(what, variables(b, E, D, pairs, signature), signature)
        return None if values is None else values.reshape(-1, len(self.stages), *np.shape(b))  # (outputs, S, *shape)

    def rows(self, what: str, x: np.ndarray, signature: Signature) -> np.ndarray | None:
        """``(outputs, S, n)``: :meth:`priced` (``what="priced"``) or :meth:`terms` of the queries whose inputs are
        the columns of ``x`` (``(len(VARIABLES), n)`` float64, :func:`variables`), all of ``signature``; ``None``
        when the model cannot be traced."""
        program = self._program(what, signature)
        if program is None:
            return None
        return program.run(x).reshape(-1, len(self.stages), x.shape[1])

    def traced(self) -> dict:
        """Whether each ``(what, signature)`` asked for so far was traced and compiled (``False``: the model's methods
        price it): a model change the tracer cannot follow shows here, not only as a slower planner."""
        return {key: program is not None for key, program in self._programs.items()}

    def _program(self, what: str, signature: Signature) -> Program | None:
        key = (what, signature)
        if key not in self._programs:
            try:
                self._programs[key] = compile_forms(self._forms(what, signature))
            except NotTraceable:
                self._programs[key] = None
        return self._programs[key]

    def _forms(self, what: str, signature: Signature) -> list:
        """The outputs of every stage, output-major (``[out0 of stage 0, out0 of stage 1, ..., out1 of stage 0,
        ...]``), traced through the model's own methods with one memo of layer costs, as a call over the layout
        shares them."""
        b, E, D, pairs = _symbols(signature)
        memo = checked_memo(b, E, D)
        per_stage = []
        for kinds in self.stages:
            if what == "priced":
                c = self.model.stage_cost(list(kinds), b, E, D, pairs=pairs, layers=memo, flops=False)
                per_stage.append((c.fwd_time_s, c.bwd_time_s, c.stored_activation_bytes, c.peak_extra_bytes,
                                  self.model.send_bytes(kinds[-1], b, E, D, layers=memo)))
            else:
                t = self.model.recompute_terms(list(kinds), b, E, D, pairs=pairs, layers=memo)
                per_stage.append(tuple(getattr(t, f) for f in RecomputeTerms.fields()))
        return [stage[k] for k in range(len(per_stage[0])) for stage in per_stage]


_SHARED: dict = {}
"""The :class:`StagePrograms` of each (layer model, layout) made so far (:func:`programs_of`)."""
_SHARED_LIMIT = 64


def programs_of(model, stages) -> StagePrograms:
    """The :class:`StagePrograms` of ``model`` on the layout ``stages``, one per distinct (model, layout) in a
    process: every :class:`~dynabatch.cost.stages.StageCostModel` built on them (the online fit makes a new
    calibrated one at every update, the planner copies with other memory) shares the programs traced so far. An
    unhashable model gets its own."""
    key = (model, tuple(tuple(s) for s in stages))
    try:
        programs = _SHARED.get(key)
    except TypeError:
        return StagePrograms(model, stages)
    if programs is None:
        if len(_SHARED) >= _SHARED_LIMIT:
            _SHARED.pop(next(iter(_SHARED)))
        programs = _SHARED[key] = StagePrograms(model, stages)
    return programs


def variables(b, E, D, pairs: AttentionPairs | None, signature: Signature) -> np.ndarray:  # noqa: N803
    """``(len(VARIABLES), n)`` rows of the flattened inputs; the rows a signature does not use are zero."""
    n = int(np.size(b))
    x = np.zeros((len(VARIABLES), n))
    x[0], x[1] = np.ravel(b), np.ravel(E)
    if signature.decoder:
        x[2] = np.ravel(D)
    if pairs is not None:
        work = pairs.broadcast_to(np.shape(b))
        x[3], x[4], x[5] = (np.ravel(a) for a in (work.encoder, work.decoder, work.cross))
        if work.calls is not None:
            x[6], x[7], x[8] = (np.ravel(a) for a in work.calls)
        if work.longest is not None:
            x[9], x[10] = (np.ravel(a) for a in work.longest)
    return x


__all__ = ["PRICED", "Signature", "StagePrograms", "programs_of", "variables"]
