"""Versioned serialization of :class:`~dynabatch.schedule.ir.ExecutionPlan`: binary and text, no pickle.

Binary: ``b"DBXP"``, the format version as a little-endian uint16, then zlib-compressed JSON::

    {"plan": [rank, stage, num_stages, replica_index, num_replicas, num_micro_batches, num_slots, step],
     "tensors": [[name, dtype, [shape...]], ...],        # each distinct TensorSpec once
     "groups": [[tensor index, ...], ...],               # each distinct tensor tuple once
     "instrs": [[op, stage, micro_batch, peer, slot, tag, waits_on or "", group or -1], ...],
     "links": [previous slice or -1, ...],               # only when some micro-batch is a token slice
     "recompute": [mode, ...],                           # only when some micro-batch recomputes
     "devices": num_devices,                             # only with virtual stages (devices < stages)
     "moves": [lower, upper, ...]}                       # only when some micro-batch moves a stage boundary

Opcodes are their stable string values, so the format does not depend on enum order. A 1F1B plan of
100 micro-batches on a middle stage (about 1000 instructions) is about 6.4 KB.

Text: a header ``dynabatch-plan v1 rank=.. stage=.. ...`` (plus ``links=-1,0,1,-1`` when the step has
token slices, ``recompute=none,full,..`` when some micro-batch recomputes, ``devices=N`` with virtual stages, ``moves=0,-1,..`` when a micro-batch moves a stage boundary) and one :meth:`Instr.to_text` line per instruction. Both readers raise ``ValueError`` naming the version they found when it is not
:data:`~dynabatch.schedule.ir.PLAN_FORMAT_VERSION`.
"""

from __future__ import annotations

import json
import struct
import zlib

from dynabatch.schedule.ir import PLAN_FORMAT_VERSION, ExecutionPlan, Instr, Op, TensorSpec

MAGIC = b"DBXP"
TEXT_HEADER = "dynabatch-plan"
_HEADER_FIELDS = (
    "rank",
    "stage",
    "num_stages",
    "replica_index",
    "num_replicas",
    "num_micro_batches",
    "num_slots",
    "step",
)


def plan_to_bytes(plan: ExecutionPlan) -> bytes:
    tensor_ids: dict[TensorSpec, int] = {}
    group_ids: dict[tuple[TensorSpec, ...], int] = {}
    rows = []
    for ins in plan.instructions:
        group = -1
        if ins.tensors:
            group = group_ids.get(ins.tensors, -1)
            if group < 0:
                for t in ins.tensors:
                    tensor_ids.setdefault(t, len(tensor_ids))
                group = group_ids[ins.tensors] = len(group_ids)
        waits = ins.waits_on.value if ins.waits_on is not None else ""
        rows.append([ins.op.value, ins.stage, ins.micro_batch, ins.peer, ins.slot, ins.tag, waits, group])
    doc = {
        "plan": [getattr(plan, f) for f in _HEADER_FIELDS],
        "tensors": [[t.name, t.dtype, list(t.shape)] for t in tensor_ids],
        "groups": [[tensor_ids[t] for t in g] for g in group_ids],
        "instrs": rows,
    }
    if plan.slice_links:
        doc["links"] = list(plan.slice_links)
    if plan.recompute:
        doc["recompute"] = list(plan.recompute)
    if plan.num_devices != plan.num_stages:
        doc["devices"] = plan.num_devices
    if plan.moves:
        doc["moves"] = list(plan.moves)
    payload = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<H", PLAN_FORMAT_VERSION) + zlib.compress(payload, 6)


def plan_from_bytes(data: bytes) -> ExecutionPlan:
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:4]) != MAGIC:
        raise ValueError(f"not a dynabatch execution plan: expected magic {MAGIC!r}, got {bytes(data[:4])!r}")
    (version,) = struct.unpack("<H", bytes(data[4:6]))
    _check_version(version)
    try:
        doc = json.loads(zlib.decompress(bytes(data[6:])))
        header = dict(zip(_HEADER_FIELDS, doc["plan"], strict=True))
        tensors = [TensorSpec(name, tuple(shape), dtype) for name, dtype, shape in doc["tensors"]]
        groups = [tuple(tensors[i] for i in g) for g in doc["groups"]]
        instrs = tuple(
            Instr(Op(op), stage, mb, peer, slot, tag, Op(waits) if waits else None, groups[g] if g >= 0 else ())
            for op, stage, mb, peer, slot, tag, waits, g in doc["instrs"]
        )
        links = tuple(doc.get("links", ()))
        recompute = tuple(doc.get("recompute", ()))
        header["num_devices"] = int(doc.get("devices", 0))
        header["moves"] = tuple(doc.get("moves", ()))
    except (zlib.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"corrupt execution plan (format version {version}): {e}") from e
    return ExecutionPlan(instructions=instrs, slice_links=links, recompute=recompute, **header)


def plan_to_text(plan: ExecutionPlan) -> str:
    header = " ".join(f"{f}={getattr(plan, f)}" for f in _HEADER_FIELDS)
    if plan.slice_links:
        header += " links=" + ",".join(map(str, plan.slice_links))
    if plan.recompute:
        header += " recompute=" + ",".join(plan.recompute)
    if plan.num_devices != plan.num_stages:
        header += f" devices={plan.num_devices}"
    if plan.moves:
        header += " moves=" + ",".join(map(str, plan.moves))
    lines = [f"{TEXT_HEADER} v{PLAN_FORMAT_VERSION} {header}"]
    lines.extend(ins.to_text() for ins in plan.instructions)
    return "\n".join(lines) + "\n"


def plan_from_text(text: str) -> ExecutionPlan:
    lines = [line for line in text.splitlines() if line.strip()]
    head = lines[0].split() if lines else []
    if len(head) < 2 or head[0] != TEXT_HEADER or not head[1].startswith("v") or not head[1][1:].isdigit():
        raise ValueError(f"not a dynabatch execution plan text: first line must start with '{TEXT_HEADER} v<N>'")
    _check_version(int(head[1][1:]))
    header, links, recompute = {}, (), ()
    for tok in head[2:]:
        key, _, value = tok.partition("=")
        if key == "links":
            links = tuple(int(x) for x in value.split(","))
            continue
        if key == "recompute":
            recompute = tuple(value.split(","))
            continue
        if key == "devices" and value.isdigit():
            header["num_devices"] = int(value)
            continue
        if key == "moves":
            header["moves"] = tuple(int(x) for x in value.split(","))
            continue
        if key not in _HEADER_FIELDS:
            raise ValueError(f"unknown plan header field {key!r}; valid fields: "
                             f"{', '.join(_HEADER_FIELDS)}, links, recompute, devices, moves")
        header[key] = int(value)
    missing = [f for f in _HEADER_FIELDS if f not in header]
    if missing:
        raise ValueError(f"plan header lacks {', '.join(missing)}")
    return ExecutionPlan(instructions=tuple(Instr.from_str(line) for line in lines[1:]), slice_links=links,
                         recompute=recompute, **header)


def _check_version(version: int) -> None:
    if version != PLAN_FORMAT_VERSION:
        raise ValueError(
            f"execution plan format version {version} is not supported; this dynabatch reads version "
            f"{PLAN_FORMAT_VERSION} (planner and executor must run the same dynabatch version)"
        )
