"""Process groups of a pipeline-parallel x data-parallel run (the only module that creates them).

World = ``num_replicas`` data-parallel copies of a ``num_stages``-stage pipeline; replica ``p`` runs
stage ``s`` on global rank ``p * S + s`` (the layout of :class:`~dynabatch.schedule.ir.ExecutionPlan`).
:func:`init_distributed` reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` (or takes explicit arguments, for tests) and builds, on every rank, in one fixed order:

* ``pipeline_group``: the ``S`` ranks of this rank's replica (grad-norm and loss all-reduce);
* ``dp_group``: the ``R`` ranks holding this rank's stage (gradient all-reduce);
* ``delivery_group``: every rank, always gloo (plans and host tensors travel on the CPU even when the
  training backend is NCCL; its own group keeps its tags apart from the pipeline's p2p tags);
* tied groups (:func:`tied_groups`): per tied-parameter group name, the ranks of one replica whose
  stages hold a copy.

Device and backend (``--device``, :func:`resolve_device`): ``auto`` is ``cuda:LOCAL_RANK`` with NCCL when CUDA is
available, else the CPU with gloo; ``cpu`` is gloo on the CPU even where CUDA exists; ``cuda`` is
``cuda:LOCAL_RANK`` and ``cuda:N`` device N (one process per machine), both NCCL, and a one-line error without
CUDA. Every group gets ``timeout_s``; under gloo a
transfer or collective with a dead or silent peer raises within it (a crashed peer usually much
sooner: its sockets close). The runtime turns those errors into :class:`PipelineError` messages that
name the rank, step, instruction and peer; :func:`exit_on_error` prints one and exits non-zero (the
trainer's ranks use :func:`dynabatch.engine.faults.fail_fast`, which also ends stopped peers and makes
torchrun name the rank that failed first). The plan delivery of a run's first step waits under its own,
longer timeout (``TrainConfig.startup_timeout_s``) while rank 0 loads the data.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dynabatch.core.devices import DEVICES, check_device_name  # noqa: F401 (device_type checks; DEVICES read from here)
from dynabatch.engine.errors import PipelineError  # noqa: F401 (raised here; imported from here too)

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TiedGroup:
    """The ranks of one replica that hold a copy of a tied parameter group."""

    name: str
    ranks: tuple[int, ...]
    group: object | None
    """Process group over ``ranks``; ``None`` when this rank is the only holder."""
    is_owner: bool
    """This rank is the lowest holder: the copy counted once in the gradient norm."""


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the world and its process groups."""

    rank: int
    world_size: int
    local_rank: int
    num_stages: int
    num_replicas: int
    backend: str
    device: torch.device
    timeout_s: float
    pipeline_group: object = field(repr=False)
    dp_group: object = field(repr=False)
    delivery_group: object = field(repr=False)

    @property
    def stage_index(self) -> int:
        return self.rank % self.num_stages

    @property
    def replica_index(self) -> int:
        return self.rank // self.num_stages

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        first = self.replica_index * self.num_stages
        return tuple(range(first, first + self.num_stages))

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return tuple(p * self.num_stages + self.stage_index for p in range(self.num_replicas))

    @property
    def is_planner(self) -> bool:
        """Rank 0 holds the global batch and the plans (:mod:`dynabatch.engine.delivery`)."""
        return self.rank == 0

    def rank_of(self, replica_index: int, stage_index: int) -> int:
        return replica_index * self.num_stages + stage_index

    @property
    def where(self) -> str:
        """``rank R (stage S, replica P)``: how errors name this rank."""
        return f"rank {self.rank} (stage {self.stage_index}, replica {self.replica_index})"


def gather_to_planner(ctx: DistContext, obj, what: str) -> list | None:
    """Collective over the world (the gloo delivery group): rank 0 gets every rank's ``obj``, indexed by global
    rank; the others get ``None``. A peer that died or stopped turns into a :class:`PipelineError` naming this
    rank and ``what`` was being gathered (e.g. ``"step 7's measured stage times"``), like a failed transfer."""
    gathered: list | None = [None] * ctx.world_size if ctx.is_planner else None
    try:
        dist.gather_object(obj, gathered, dst=0, group=ctx.delivery_group)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses of several kinds
        raise PipelineError(f"{ctx.where}, gathering {what} failed: {type(e).__name__}: {e}") from e
    return gathered


def check_world(world_size: int, num_stages: int, num_replicas: int | None) -> int:
    """The replica count for ``world_size`` ranks; ``ValueError`` naming all three numbers if they
    do not factor (``num_replicas=None`` infers it)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_replicas is None:
        if world_size % num_stages:
            raise ValueError(
                f"world size {world_size} is not a multiple of num_stages {num_stages}; "
                f"launch num_stages x num_replicas processes"
            )
        return world_size // num_stages
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if world_size != num_stages * num_replicas:
        raise ValueError(
            f"world size {world_size} != num_stages {num_stages} x num_replicas {num_replicas} "
            f"(= {num_stages * num_replicas}); launch that many processes or change the configuration: "
            f"--stages and --replicas whose product is {world_size} (torchrun --nproc-per-node {world_size} ... "
            f"--stages {world_size})"
        )
    return num_replicas


def device_type(name: str) -> str:
    """``cpu`` or ``cuda``: the kind of device ``--device name`` resolves to (``auto``: CUDA when available)."""
    check_device_name(name)
    return "cpu" if name == "cpu" or (name == "auto" and not torch.cuda.is_available()) else "cuda"


def resolve_device(name: str, local_rank: int = 0, local_world_size: int = 1) -> tuple[str, torch.device]:
    """``(backend, device)`` of ``--device name`` for the process with ``local_rank`` (see the module docstring)."""
    if device_type(name) == "cpu":
        return "gloo", torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); use --device cpu or auto")
    index = local_rank if name in ("auto", "cuda") else int(name[5:])
    if name.startswith("cuda:") and local_world_size > 1:
        raise ValueError(f"--device {name} puts every one of the {local_world_size} processes of this machine on "
                         "one GPU; use --device cuda (process k on cuda:k)")
    if index >= count:
        raise ValueError(f"--device {name}: process {local_rank} needs cuda:{index} but this machine has {count} "
                         f"GPU(s) (cuda:0..cuda:{count - 1}); launch fewer processes per machine or pick another")
    return "nccl", torch.device("cuda", index)


def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return given
    if name not in os.environ:
        raise ValueError(f"{name} is not set: launch with torchrun, or pass rank/world_size explicitly")
    return int(os.environ[name])


def init_distributed(
    num_stages: int,
    num_replicas: int | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    init_method: str | None = None,
    store=None,
    device: str = "auto",
) -> DistContext:
    """Join the world and build this rank's groups (collective: every rank calls it together).

    Defaults come from torchrun's environment (``init_method="env://"`` reads ``MASTER_ADDR`` and
    ``MASTER_PORT``). Tests pass ``rank``, ``world_size`` and ``init_method="file://..."`` or
    ``"tcp://127.0.0.1:PORT"``, or a ready rendezvous ``store`` instead (e.g.
    :func:`dynabatch.cost.p2p.loopback_store`, which listens on 127.0.0.1 only; a ``tcp://`` init method's
    store listens on every interface). Raises ``ValueError`` before joining when the world size does not
    factor as ``num_stages x num_replicas``, or when ``device`` (``--device``, :func:`resolve_device`) cannot be
    had; ``backend`` (gloo / nccl) overrides the device's.
    """
    rank = _env_int("RANK", rank)
    world_size = _env_int("WORLD_SIZE", world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    num_replicas = check_world(world_size, num_stages, num_replicas)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; valid: gloo, nccl")
    if backend is not None:  # an explicit backend (tests) picks its device kind: gloo the CPU, nccl CUDA
        device = "cpu" if backend == "gloo" else ("cuda" if device in ("auto", "cpu") else device)
    backend, where = resolve_device(device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if backend == "nccl":
        torch.cuda.set_device(where)
    device = where
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; call shutdown() first")
    if store is not None and init_method is not None:
        raise ValueError("pass init_method or store, not both")
    rendezvous = {"store": store} if store is not None else {"init_method": init_method or "env://"}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **rendezvous)
    S, R = num_stages, num_replicas
    pipeline_group = dp_group = None
    # Every rank creates every group, in the same order (torch.distributed requires it).
    for p in range(R):
        g = dist.new_group(list(range(p * S, (p + 1) * S)), timeout=timeout)
        if rank // S == p:
            pipeline_group = g
    for s in range(S):
        g = dist.new_group([p * S + s for p in range(R)], timeout=timeout)
        if rank % S == s:
            dp_group = g
    delivery_group = dist.new_group(list(range(world_size)), timeout=timeout, backend="gloo")
    return DistContext(
        rank, world_size, local_rank, S, R, backend, device, float(timeout_s), pipeline_group, dp_group, delivery_group
    )


def tied_groups(ctx: DistContext, names: Iterable[str]) -> dict[str, TiedGroup]:
    """Process groups for the tied-parameter groups this rank's stage holds (``names``, e.g. the keys
    of ``StageModule.tied_parameters()``). Collective over the world: every rank passes its own names;
    the ranks are gathered, and one group is created per (name, replica) with two or more holders."""
    mine = sorted(set(names))
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (ctx.rank, mine), group=ctx.delivery_group)
    holders: dict[tuple[str, int], list[int]] = {}
    for r, group_names in sorted(gathered):
        for name in group_names:
            holders.setdefault((name, r // ctx.num_stages), []).append(r)
    out: dict[str, TiedGroup] = {}
    timeout = timedelta(seconds=ctx.timeout_s)
    for (name, replica), ranks in sorted(holders.items()):
        group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if ctx.rank in ranks:
            out[name] = TiedGroup(name, tuple(ranks), group, ctx.rank == ranks[0])
    return out


def shutdown() -> None:
    """Destroy the process groups (after the last step)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_on_error(fn: Callable, *args, **kwargs):
    """Run ``fn``; on any exception print ``rank N failed: ...`` with the traceback to stderr and exit
    with status 1 at once (``os._exit``: a process group with a dead peer can hang normal shutdown)."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the whole point is to exit non-zero on anything
        rank = os.environ.get("RANK", "?") if not dist.is_initialized() else dist.get_rank()
        sys.stderr.write(f"rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
