"""Calibration check: predict, then measure, random micro-batch shapes that are not on the grid.

Shapes are drawn with a seeded generator: b uniform in [1, max b], lengths log-uniform over the
profiled range, rejected when a length is a grid value or when ``b * max(E, D)`` exceeds the profile's
``max_tokens`` (their cells would be infeasible). For each shape two comparisons are made, with the
same threads, clock and measurement method as the profile:

* ``layer``: every layer kind measured alone against ``CostTables.layer_cost`` (interpolation error);
* ``model``: the whole HF model (``GPT2LMHeadModel`` / ``T5ForConditionalGeneration`` with labels and
  a padding mask) as one stage against ``stage_cost(stage_spec(0, num_blocks))`` (interpolation plus
  composition error: the stage is predicted as the sum of its layers).

* ``segments`` (profiles with attention cores, :mod:`dynabatch.cost.attention_cores`): each block's
  attention cores computing only per-segment blocks. Row ``r`` of the shape is cut into ``k_r`` equal
  segments (``k_r`` cycling through :data:`SEGMENT_SPLITS`, fewer where a segment would be shorter than
  the grid's shortest length; T5: encoder and decoder rows alike), the
  segments of one length run as one dense core call (as the padding-free runtime groups them), and the
  sum is compared with the tables' per-segment price ``core(b, E) + core_delta(pairs)``
  (:mod:`dynabatch.cost.segments`: the equivalent-dense-shape lookup plus the per-call cost of each
  further call), time only. ``saving`` compares the predicted ratio per-segment / dense with the
  measured one (the dense core measured at the same shape), free of the machine's speed drift.

Relative error is ``|predicted - measured| / measured`` of forward + backward time and of stored and
peak bytes; the report gives median and p90 per group.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dynabatch.core.progress import progress as progress_bar
from dynabatch.cost.attention_cores import add_attention_cores
from dynabatch.cost.layers import Step, build_layers, padding_mask, token_ids
from dynabatch.cost.measure import MeasureSettings, measure_step, prepare_params, settle_cpu_allocator
from dynabatch.cost.tables import CostTables
from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.segments import attention_cores, core_delta, kind_values
from dynabatch.cost.pairs import AttentionPairs


@dataclass(frozen=True)
class CheckRow:
    """One predicted-vs-measured comparison."""

    group: str
    """``model`` or a layer kind name."""
    shape: tuple[int, int, int]
    """(b, E, D); D is 0 for GPT-2."""
    pred_time_s: float
    meas_time_s: float
    pred_stored: float
    meas_stored: float
    pred_peak: float
    meas_peak: float

    def rel(self, pred: float, meas: float) -> float:
        return abs(pred - meas) / meas if meas > 0 else (0.0 if pred == 0 else math.inf)

    @property
    def time_err(self) -> float:
        return self.rel(self.pred_time_s, self.meas_time_s)

    @property
    def stored_err(self) -> float:
        return self.rel(self.pred_stored, self.meas_stored)

    @property
    def peak_err(self) -> float:
        return self.rel(self.pred_peak, self.meas_peak)


def sample_shapes(tables: CostTables, num: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """``num`` off-grid shapes inside the profiled, feasible region."""
    rng = np.random.default_rng(seed)
    cap = tables.meta.get("settings", {}).get("max_tokens", math.inf)
    t5 = is_seq2seq(tables.family)
    grid_e, grid_d = (set(a.astype(int).tolist()) for a in (tables.axis_e, tables.axis_d))

    def length(axis):
        return int(round(math.exp(rng.uniform(math.log(axis[0]), math.log(axis[-1])))))

    shapes: list[tuple[int, int, int]] = []
    for _ in range(1000 * num):
        if len(shapes) == num:
            break
        b = int(rng.integers(1, int(tables.axis_b[-1]) + 1))
        e, d = length(tables.axis_e), (length(tables.axis_d) if t5 else 0)
        if b * max(e, d) > cap or e in grid_e or (t5 and d in grid_d):
            continue
        shape = (b, e, d)
        if tables.stage_cost(tables.stage_spec(0, sum(tables.num_layers)), b, e, d).feasible:
            shapes.append(shape)
    return shapes


def _model_step(model, family: str, b: int, e: int, d: int) -> Step:
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    if not is_seq2seq(family):
        ids, mask = token_ids(b, e, vocab, device), padding_mask(b, e, device)
        labels = ids.masked_fill(mask == 0, -100)
        return Step(run=lambda: ((model(input_ids=ids, attention_mask=mask, labels=labels).loss,), ()))
    ids, mask = token_ids(b, e, vocab, device), padding_mask(b, e, device)
    dec_ids, dec_mask = token_ids(b, d, vocab, device), padding_mask(b, d, device)
    labels = dec_ids.masked_fill(dec_mask == 0, -100)
    return Step(run=lambda: ((model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_ids,
                                    decoder_attention_mask=dec_mask, labels=labels).loss,), ()))


def run_check(tables: CostTables, layer_builder, num_shapes: int = 20, seed: int = 0, layers: bool = True,
              device: str = "cpu", progress: bool = True) -> list[CheckRow]:
    """Measure ``num_shapes`` off-grid shapes and compare with the tables' predictions.

    ``layer_builder``: the model family's profiler layer builder (``dynabatch.models.families.layer_builder``).
    """

    thp = (tables.meta.get("device") or {}).get("thp_mem_alloc")
    if thp != os.environ.get("THP_MEM_ALLOC_ENABLE"):
        warnings.warn(f"profile was measured with THP_MEM_ALLOC_ENABLE={thp!r}, this process has "
                      f"{os.environ.get('THP_MEM_ALLOC_ENABLE')!r}: large-tensor allocation costs differ", stacklevel=2)
    threads = tables.meta.get("num_threads")
    if threads:
        torch.set_num_threads(int(threads))
    s = tables.meta.get("settings") or {}
    settings = MeasureSettings(s.get("min_repeats", 3), s.get("max_repeats", 30), s.get("min_time_s", 0.03),
                               s.get("clock", "auto"))
    model_meta = tables.meta["model"]
    dtype = getattr(torch, model_meta.get("dtype", "float32"))
    built = build_layers(model_meta["name"], layer_builder, device, dtype, dropout=model_meta.get("dropout", 0.0),
                         seed=s.get("seed", 0))
    prepare_params(built.model)
    if torch.device(device).type == "cpu":
        settle_cpu_allocator()

    cores = attention_cores(tables)
    if cores:
        built = add_attention_cores(built)
    dev, ptrs = torch.device(device), built.param_ptrs
    whole = tables.stage_spec(0, sum(tables.num_layers))
    rows: list[CheckRow] = []
    shapes = sample_shapes(tables, num_shapes, seed)
    for b, e, d in progress_bar(shapes, desc="check", unit="shape", disable=not progress):
        pred = tables.stage_cost(whole, b, e, d)
        m = measure_step(_model_step(built.model, built.sequence_kind, b, e, d), ptrs, dev, settings)
        rows.append(CheckRow("model", (b, e, d), pred.fwd_s + pred.bwd_s, m.fwd_s + m.bwd_s,
                             pred.stored_bytes, m.stored_bytes, pred.peak_bytes, m.peak_bytes))
        if not layers:
            continue
        for kind in built.kinds:
            if kind.name not in tables.kinds:
                continue
            pred = tables.layer_cost(kind.name, b, e, d)
            m = measure_step(built.makers[kind.name](b, e, d), ptrs, dev, settings)
            rows.append(CheckRow(kind.name, (b, e, d), pred.fwd_s + pred.bwd_s, m.fwd_s + m.bwd_s,
                                 pred.stored_bytes, m.stored_bytes, pred.peak_bytes, m.peak_bytes))
        for roles in cores.values():
            for role, core in roles.items():
                rows += _segment_rows(tables, built, core, role, (b, e, d), ptrs, dev, settings)
    return rows


SEGMENT_SPLITS = (2, 4, 8, 16)
"""Segments per row of the ``segments`` check, cycling over the rows of a shape."""


def segment_split(b: int, e: int, d: int, min_e: int = 1, min_d: int = 1) -> list[list[tuple[int, int]]]:
    """Per row, its ``(encoder, decoder)`` segment lengths: ``k`` equal parts (the last takes the rest),
    ``k`` from :data:`SEGMENT_SPLITS` by row, fewer where parts would be shorter than ``min_e`` / ``min_d``
    (the profiled grid's shortest lengths; decoder-only: ``d = 0``)."""
    out = []
    for r in range(b):
        k = max(1, min(SEGMENT_SPLITS[r % len(SEGMENT_SPLITS)], e // min_e, (d // min_d) if d else e))
        le, ld = e // k, d // k
        out.append([(le, ld)] * (k - 1) + [(e - le * (k - 1), d - ld * (k - 1))])
    return out


def _segment_rows(tables, built, core: str, role: str, shape, ptrs, dev, settings) -> list[CheckRow]:
    """The ``segments:`` row, and a ``saving:`` row comparing the predicted per-segment / dense ratio with
    the measured one (the dense core measured at the shape right before), which machine-speed drift
    between the profile and the check cancels out of."""

    b, e, d = shape
    split = segment_split(b, e, d, int(tables.axis_e[0]), int(tables.axis_d[0]) if d else 1)
    segments = [s for row in split for s in row]
    groups: dict[tuple[int, int], int] = {}  # one core call per group of equal lengths, as the runtime runs them
    for x, y in segments:
        key = {"encoder": (x, y), "decoder": (y, y), "cross": (x, y)}[role]
        groups[key] = groups.get(key, 0) + 1
    calls = (float(len(groups)),) * 3
    pairs = AttentionPairs(sum(x * x for x, _ in segments), sum(y * y for _, y in segments),
                           sum(x * y for x, y in segments), calls).map(lambda a: np.atleast_1d(a))
    q = [np.array([float(v)]) for v in (b, e, d if d else 1)]
    pred = (kind_values(tables, core, *q) + core_delta(tables, core, role, *q, pairs))[:, 0]
    dense = measure_step(built.makers[core](b, e, d), ptrs, dev, settings)
    total = 0.0
    for (x, y), n in groups.items():
        m = measure_step(built.makers[core](n, x, y), ptrs, dev, settings)
        total += m.fwd_s + m.bwd_s
    pred_dense = kind_values(tables, core, *q)[:, 0]
    ratio = float(pred[0] + pred[1]) / float(pred_dense[0] + pred_dense[1])
    return [CheckRow(f"segments:{core}", shape, float(pred[0] + pred[1]), total, 0.0, 0.0, 0.0, 0.0),
            CheckRow(f"saving:{core}", shape, ratio * (dense.fwd_s + dense.bwd_s), total, 0.0, 0.0, 0.0, 0.0)]


def summarize(rows: list[CheckRow]) -> dict[str, dict[str, float]]:
    """Per group (``model``, ``layers`` = all kinds pooled, ``segments`` / ``saving`` = the per-segment
    checks pooled, and each kind): median/p90 of the errors."""
    groups: dict[str, list[CheckRow]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
        if r.group.startswith(("segments:", "saving:")):
            groups.setdefault(r.group.split(":")[0], []).append(r)
        elif r.group != "model":
            groups.setdefault("layers", []).append(r)
    out = {}
    for name, rs in groups.items():
        t = np.array([r.time_err for r in rs])
        st = np.array([r.stored_err for r in rs if r.meas_stored > 0] or [0.0])
        pk = np.array([r.peak_err for r in rs if r.meas_peak > 0] or [0.0])
        out[name] = {"n": len(rs), "time_median": float(np.median(t)), "time_p90": float(np.percentile(t, 90)),
                     "stored_median": float(np.median(st)), "stored_p90": float(np.percentile(st, 90)),
                     "peak_median": float(np.median(pk)), "peak_p90": float(np.percentile(pk, 90))}
    return out


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    w = max([24, *map(len, summary)])  # a group such as 'segments:gpt2_block_attention' widens the first column
    head = f"{'group':{w}s} {'n':>4s}  {'time med':>8s} {'time p90':>8s}  {'stored med':>10s} {'stored p90':>10s}  " \
           f"{'peak med':>8s} {'peak p90':>8s}"
    lines = [head, "-" * len(head)]
    pooled = ("model", "layers", "segments", "saving")
    order = list(pooled) + sorted(k for k in summary if k not in pooled)
    for name in order:
        if name not in summary:
            continue
        s = summary[name]
        lines.append(f"{name:{w}s} {s['n']:4d}  {s['time_median']:8.1%} {s['time_p90']:8.1%}  "
                     f"{s['stored_median']:10.1%} {s['stored_p90']:10.1%}  "
                     f"{s['peak_median']:8.1%} {s['peak_p90']:8.1%}")
    return "\n".join(lines)
