"""``--zero 1``: the AdamW states of a stage sharded across the data-parallel replicas that hold it (ZeRO stage 1).

Every replica of a stage keeps the stage's full weights and accumulates full gradients through the backward, as under
``--zero 0``; what is divided is the optimizer: replica ``i`` of ``R`` keeps the AdamW moments of one ``1/R`` slice of
the stage's parameters only and updates only that slice. At the step boundary (never inside the backward, so the
replicas of a stage may run different numbers of micro-batches):

1. ``REDUCE`` (:meth:`ZeroShards.reduce_scatter`): per dtype, the parameters' gradients are laid out in one flat
   buffer padded with zeros to a multiple of ``R`` and reduce-scattered (SUM) over the stage's data-parallel group:
   replica ``i`` receives the summed gradient of its slice (the flat shard's ``.grad``);
2. ``STEP``: the squared gradient norm of each shard (:meth:`ZeroShards.squared_norm`; a tied parameter counted once,
   as under ``--zero 0``) is summed over the world, so the norm, the clipping factor, the fp16 unscaling and the
   non-finite skip are those of ``--zero 0``; each rank steps its own AdamW, whose parameters are the flat shards
   (``shard_params``), then :meth:`ZeroShards.all_gather` gathers every replica's updated slice back into the full
   weights.

The flat weight buffer is the parameters' own storage: at construction every parameter's ``.data`` becomes a view
into its dtype's buffer, and a shard parameter is a view of its slice, so the optimizer updates the weights in place
and no fp32 master copy is kept. AdamW is elementwise, so sharded steps equal unsharded ones (the tests compare them
with ``assert_close``).

Memory per rank (fp32 weights; ``N`` parameters of the stage): weights ``4N``, gradients ``4N``, AdamW moments
``8N / R`` (against ``8N``), plus the shard's summed gradient ``4N / R`` between ``REDUCE`` and ``STEP`` (released after
the step) and the padding (fewer than ``R`` elements per dtype).

``--zero 2`` (``shard_gradients``) also shards the gradients as the backward produces them. A hook on every parameter
(``register_post_accumulate_grad_hook``) sees its gradient complete for the micro-batch; the parameters of a pipeline
chunk are reduced in one fixed order (their reverse order in the module, the order autograd produces them in), each as
soon as it and those before it are ready: per replica whose shard it overlaps, its piece is reduced (SUM,
``dist.reduce``) onto that replica, which adds it to its shard's gradient, and the full gradient is dropped. The end of
the micro-batch's backward (:meth:`ZeroShards.end_backward`) reduces what is left in that order (zeros for a parameter
the micro-batch did not reach). So every replica of a stage issues the same collectives in the same order once per
micro-batch, which needs as many micro-batches on every replica of a stage (the planner gives them that,
:func:`~dynabatch.plan.replicas.equalize_counts`, a baseline's too, :func:`~dynabatch.plan.candidates.even_counts`;
on virtual stages, where the chunks' backwards interleave, every replica of a device also runs replica 0's chunk
order, :func:`~dynabatch.schedule.virtual.replayed_step`): no replica holds the stage's full gradients at any time, only its
shard's (``4N / R``, kept from :meth:`ZeroShards.begin_step` to the next step) and the parameter being reduced.
:attr:`ZeroShards.peak_gradient_bytes` measures that peak. Parameters tied across stages (GPT-2's token table) are
reduced like the others during the backward; at ``REDUCE`` (:meth:`ZeroShards.reduce_tied`) each rank lays its owned
pieces of them out in a full-size buffer (zeros elsewhere), all-reduces it over the replicas and then over the tied
group, and keeps its pieces of the sum: a transient full gradient of the tied parameters at the step boundary only.

Checkpoints (:mod:`dynabatch.training.reshard`) stay per parameter: :meth:`full_state` all-gathers the moments into
per-parameter tensors at save time and :meth:`load_full_state` keeps this rank's slice of per-parameter tensors at
load time, so a checkpoint of any ``--zero`` and replica count resumes under any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch 2.13 names the one-tensor collectives *_single and warns on the older names (once per call site, again after
# every `warnings.catch_warnings` block); older torch (a GPU machine's) has only the older names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ZERO_LEVELS = (0, 1, 2)
"""``--zero`` settings the runtime trains with (0: every replica keeps full states; 1: AdamW states sharded; 2: the
gradients too, reduced per micro-batch)."""


@dataclass
class _Bucket:
    """The parameters of one dtype, laid out back to back in ``flat`` (padded to a multiple of the replica count)."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    shard: torch.nn.Parameter
    """This replica's slice of ``flat`` (a view: the optimizer's parameter)."""
    counted: list[tuple[int, int]] = field(default_factory=list)
    """Ranges of ``shard`` (shard coordinates) that count in the gradient norm."""

    @property
    def shard_size(self) -> int:
        return self.shard.numel()


class ZeroShards:
    """This rank's share of the optimizer states of its stage (module docstring). Construction moves the parameters
    into flat buffers (every replica of a stage must pass the same parameters in the same order)."""

    def __init__(self, params: list[torch.nn.Parameter], group, num_replicas: int, replica_index: int, *,
                 shard_gradients: bool = False) -> None:
        if num_replicas < 2:
            raise ValueError(f"sharding the optimizer states needs at least 2 replicas, got {num_replicas}")
        self.group, self.num_replicas, self.replica_index = group, num_replicas, replica_index
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buckets: list[_Bucket] = []
        for dtype, ps in by_dtype.items():
            offsets, total = [], 0
            for p in ps:
                offsets.append(total)
                total += p.numel()
            padded = -(-total // num_replicas) * num_replicas
            flat = torch.zeros(padded, dtype=dtype, device=ps[0].device)
            with torch.no_grad():
                for p, o in zip(ps, offsets):
                    flat[o:o + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[o:o + p.numel()].view_as(p)
            k = padded // num_replicas
            lo, hi = replica_index * k, (replica_index + 1) * k
            self.buckets.append(_Bucket(ps, offsets, flat, torch.nn.Parameter(flat[lo:hi])))
        self.count_in_norm(params)
        self.shard_gradients = shard_gradients
        """``--zero 2``: gradients reduced onto their owners during the backward (module docstring)."""
        self._where = {id(p): (b, o) for b in self.buckets for p, o in zip(b.params, b.offsets)}
        self._order: dict[int, list[torch.nn.Parameter]] = {0: list(reversed(params))}
        self._chunk_of = {id(p): 0 for p in params}
        self._cursor: dict[int, int] = {}
        self._ready: set[int] = set()
        self._active = False
        self._live = 0
        self.collectives = 0
        """``--zero 2``: the gradient reductions this rank issued during the last step (equal on every replica of a
        stage, or the step would hang)."""
        self.peak_gradient_bytes = 0
        """``--zero 2``: the largest bytes of gradients this rank held during the last step's backward (its shards'
        summed gradients and the full gradients not yet reduced)."""
        if shard_gradients:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_gradient)

    # -- --zero 2: gradients reduced as the backward produces them ----------------------------------------

    def set_chunks(self, chunks: dict[int, list[torch.nn.Parameter]]) -> None:
        """The parameters of each pipeline chunk of this rank (stage index -> parameters in module order): each
        chunk's backward reduces its own, in reverse order (one chunk, key 0, until this is called)."""
        self._order = {s: list(reversed(ps)) for s, ps in chunks.items()}
        self._chunk_of = {id(p): s for s, ps in chunks.items() for p in ps}

    def begin_step(self) -> None:
        """Before a training step's backward: zeroed shard gradients to sum into, the peak meter reset."""
        if not self.shard_gradients:
            return
        for b in self.buckets:
            b.shard.grad = torch.zeros_like(b.shard)
        self._live = sum(b.shard.grad.numel() * b.shard.grad.element_size() for b in self.buckets)
        self.peak_gradient_bytes = self._live
        self._ready.clear()
        self.collectives = 0
        self._cursor = {s: 0 for s in self._order}
        self._active = True

    def end_backward(self, stage: int) -> None:
        """After one micro-batch's backward through chunk ``stage``: reduce what is left of its parameters."""
        if self._active:
            self._advance(stage, flush=True)
            self._cursor[stage] = 0

    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        if not self._active:
            return
        self._live += p.grad.numel() * p.grad.element_size()
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._live)
        self._ready.add(id(p))
        self._advance(self._chunk_of[id(p)], flush=False)

    def _advance(self, stage: int, flush: bool) -> None:
        order, k = self._order[stage], self._cursor[stage]
        while k < len(order) and (flush or id(order[k]) in self._ready):
            self._reduce_parameter(order[k])
            k += 1
        self._cursor[stage] = k

    def _reduce_parameter(self, p: torch.nn.Parameter) -> None:
        """Every replica's gradient of ``p`` summed onto the owners of its pieces; ``p.grad`` dropped."""
        b, o = self._where[id(p)]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        flat, k = grad.reshape(-1), b.shard_size
        for r in range(o // k, min((o + p.numel() - 1) // k + 1, self.num_replicas)):
            lo, hi = max(o, r * k), min(o + p.numel(), (r + 1) * k)
            piece = flat[lo - o:hi - o].contiguous()
            dist.reduce(piece, dst=_global_rank(self.group, r), group=self.group)
            self.collectives += 1
            if r == self.replica_index:
                b.shard.grad[lo - r * k:hi - r * k] += piece
        if p.grad is not None:
            self._live -= p.grad.numel() * p.grad.element_size()
        p.grad = None
        self._ready.discard(id(p))

    def reduce_tied(self, copies: dict[str, list[torch.nn.Parameter]], groups: dict) -> None:
        """``REDUCE`` under ``--zero 2``: the owned pieces of tied parameters (``copies``: name -> this rank's copies;
        ``groups``: name -> :class:`~dynabatch.engine.dist.TiedGroup`) summed over the copies on this rank, the
        replicas and the tied group, every copy's owned piece then holding the whole group's gradient."""
        self._active = False
        for name in sorted(groups):
            ps, group = copies[name], groups[name].group
            if len(ps) == 1 and group is None:
                continue
            full = torch.zeros(ps[0].numel(), dtype=ps[0].dtype, device=ps[0].device)
            for p in ps:
                for (lo, hi), piece in self._owned(p):
                    full[lo:hi] += piece
            dist.all_reduce(full, group=self.group)
            if group is not None:
                dist.all_reduce(full, group=group)
            for p in ps:
                for (lo, hi), piece in self._owned(p):
                    piece.copy_(full[lo:hi])

    def _owned(self, p: torch.nn.Parameter):
        """``[((lo, hi), view)]``: the range of ``p`` (flat) this replica owns and the view of its shard's gradient
        that holds it (empty when it owns none of ``p``)."""
        b, o = self._where[id(p)]
        k, r = b.shard_size, self.replica_index
        lo, hi = max(o, r * k), min(o + p.numel(), (r + 1) * k)
        return [((lo - o, hi - o), b.shard.grad[lo - r * k:hi - r * k])] if lo < hi else []

    @property
    def gradient_bytes(self) -> int:
        """Bytes of this rank's shard gradients under ``--zero 2`` (the part of the peak that lasts the step)."""
        return sum(b.shard_size * b.flat.element_size() for b in self.buckets)

    def count_in_norm(self, norm_params: list[torch.nn.Parameter]) -> None:
        """Count only ``norm_params`` in :meth:`squared_norm` (the executor leaves out all but one copy of a tied
        parameter)."""
        counted = {id(p) for p in norm_params}
        for b in self.buckets:
            k = b.shard_size
            lo, hi = self.replica_index * k, (self.replica_index + 1) * k
            b.counted = [(max(o, lo) - lo, min(o + p.numel(), hi) - lo) for p, o in zip(b.params, b.offsets)
                         if id(p) in counted and max(o, lo) < min(o + p.numel(), hi)]

    @property
    def shard_params(self) -> list[torch.nn.Parameter]:
        """The optimizer's parameters: this replica's flat slice of each dtype's weights."""
        return [b.shard for b in self.buckets]

    def reduce_scatter(self) -> None:
        """``REDUCE`` over the replicas (``--zero 1``): every shard's ``.grad`` becomes the replicas' summed gradient of
        its slice."""
        for b in self.buckets:
            pieces = [p.grad.reshape(-1) for p in b.params]
            pad = b.flat.numel() - sum(p.numel() for p in b.params)
            if pad:
                pieces.append(torch.zeros(pad, dtype=b.flat.dtype, device=b.flat.device))
            flat_grad = torch.cat(pieces)
            out = torch.empty(b.shard_size, dtype=flat_grad.dtype, device=flat_grad.device)
            _reduce_scatter(out, flat_grad, group=self.group)
            b.shard.grad = out

    def squared_norm(self) -> torch.Tensor:
        """Float64 sum of the squared summed gradients of this shard's counted ranges (0 before ``REDUCE``)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.buckets[0].flat.device)
        for b in self.buckets:
            if b.shard.grad is not None:
                for lo, hi in b.counted:
                    sq = sq + b.shard.grad[lo:hi].double().square().sum()
        return sq

    def shard_grads(self) -> list[torch.Tensor]:
        return [b.shard.grad for b in self.buckets if b.shard.grad is not None]

    def all_gather(self) -> None:
        """After this rank's optimizer step: every replica's updated slice into the full weights."""
        for b in self.buckets:
            _all_gather(b.flat, b.shard.detach().clone(), group=self.group)

    def release_grads(self) -> None:
        """Drop the shards' summed gradients (after the step); under ``--zero 2`` they stay until the next step
        begins, as the full gradients of ``--zero 0`` do (so they are counted in the measured model states)."""
        if self.shard_gradients:
            return
        for b in self.buckets:
            b.shard.grad = None

    # -- checkpoints ----------------------------------------------------------------------------------------

    def full_state(self, optimizer: torch.optim.Optimizer) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Collective over the stage's replicas: per parameter, its full optimizer state (moments gathered from every
        replica's shard, scalars such as AdamW's ``step`` as they are); empty before the first step."""
        out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            state = optimizer.state.get(b.shard, {})
            for key in sorted(state):
                value = torch.as_tensor(state[key])
                if value.dim() == 0:
                    for p in b.params:
                        out.setdefault(p, {})[key] = value.detach().clone()
                    continue
                full = torch.empty(b.flat.numel(), dtype=value.dtype, device=value.device)
                _all_gather(full, value.detach().contiguous(), group=self.group)
                for p, o in zip(b.params, b.offsets):
                    out.setdefault(p, {})[key] = full[o:o + p.numel()].view_as(p)
        return out

    def load_full_state(self, optimizer: torch.optim.Optimizer,
                        states: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Set this rank's shard states from per-parameter states (e.g. read from a checkpoint of any layout)."""
        for b in self.buckets:
            mine = [states.get(p) for p in b.params]
            if not any(mine):
                continue
            if not all(mine) or len({frozenset(s) for s in mine}) != 1:
                raise ValueError("the optimizer state covers some parameters of a stage and not others")
            lo = self.replica_index * b.shard_size
            shard_state: dict[str, torch.Tensor] = {}
            for key, first in mine[0].items():
                if first.dim() == 0:
                    shard_state[key] = first.clone()
                    continue
                full = torch.zeros(b.flat.numel(), dtype=first.dtype, device=b.flat.device)
                for p, o, s in zip(b.params, b.offsets, mine):
                    full[o:o + p.numel()].copy_(s[key].reshape(-1))
                shard_state[key] = full[lo:lo + b.shard_size].clone()
            optimizer.state[b.shard] = shard_state


def _global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (``dist.reduce`` names its destination globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def model_state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Measured bytes of this rank's model states: the storages of the parameters (a flat buffer counted once), of
    their gradients, of the optimizer's parameters' gradients and of every optimizer state tensor."""
    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for p in params:
        add(p)
        add(p.grad)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(storages.values())
