"""Instructions from the lowering kernel's rows (:mod:`dynabatch.schedule._lower_kernels`), built cheaply.

Building frozen :class:`~dynabatch.schedule.ir.Instr` objects (about 3 us each, validated) was most of the
pure-Python lowering's time. Instructions are immutable and compare by value, so equal ones are shared:
a per-:class:`~dynabatch.schedule.ir.PipelineSpec` table maps ``(code, stage, micro-batch, peer, slot,
shape)`` to its instruction (the shape only for those carrying tensors: loads and transfers), and one
tensor tuple is built per ``(stage, shape)``. A step's computes, waits and frees are the same
instructions from step to step, so in steady state most lookups hit. Each table is dropped when it
holds :data:`MAX_CACHED` instructions (a long run of distinct shapes), so memory stays bounded.
"""

from __future__ import annotations

import numpy as np

from dynabatch.schedule._lower_kernels import LOAD, RECV_ACT, RECV_GRAD, ROW_CODES, SEND_ACT, SEND_GRAD, lower_rows
from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.ir import Instr, Op, PipelineSpec

MAX_CACHED = 50_000
"""Instructions kept per pipeline spec before its table is cleared (about 10 MB)."""

_OPS = tuple(Op.WAIT if name.startswith("WAIT_") else Op(name) for name in ROW_CODES)
_WAITS_ON = tuple(Op(name[5:]) if name.startswith("WAIT_") else None for name in ROW_CODES)
_ACT = frozenset(k for k, name in enumerate(ROW_CODES) if name.endswith("_F"))
_TRANSFER = frozenset(k for k, w in enumerate(_WAITS_ON) if w is not None) | {SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD}
_TENSORS = frozenset({LOAD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD})
_TABLES: dict[PipelineSpec, dict] = {}


def lowered_lists(schedule: ComputeSchedule, shapes: list, spec: PipelineSpec, fwd: np.ndarray, bwd: np.ndarray,
                  rank_offset: int) -> list[tuple[list[Instr], int]] | None:
    """Per stage, ``(instructions without REDUCE/STEP, slots)`` as passes 1-5 of :mod:`dynabatch.schedule.lower`
    make them (``shapes``: ``M`` python ``(b, E, D)`` tuples; ``fwd``/``bwd``: ``(S, M)`` float64), or ``None``
    when the kernel found an error (the caller then runs the pure-Python passes, which raise it readably)."""
    rows, counts, slots, error = lower_rows(schedule.op_codes(), fwd, bwd)
    if error:
        return None
    table = _TABLES.get(spec)
    if table is None or len(table) > MAX_CACHED:
        table = _TABLES[spec] = {}
    out = []
    for s in range(schedule.num_stages):
        instrs = []
        for code, m, peer, slot in rows[s, :counts[s]].tolist():
            shape = shapes[m] if code in _TENSORS else None
            key = (code, s, m, peer if peer < 0 else rank_offset + peer, slot, shape)
            ins = table.get(key)
            if ins is None:
                ins = table[key] = _instr(code, s, m, peer, slot, shape, spec, rank_offset, table)
            instrs.append(ins)
        out.append((instrs, int(slots[s])))
    return out


def _instr(code: int, s: int, m: int, peer: int, slot: int, shape, spec: PipelineSpec, rank_offset: int,
           table: dict) -> Instr:
    """The instruction of one row (peer a stage, -1 for none); tensor tuples shared through ``table``."""
    tensors = ()
    if shape is not None:
        link = s if code == LOAD else min(s, peer)
        key = ("tensors", code == LOAD, link, shape)
        tensors = table.get(key)
        if tensors is None:
            tensors = table[key] = spec.load_tensors(s, *shape) if code == LOAD else spec.send_tensors(link, *shape)
    if code not in _TRANSFER:
        return Instr(_OPS[code], s, m, slot=slot, tensors=tensors)
    tag = 2 * m + (0 if code in _ACT else 1)  # ir.message_tag
    return Instr(_OPS[code], s, m, rank_offset + peer, slot, tag, _WAITS_ON[code], tensors)
