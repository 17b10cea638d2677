"""Instruction IR of a pipeline training step: what each rank executes, in order, with shapes.

One :class:`ExecutionPlan` per rank holds a flat list of :class:`Instr`. Every instruction names its
opcode (:class:`Op`, a ``str`` enum whose values are the stable text/serialization codes), the stage,
the micro-batch, and, where they apply, the peer rank, the buffer slot, a message tag and the exact
tensors (:class:`TensorSpec`: name, shape, dtype string) so receivers allocate exact buffers and no
shape handshake is needed at run time. Nothing here imports torch.

What travels between stages (:meth:`PipelineSpec.send_tensors`), micro-batch padded shape ``(b, E, D)``:

* GPT: ``hidden`` ``(b, E, d_model)`` (``E`` is the sequence length) forward, its gradient back.
* T5 stage ending in the encoder: ``enc_hidden`` ``(b, E, d)``.
* T5 stage ending in the decoder: ``dec_hidden`` ``(b, D, d)`` and ``enc_out`` ``(b, E, d)``: every
  decoder stage needs the encoder output for cross-attention, so decoder stages relay it; the gradient
  of both comes back (a decoder stage adds its own cross-attention gradient of ``enc_out`` to the one it
  receives before sending it on). All traffic is between pipeline neighbours.

Text form. ``str(instr)`` is the compact key ``<stage><OP><micro_batch>``: ``1F0``, ``2SEND_F3``,
``0WAIT_RECV_B2``, ``1FREE0``, ``0REDUCE``. :meth:`Instr.to_text` appends the other fields
(``slot=0 peer=1 tag=6 hidden:bfloat16[4x128x64]``); :meth:`Instr.from_str` reads both forms, and
``Instr.from_str(i.to_text()) == i``; a bare key of a transfer takes replica 0's neighbour as peer
and :func:`message_tag` as tag (``Instr.from_str("2SEND_F3")`` sends to rank 3 with tag 6).
:class:`ExecutionPlan` has a text form (one instruction a line under a header) and a compact
versioned binary form (:mod:`dynabatch.schedule.serialize`; no pickle).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from dynabatch.core.policies import RECOMPUTE_MODES  # re-exported: a plan codes a mode as its index there
from dynabatch.core.sequence import CAUSAL, SEQ2SEQ, sequence_kind
from dynabatch.schedule.chains import check_links

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Element sizes of the dtype strings a :class:`TensorSpec` may carry (torch dtype names, no prefix)."""


class Op(str, Enum):
    """Opcodes. The value is the text and serialization code: stable, never renumbered or reordered.

    Send and receive ops only *start* a non-blocking transfer (``isend`` / ``irecv``); the transfer
    completes at the matching :attr:`WAIT`. Pairing is per pipeline link: a rank's sends to a peer and
    the peer's receives from it are issued in the same order, and both ends issue all their ops on a
    link in the same order (see :mod:`dynabatch.schedule.lower`).
    """

    LOAD = "LOAD"
    """Load micro-batch inputs from the host (token ids, segment ids, labels as :attr:`Instr.tensors`)
    into the micro-batch's slot. Local; pairs with nothing."""
    FORWARD = "F"
    """Forward of the micro-batch through this stage: reads the slot's loaded inputs and received
    activation (after its ``WAIT_RECV_F``), keeps what backward needs. Local."""
    BACKWARD = "B"
    """Backward of the micro-batch: needs its ``F`` on this stage and, except on the last stage, the
    received gradient (after ``WAIT_RECV_B``); writes the gradient of the stage's inputs into the slot
    and accumulates parameter gradients. Local."""
    SEND_ACT = "SEND_F"
    """Start sending the stage's output activation to stage + 1 (``peer``); pairs with ``RECV_F`` of
    the same micro-batch, tag and tensors on the peer."""
    RECV_ACT = "RECV_F"
    """Allocate exact buffers for ``tensors`` in the slot and start receiving the activation from stage
    - 1 (``peer``); pairs with that peer's ``SEND_F`` of the same micro-batch."""
    SEND_GRAD = "SEND_B"
    """Start sending the gradient of this stage's input activation to stage - 1 (``peer``); pairs with
    the peer's ``RECV_B`` of the same micro-batch (same tensor names as the activation)."""
    RECV_GRAD = "RECV_B"
    """Allocate buffers and start receiving the gradient of this stage's output from stage + 1
    (``peer``); pairs with the peer's ``SEND_B`` of the same micro-batch."""
    WAIT = "WAIT"
    """Block until the transfer started by this rank's ``waits_on`` op of the micro-batch completes.
    A send completes once the peer has posted the matching receive (gloo), a receive once the data
    arrived. Pairs with nothing itself."""
    FREE = "FREE"
    """Release every buffer in the slot of the micro-batch (only after its sends completed). Local."""
    REDUCE_GRADS = "REDUCE"
    """All-reduce parameter gradients with the ranks of the same stage in the other data-parallel
    replicas (a no-op with one replica); pairs with ``REDUCE`` on each of them. After all ``B``."""
    OPTIMIZER_STEP = "STEP"
    """Optimizer step on this stage's parameters. After ``REDUCE``. Local."""


COMM_OPS = frozenset({Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
_NO_MICRO_BATCH = frozenset({Op.REDUCE_GRADS, Op.OPTIMIZER_STEP})
_OPS_BY_VALUE = {op.value: op for op in Op}
_OP_SET = frozenset(Op)
_TRANSFER_OPS = COMM_OPS | {Op.WAIT}
_WAIT = Op.WAIT  # enum member lookups cost ~0.2 us each in Python 3.11; hot paths use aliases
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_KEY_RE = re.compile(r"(\d+)([A-Z_]+?)(\d*)\Z")
_TENSOR_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*):([a-z0-9]+)\[([0-9x]*)\]\Z")


def message_tag(micro_batch: int, op: Op) -> int:
    """Tag of a transfer: ``2 m`` for micro-batch ``m``'s activation, ``2 m + 1`` for its gradient.

    Unique per link and step. gloo matches on it (torch maps a p2p tag to a gloo slot); NCCL ignores
    tags, which is why the lowering also fixes the order of every link's transfers.
    """
    return 2 * micro_batch + (0 if op in (Op.SEND_ACT, Op.RECV_ACT) else 1)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a transfer or a load: name, shape and dtype (a torch dtype name as a string)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"tensor name must be an identifier, got {self.name!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid dtypes: {', '.join(DTYPE_BYTES)}")
        if not isinstance(self.shape, tuple) or any(not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"tensor {self.name}: shape must be a tuple of ints >= 0, got {self.shape!r}")

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for dim in self.shape:
            n *= dim
        return n

    def __str__(self) -> str:
        return f"{self.name}:{self.dtype}[{'x'.join(map(str, self.shape))}]"

    @staticmethod
    def from_str(text: str) -> "TensorSpec":
        m = _TENSOR_RE.match(text)
        if not m:
            raise ValueError(f"cannot parse tensor spec {text!r}; expected name:dtype[4x128x64]")
        dims = m.group(3)
        return TensorSpec(m.group(1), tuple(int(x) for x in dims.split("x")) if dims else (), m.group(2))


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of one rank. Fields that do not apply to the opcode keep their defaults."""

    op: Op
    stage: int
    micro_batch: int = -1
    """-1 for ``REDUCE`` and ``STEP``."""
    peer: int = -1
    """Global rank of the other end (send, receive and their waits)."""
    slot: int = -1
    """Buffer slot holding the micro-batch's buffers on this rank (see :func:`lower.assign_slots`)."""
    tag: int = -1
    """:func:`message_tag` of a transfer."""
    waits_on: Op | None = None
    """The send/receive op a ``WAIT`` completes."""
    tensors: tuple[TensorSpec, ...] = ()
    """Exact tensors of a transfer or a load."""

    def __post_init__(self) -> None:
        op = self.op
        if op not in _OP_SET:
            raise ValueError(f"op must be an Op, got {op!r}")
        if (op is _WAIT) != (self.waits_on is not None) or (op is _WAIT and self.waits_on not in COMM_OPS):
            raise ValueError(f"{op.value}: waits_on must be a send/receive op for WAIT only, got {self.waits_on!r}")
        if (op in _NO_MICRO_BATCH) != (self.micro_batch < 0):
            raise ValueError(f"{op.value}: micro_batch {self.micro_batch} is invalid for this opcode")
        if (op in _TRANSFER_OPS) and self.peer < 0:
            raise ValueError(f"{op.value}{self.micro_batch}: a transfer needs a peer rank, got {self.peer}")

    @property
    def key(self) -> str:
        """Compact text: ``1F0``, ``2SEND_F3``, ``0WAIT_RECV_B2``, ``0REDUCE``."""
        name = f"WAIT_{self.waits_on.value}" if self.op is _WAIT else self.op.value
        return f"{self.stage}{name}{self.micro_batch if self.micro_batch >= 0 else ''}"

    def __str__(self) -> str:
        return self.key

    def to_text(self) -> str:
        """The compact key followed by every non-default field; :meth:`from_str` reads it back exactly."""
        parts = [self.key]
        if self.slot >= 0:
            parts.append(f"slot={self.slot}")
        if self.peer >= 0:
            parts.append(f"peer={self.peer}")
        if self.tag >= 0:
            parts.append(f"tag={self.tag}")
        parts.extend(str(t) for t in self.tensors)
        return " ".join(parts)

    @staticmethod
    def from_str(text: str) -> "Instr":
        tokens = text.split()
        if not tokens:
            raise ValueError("cannot parse an empty instruction")
        m = _KEY_RE.match(tokens[0])
        if not m:
            raise ValueError(f"cannot parse instruction {tokens[0]!r}; expected <stage><OP><micro_batch> like 1F0")
        stage, name, mb = int(m.group(1)), m.group(2), m.group(3)
        waits_on = None
        if name.startswith("WAIT_"):
            name, waits_on = "WAIT", _parse_op(name[5:], tokens[0])
        fields: dict = {}
        tensors = []
        for tok in tokens[1:]:
            key, eq, value = tok.partition("=")
            if eq and key in ("slot", "peer", "tag") and value.lstrip("-").isdigit():
                fields[key] = int(value)
            elif eq:
                raise ValueError(f"{tokens[0]}: unknown field {tok!r}; valid fields: slot, peer, tag")
            else:
                tensors.append(TensorSpec.from_str(tok))
        op = _parse_op(name, tokens[0])
        micro_batch = int(mb) if mb else -1
        transfer = waits_on or op
        if transfer in COMM_OPS:  # compact keys of replica 0: the peer is the neighbour, the tag derived
            fields.setdefault("peer", stage + (1 if transfer in (Op.SEND_ACT, Op.RECV_GRAD) else -1))
            fields.setdefault("tag", message_tag(micro_batch, transfer))
        return Instr(op, stage, micro_batch, waits_on=waits_on, tensors=tuple(tensors), **fields)


def _parse_op(name: str, text: str) -> Op:
    try:
        return _OPS_BY_VALUE[name]
    except KeyError:
        raise ValueError(f"unknown opcode {name!r} in {text!r}; valid opcodes: {', '.join(_OPS_BY_VALUE)}") from None


ROLES = ("gpt", "encoder", "decoder")


@dataclass(frozen=True)
class PipelineSpec:
    """What the stages of one pipeline exchange: sequence kind, each stage's role, width and dtype."""

    family: str
    """Sequence kind, ``causal`` (decoder-only) or ``seq2seq`` (encoder-decoder); the legacy names
    ``gpt``/``gpt2``/``t5`` are accepted (:func:`dynabatch.core.sequence.sequence_kind`)."""
    stage_roles: tuple[str, ...]
    """Per stage, the part of the model its last block belongs to: all ``gpt`` (decoder-only blocks),
    or for seq2seq one or more ``encoder`` stages followed by one or more ``decoder`` stages."""
    d_model: int
    dtype: str = "bfloat16"
    """Activation dtype on the wire."""
    index_dtype: str = "int64"
    """Dtype of loaded token ids, segment ids and labels."""
    positions_every_stage: bool = False
    """Causal models with rotary positions (Llama-style): every stage loads ``position_ids``, not only
    the first (the model family says so, :mod:`dynabatch.models.families`)."""

    def __post_init__(self) -> None:
        family = sequence_kind(self.family)
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "stage_roles", tuple(self.stage_roles))
        roles = self.stage_roles
        if not roles or any(r not in ROLES for r in roles):
            raise ValueError(f"stage_roles must be a non-empty sequence of {ROLES}, got {roles}")
        if family == CAUSAL and set(roles) != {"gpt"}:
            raise ValueError(f"a causal pipeline has only gpt stages, got {roles}")
        if family == SEQ2SEQ:
            k = roles.count("encoder")
            if roles != ("encoder",) * k + ("decoder",) * (len(roles) - k) or k == len(roles):
                raise ValueError(f"seq2seq stages must be encoder stages then >= 1 decoder stages, got {roles}")
            if self.positions_every_stage:
                raise ValueError("positions_every_stage is for causal pipelines; got a seq2seq spec")
        for name in ("dtype", "index_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid dtypes: {', '.join(DTYPE_BYTES)}")
        if isinstance(self.d_model, bool) or not isinstance(self.d_model, int) or self.d_model < 1:
            raise ValueError(f"d_model must be an int >= 1, got {self.d_model!r}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_roles)

    @staticmethod
    def gpt(num_stages: int, d_model: int, dtype: str = "bfloat16", positions_every_stage: bool = False) -> "PipelineSpec":
        """A causal (decoder-only) pipeline of ``num_stages`` stages."""
        return PipelineSpec(CAUSAL, ("gpt",) * num_stages, d_model, dtype, positions_every_stage=positions_every_stage)

    causal = gpt

    @staticmethod
    def t5(num_encoder_stages: int, num_decoder_stages: int, d_model: int, dtype: str = "bfloat16") -> "PipelineSpec":
        """A seq2seq pipeline: encoder stages then decoder stages."""
        return PipelineSpec(SEQ2SEQ, ("encoder",) * num_encoder_stages + ("decoder",) * num_decoder_stages, d_model, dtype)

    seq2seq = t5

    @staticmethod
    def from_layout(layout, d_model: int, dtype: str = "bfloat16", positions_every_stage: bool = False) -> "PipelineSpec":
        """From a :class:`~dynabatch.cost.stages.StageLayout` (layer kinds per stage)."""
        stages = [tuple(s) for s in layout.stages]
        if not any(k.startswith("t5_") for s in stages for k in s):
            return PipelineSpec.gpt(len(stages), d_model, dtype, positions_every_stage)
        decoder_kinds = ("decoder_embedding", "t5_decoder", "lm_head")
        roles = tuple("decoder" if any(k in decoder_kinds for k in s) else "encoder" for s in stages)
        return PipelineSpec(SEQ2SEQ, roles, d_model, dtype)

    def send_tensors(self, stage: int, b: int, E: int, D: int) -> tuple[TensorSpec, ...]:
        """Tensors stage ``stage`` sends to ``stage + 1`` for a micro-batch of padded shape ``(b, E, D)``
        (the gradient sent back has the same names, shapes and dtype). Empty for the last stage."""
        if stage >= self.num_stages - 1:
            return ()
        d, t = self.d_model, self.dtype
        role = self.stage_roles[stage]
        if role == "gpt":
            return (TensorSpec("hidden", (b, E, d), t),)  # (b, T, d)
        if role == "encoder":
            return (TensorSpec("enc_hidden", (b, E, d), t),)
        return (TensorSpec("dec_hidden", (b, D, d), t), TensorSpec("enc_out", (b, E, d), t))

    def load_tensors(self, stage: int, b: int, E: int, D: int) -> tuple[TensorSpec, ...]:
        """Host inputs stage ``stage`` loads for a micro-batch: segment ids on every stage (attention
        masks), token ids on the first stage (and decoder ids on the first T5 decoder stage), labels on
        the last stage; a causal pipeline's first stage (every stage with ``positions_every_stage``) also
        loads position ids."""
        i, last = self.index_dtype, self.num_stages - 1
        if self.family == CAUSAL:
            out = [TensorSpec("segment_ids", (b, E), i)]
            if stage == 0:
                out.append(TensorSpec("input_ids", (b, E), i))
            if stage == 0 or self.positions_every_stage:
                out.append(TensorSpec("position_ids", (b, E), i))
            if stage == last:
                out.append(TensorSpec("labels", (b, E), i))
            return tuple(out)
        out = [TensorSpec("segment_ids", (b, E), i)]
        if stage == 0:
            out.append(TensorSpec("input_ids", (b, E), i))
        if self.stage_roles[stage] == "decoder":
            out.append(TensorSpec("decoder_segment_ids", (b, D), i))
            if stage == self.stage_roles.index("decoder"):
                out.append(TensorSpec("decoder_input_ids", (b, D), i))
        if stage == last:
            out.append(TensorSpec("labels", (b, D), i))
        return tuple(out)


PLAN_FORMAT_VERSION = 1
"""Version of :meth:`ExecutionPlan.to_bytes` / :meth:`ExecutionPlan.to_text`; readers accept only this one."""


def check_recompute_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE_MODES`, else ``ValueError`` naming the valid ones."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    return mode


def check_recompute(modes, num_micro_batches: int) -> None:
    """``ValueError`` unless ``modes`` has one :data:`RECOMPUTE_MODES` entry per micro-batch."""
    if len(modes) != num_micro_batches:
        raise ValueError(f"recompute has {len(modes)} entries for {num_micro_batches} micro-batches")
    for m in modes:
        check_recompute_mode(m)


@dataclass(frozen=True)
class ExecutionPlan:
    """The instruction list of one rank (one device of one replica) for one training step.

    Rank layout: replica ``p`` (a data-parallel copy of the pipeline) runs device ``d`` on global rank
    ``p * num_devices + d``; peers in instructions are global ranks. Virtual stages
    (:mod:`dynabatch.schedule.placement`): the pipeline's ``num_stages`` chunks are dealt round-robin over
    ``num_devices`` devices, so device ``d`` holds the stages ``d, d + num_devices, ...`` (:attr:`stages`) and
    each instruction names the chunk it belongs to; with one chunk per device (``num_devices == num_stages``,
    the default) a rank runs stage ``d`` alone.
    """

    rank: int
    stage: int
    num_stages: int
    replica_index: int
    num_replicas: int
    num_micro_batches: int
    num_slots: int
    """Buffer slots the instructions use (slot ids are ``0 .. num_slots - 1``)."""
    instructions: tuple[Instr, ...]
    step: int = 0
    """Training step the plan belongs to."""
    slice_links: tuple[int, ...] = ()
    """Token-slice chains of the replica (:mod:`dynabatch.schedule.chains`): per micro-batch, the
    micro-batch whose keys/values it extends, or -1; empty when no micro-batch is a slice."""
    recompute: tuple[str, ...] = ()
    """Activation recomputation of this rank's stages, per micro-batch: one of :data:`RECOMPUTE_MODES`
    (``none``; ``selective``: the attention cores; ``full``: every transformer block), ``num_micro_batches``
    entries per stage of :attr:`stages` in that order (:meth:`recompute_of`); empty when no micro-batch
    recomputes (:mod:`dynabatch.cost.recompute` chooses them)."""
    num_devices: int = 0
    """Devices (ranks) of one replica; ``0`` means ``num_stages`` (one chunk per device). ``stage`` is the
    rank's device index, which is also its first chunk."""
    moves: tuple[int, ...] = ()
    """Moving stage boundaries (:mod:`dynabatch.cost.boundary_moves`): per micro-batch, its move at the boundary
    below this rank's stage and at the one above it, two entries each (:meth:`moves_of`); empty when no
    micro-batch moves a unit. One chunk per device only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "instructions", tuple(self.instructions))
        object.__setattr__(self, "slice_links", tuple(int(x) for x in self.slice_links))
        if self.slice_links:
            check_links(self.slice_links, self.num_micro_batches)
        if self.num_devices == 0:
            object.__setattr__(self, "num_devices", self.num_stages)
        if not 1 <= self.num_devices <= self.num_stages or self.num_stages % self.num_devices:
            raise ValueError(f"{self.num_stages} stages cannot be dealt over {self.num_devices} devices "
                             "(the stage count must be a multiple of the device count)")
        object.__setattr__(self, "recompute", tuple(self.recompute))
        if any(m != "none" for m in self.recompute):
            check_recompute(self.recompute, self.num_micro_batches * len(self.stages))
        else:
            object.__setattr__(self, "recompute", ())
        object.__setattr__(self, "moves", tuple(int(x) for x in self.moves))
        if not any(self.moves):
            object.__setattr__(self, "moves", ())
        elif len(self.moves) != 2 * self.num_micro_batches or not set(self.moves) <= {-1, 0, 1}:
            raise ValueError(f"moves must hold two entries of -1, 0 or 1 per micro-batch ({2 * self.num_micro_batches}), "
                             f"got {len(self.moves)}")
        elif self.num_devices != self.num_stages:
            raise ValueError("moving stage boundaries need one chunk per device (no virtual stages)")
        if not (0 <= self.stage < self.num_devices and 0 <= self.replica_index < self.num_replicas):
            raise ValueError(
                f"device {self.stage} / replica {self.replica_index} out of range "
                f"({self.num_devices} devices, {self.num_replicas} replicas)"
            )
        if self.rank != self.replica_index * self.num_devices + self.stage:
            raise ValueError(
                f"rank {self.rank} must be replica_index * num_devices + device = "
                f"{self.replica_index * self.num_devices + self.stage}"
            )

    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages (chunks) this rank holds: ``stage, stage + num_devices, ...``."""
        return tuple(range(self.stage, self.num_stages, self.num_devices))

    @property
    def device(self) -> int:
        """This rank's device index in its replica (= :attr:`stage`, its first chunk)."""
        return self.stage

    def recompute_of(self, stage: int, micro_batch: int) -> str:
        """The recomputation mode of ``micro_batch`` on ``stage`` (one of this rank's :attr:`stages`)."""
        if not self.recompute:
            return "none"
        return self.recompute[(stage - self.stage) // self.num_devices * self.num_micro_batches + micro_batch]

    def moves_of(self, micro_batch: int) -> tuple[int, int]:
        """``(lower, upper)``: ``micro_batch``'s moves at the boundaries below and above this rank's stage
        (``(0, 0)`` without moves)."""
        if not self.moves:
            return 0, 0
        return self.moves[2 * micro_batch], self.moves[2 * micro_batch + 1]

    def __str__(self) -> str:
        return " ".join(str(i) for i in self.instructions)

    def to_text(self) -> str:
        """Readable form: a header line, then one :meth:`Instr.to_text` line per instruction."""
        return serialize.plan_to_text(self)

    @staticmethod
    def from_text(text: str) -> "ExecutionPlan":
        return serialize.plan_from_text(text)

    def to_bytes(self) -> bytes:
        """Compact versioned binary form (zlib-compressed JSON tables; no pickle)."""
        return serialize.plan_to_bytes(self)

    @staticmethod
    def from_bytes(data: bytes) -> "ExecutionPlan":
        return serialize.plan_from_bytes(data)


# serialize builds these classes, so it is imported once they exist (either module may be imported first)
from dynabatch.schedule import serialize  # noqa: E402
