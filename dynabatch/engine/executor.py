"""Executor: runs one rank's :class:`ExecutionPlan` of a training step on its stage module(s).

:data:`~dynabatch.engine.handlers.HANDLERS` maps each :class:`~dynabatch.schedule.ir.Op` to a small ``_exec_<op>`` function;
an opcode without a handler raises ``ValueError`` naming it. Per step the executor keeps:

* ``states``: per live micro-batch its loaded inputs, received activations (leaf tensors with
  ``requires_grad``), the stage output and the gradients received for it. ``B`` drops the output
  and activations (the graph is freed by backward) and keeps only the input gradients to send;
  ``FREE`` drops the rest.
* ``pending``: started transfers keyed by ``(op, micro_batch)``, the key a ``WAIT``'s ``waits_on``
  names. Receive buffers are allocated exactly from the instruction's tensor specs; send tensors are
  held here until their ``WAIT``.

Token slices (TeraPipe; the plan's ``slice_links``, :mod:`dynabatch.schedule.chains`): a slice's
forward hands the stage the keys/values its previous slice left in ``contexts`` and leaves its own
extended context for the next slice; its backward adds its own keys/values with the gradient the
later slices carried back (``kv_grads``) as extra backward roots, then leaves the gradient of its
context for the previous slice (:mod:`dynabatch.models.slice_kv`).

Virtual stages (:mod:`dynabatch.schedule.virtual`): a rank may hold several pipeline chunks (stage modules); every
instruction names its chunk, and the per-micro-batch state, transfers and token-slice keys/values are kept per
``(stage, micro_batch)``. Chunks of one rank that hold copies of one tied parameter group (T5's token table on the
encoder's and the decoder's first chunk) have their gradients summed on the rank before the group's all-reduce over
ranks; the norm counts one copy.

Activation recomputation: each forward runs under ``recompute_mode(plan.recompute_of(stage, m))``, inside the
dropout seeding, so a recomputed block draws the masks of its forward (:mod:`dynabatch.models.recompute`); the
backward needs nothing more.

Loss: the last stage backpropagates ``loss_sum / global_loss_tokens`` per micro-batch, where the
count covers every micro-batch of every replica (delivered with the plan), so the summed gradients
are those of the global batch's mean token loss, not a mean of micro-batch means. ``REDUCE`` sums
tied-parameter gradients over the stages of the replica that hold a copy, then sums all gradients
over the data-parallel replicas (SUM: the loss is already globally normalised). ``STEP`` all-reduces
``[squared grad norm, loss sum]`` over the world (each tied group counted once per replica; the
norm sum is divided by the replica count, whose gradients are equal), clips to ``max_grad_norm``
like ``clip_grad_norm_`` and steps the optimizer and the LR scheduler; when the loss or the norm is not
finite (NaN/inf, e.g. a diverging learning rate) the optimizer step is skipped on every rank (they
all see the same reduced totals) and :attr:`StepResult.skipped` says so. Under ``--zero 1`` (:mod:`dynabatch.engine.zero`)
``REDUCE`` reduce-scatters instead of all-reducing, the norm sums the replicas' disjoint shards (no division) and
``STEP`` updates this rank's shard, then all-gathers the weights. Under ``--zero 2`` the gradients are reduced onto
their owners' shards after each micro-batch's ``BACKWARD`` (hooks and :meth:`~dynabatch.engine.zero.ZeroShards.end_backward`),
so ``REDUCE`` only sums the tied parameters' pieces. Gradients are dropped at the
start of the next step (so tests and logging can read a step's reduced, clipped gradients).

Precision (:mod:`dynabatch.engine.precision`): forwards run under ``torch.autocast`` of ``autocast_dtype``
(the trainer passes ``--dtype``'s; the default ``auto`` is bf16 on CUDA, none on CPU). The whole step runs inside
one outer, disabled autocast region, so autocast's cast cache lives for the step: every micro-batch's forward
shares one half-precision copy of each weight. With autocast entered per forward only, each forward re-cast
the weights and each micro-batch in flight kept its own copy saved for backward (GPT-2 small on the H200: 85
micro-batches of one step held about 20 GB of them; ``tests/unit/engine/test_executor_autocast.py``). Backward runs
with autocast disabled, as before. Activations travel in the
plan's dtype and gradients are cast back to the dtype of the tensor they belong to. Under fp16 the last stage
backpropagates the loss times :class:`~dynabatch.engine.precision.LossScaler`'s scale; ``STEP`` divides the
world-reduced norm by it and unscales the gradients with the clipping factor, and an overflow (a finite loss
with non-finite gradients) skips the step on every rank and halves the scale (:attr:`StepResult.overflowed`).

Evaluation: a plan without ``BACKWARD`` instructions (:func:`~dynabatch.engine.step.forward_only_plan`)
runs under ``no_grad`` with the stage in eval mode (no dropout; its mode is restored after), leaves the
gradients of the previous step as they are, and ends with one world all-reduce of the loss sum, so
:attr:`StepResult.loss` is the global token-normalised loss on every rank (``grad_norm`` is NaN).

Every instruction's wall time is recorded as ``(key, start, end)`` (``time.perf_counter``) in
:attr:`StepResult.timeline`. Any failure (a dead peer, a timeout, a shape mismatch) is re-raised as
:class:`~dynabatch.engine.dist.PipelineError` naming the rank, step, instruction and peer rank.

Measured (2 shared CPU cores, gloo): bookkeeping handlers (``LOAD``, ``FREE``, a send's ``WAIT``)
take 6-20 us; starting a gloo send 0.04 ms, a receive 0.3 ms. Against
``torch.distributed.pipelining.Schedule1F1B`` on the same GPT-2 stages and fixed-shape micro-batches
(``scripts/bench_executor.py``, 2 stages, 8 micro-batches of 4 x 64), the step takes 0.85-0.95x
its time (send waits never block here; see :mod:`dynabatch.schedule.lower`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dynabatch.cost.model_states import gradient_peak_bytes
from dynabatch.models.split import forked_rng, seed_for
from dynabatch.models.stage import StageModule
from dynabatch.engine.delivery import StepInputs
from dynabatch.engine.dist import DistContext, PipelineError, tied_groups
from dynabatch.engine.memory import SavedActivationMeter
from dynabatch.engine.handlers import HANDLERS, MicroBatchState, Transfer
from dynabatch.engine.precision import LossScaler
from dynabatch.engine.zero import model_state_bytes
from dynabatch.schedule.chains import successors
from dynabatch.schedule.ir import Instr, Op


@dataclass(frozen=True)
class StepResult:
    """What one rank reports after a step (``loss`` and ``grad_norm`` are the same on every rank)."""

    step: int
    loss: float
    """Global batch mean token loss (sum over all replicas / global loss tokens)."""
    grad_norm: float
    """Gradient norm of the whole model before clipping."""
    num_loss_tokens: int
    """Loss-carrying tokens of the global batch (all replicas): the loss normaliser."""
    timeline: list[tuple[str, float, float]]
    """Per executed instruction: ``(key, start, end)`` in ``time.perf_counter`` seconds."""
    segment_losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Last stage only: per micro-batch, (B, K, 2) summed token loss and loss-token count per row segment."""
    skipped: bool = False
    """The loss or the gradient norm was not finite: the optimizer step was not applied (every rank agrees)."""
    saved_peak_bytes: int | None = None
    """With ``measure_memory``: the largest bytes autograd held for backward on this rank during the step
    (:class:`~dynabatch.engine.memory.SavedActivationMeter`), the activation memory the schedule predicts."""
    overflowed: bool = False
    """fp16: the gradients overflowed at this step's loss scale (the step was skipped and the scale halved)."""
    loss_scale: float | None = None
    """fp16: the loss scale this step ran with (``None`` without loss scaling)."""
    model_state_bytes: int | None = None
    """Training steps: the measured bytes of this rank's weights, gradients and optimizer states after the step
    (:func:`~dynabatch.engine.zero.model_state_bytes`)."""
    gradient_peak_bytes: int | None = None
    """Training steps: the most bytes of gradients this rank held during the backward (every full gradient at its
    end; under ``--zero 2`` its shards' and those not yet reduced)."""
    gradient_peak_bytes_predicted: int | None = None
    """What :func:`~dynabatch.cost.model_states.gradient_peak_bytes` predicts for this rank's parameters."""
    gradient_collectives: int | None = None
    """``--zero 2``: the gradient reductions this rank issued during the backward."""


class Executor:
    """Runs plans of one rank (see the module docstring).

    Construction is collective over the world (it creates the tied-parameter groups): every rank
    builds its executor at the same point. ``autocast_dtype="auto"`` means bf16 on CUDA, none on CPU.
    ``dropout_seed``: when set, each forward runs under ``forked_rng(seed_for(dropout_seed, step,
    micro_batch, rank))`` so dropout masks are reproducible. ``measure_memory``: meter the bytes
    autograd saves for backward during each step (:attr:`StepResult.saved_peak_bytes`). ``zero``: a
    :class:`~dynabatch.engine.zero.ZeroShards` over this rank's parameters (``--zero 1``: ``optimizer`` steps its flat
    shards; ``REDUCE`` reduce-scatters and ``STEP`` all-gathers over the replicas); ``None``: every replica keeps
    full optimizer states.
    """

    def __init__(
        self,
        stage: StageModule | list[StageModule],
        ctx: DistContext,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler=None,
        max_grad_norm: float | None = None,
        autocast_dtype: torch.dtype | str | None = "auto",
        dropout_seed: int | None = None,
        measure_memory: bool = False,
        zero=None,
    ) -> None:
        chunks = sorted(stage if isinstance(stage, (list, tuple)) else [stage], key=lambda c: c.stage_index)
        V = chunks[0].num_stages
        expected = list(range(ctx.stage_index, V, ctx.num_stages)) if V % ctx.num_stages == 0 else None
        if [c.stage_index for c in chunks] != expected or any(c.num_stages != V for c in chunks):
            raise ValueError(
                f"rank {ctx.rank} is device {ctx.stage_index} of {ctx.num_stages}, which holds stages {expected} of "
                f"{V}, but got the modules of stages {[c.stage_index for c in chunks]} of {[c.num_stages for c in chunks]}"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.chunks = {c.stage_index: c for c in chunks}
        """Stage index -> the module of that pipeline chunk (one entry without virtual stages)."""
        self.stage = chunks[0]
        """The rank's first (or only) stage module."""
        self.num_stages = V
        self.ctx, self.optimizer, self.scheduler = ctx, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.device = ctx.device
        if autocast_dtype == "auto":
            autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.autocast_dtype = autocast_dtype
        self.loss_scaler = LossScaler() if autocast_dtype == torch.float16 else None
        self.overflowed = False
        self.dropout_seed = dropout_seed
        self.measure_memory = measure_memory
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        copies: dict[str, list[torch.nn.Parameter]] = {}
        for c in chunks:
            for name, p in c.tied_parameters().items():
                copies.setdefault(name, []).append(p)
        self.tied = tied_groups(ctx, copies)
        self.tied_params = copies
        """Tied group name -> this rank's copies of it (several when several chunks hold one)."""
        skip = {id(p) for n, ps in copies.items() for k, p in enumerate(ps) if k > 0 or not self.tied[n].is_owner}
        self.norm_params = [p for p in self.params if id(p) not in skip]
        self.zero = zero
        if zero is not None and [id(p) for b in zero.buckets for p in b.params] != [
                id(p) for ps in _by_dtype(self.params).values() for p in ps]:
            raise ValueError("the ZeroShards were built over other parameters than this rank's stage modules'")
        if zero is not None:
            zero.count_in_norm(self.norm_params)
            zero.set_chunks({s: [p for p in c.parameters() if p.requires_grad] for s, c in self.chunks.items()})
        self.gradient_peak_bytes = 0
        # per-step state
        self._current: Instr | None = None
        """The instruction running (for error messages)."""
        self.inputs: StepInputs | None = None
        self.states: dict[tuple[int, int], MicroBatchState] = {}
        """(stage, micro-batch) -> its state."""
        self.pending: dict[tuple[Op, int, int], Transfer] = {}
        """(op, stage, micro-batch) of the transfers started and not yet waited."""
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.num_loss_tokens = 0
        self.segment_losses: dict[int, torch.Tensor] = {}
        self.grad_norm = 0.0
        self.loss = 0.0
        self.skipped = False
        self.links: tuple[int, ...] = ()
        self.next_slice: dict[int, int] = {}
        self.contexts: dict = {}
        """(stage, slice) -> the keys/values of its chain's earlier slices (left by the previous slice's F)."""
        self.kv_grads: dict = {}
        """(stage, slice) -> the key/value gradient the later slices carried back (left by the next slice's B)."""

    # ------------------------------------------------------------------------------------------

    def run(self, inputs: StepInputs) -> StepResult:
        """Execute one step's plan; returns this rank's :class:`StepResult`."""
        plan, ctx = inputs.plan, self.ctx
        mine = (ctx.rank, ctx.num_stages, self.num_stages, ctx.num_replicas)
        if (plan.rank, plan.num_devices, plan.num_stages, plan.num_replicas) != mine:
            raise ValueError(
                f"rank {ctx.rank} ({ctx.num_stages} devices holding {self.num_stages} stages x {ctx.num_replicas} "
                f"replicas) got the plan of rank {plan.rank} ({plan.num_devices} devices holding {plan.num_stages} "
                f"stages x {plan.num_replicas})"
            )
        if inputs.global_loss_tokens < 1:
            raise ValueError(f"step {plan.step}: the global batch has {inputs.global_loss_tokens} loss tokens")
        sliceable = all(getattr(c, "supports_slices", False) for c in self.chunks.values())
        if any(p >= 0 for p in plan.slice_links) and not sliceable:
            raise ValueError(f"the plan has token slices but {type(self.stage).__name__} cannot run them (GPT-2 stages can)")
        self.inputs = inputs
        self.states, self.pending = {}, {}
        self.links = plan.slice_links
        self.next_slice = successors(plan.slice_links)
        self.contexts, self.kv_grads = {}, {}
        self.loss_sum.zero_()
        self.num_loss_tokens = 0
        self.segment_losses = {}
        self.skipped = self.overflowed = False
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        evaluating = not any(ins.op is Op.BACKWARD for ins in plan.instructions)
        if not evaluating:
            for p in self.params:  # zeroed at the start, so the step's gradients stay readable after it
                p.grad = None
            if self.zero is not None:
                self.zero.begin_step()
        timeline: list[tuple[str, float, float]] = []
        clock = time.perf_counter
        self._current = None
        meter = None
        if self.measure_memory and not evaluating:
            meter = SavedActivationMeter(exclude=self.params)
        was_training = self.stage.training
        try:
            with meter if meter is not None else contextlib.nullcontext(), torch.set_grad_enabled(not evaluating), \
                    self._step_autocast():
                self._train_mode(was_training and not evaluating)
                self._run_instructions(plan, timeline, clock)
            if self.pending or self.states or self.contexts or self.kv_grads:
                raise ValueError(
                    f"plan ended with transfers {sorted(str(k) for k in self.pending)} not waited, "
                    f"micro-batches {sorted(self.states)} not freed and slice keys/values "
                    f"{sorted(self.contexts)}/{sorted(self.kv_grads)} not consumed"
                )
            if evaluating:
                self._evaluation_loss(inputs.global_loss_tokens)
        except PipelineError:
            raise
        except Exception as e:
            ins = self._current
            where = f"{ctx.where}, step {plan.step}"
            what = f"instruction {ins.to_text()} ({self._peers(ins)})" if ins is not None else "plan"
            raise PipelineError(f"{where}, {what} failed: {type(e).__name__}: {e}") from e
        finally:
            self._train_mode(was_training)
            self.inputs = None
            self.states, self.pending = {}, {}
            self.contexts, self.kv_grads = {}, {}
        states = None if evaluating else model_state_bytes(self.params, self.optimizer)
        grads = predicted = collectives = None
        if not evaluating:
            sharded = self.zero is not None and self.zero.shard_gradients
            grads = self.zero.peak_gradient_bytes if sharded else self.gradient_peak_bytes
            predicted = predicted_gradient_peak(self.params, self.ctx.num_replicas if sharded else 1)
            collectives = self.zero.collectives if sharded else None
        return StepResult(plan.step, self.loss, self.grad_norm, inputs.global_loss_tokens, timeline, self.segment_losses,
                          self.skipped, meter.peak_bytes if meter is not None else None, self.overflowed, scale, states,
                          grads, predicted, collectives)

    def _train_mode(self, on: bool) -> None:
        for c in self.chunks.values():
            c.train(on)

    def _run_instructions(self, plan, timeline: list, clock) -> None:
        """Run every instruction of ``plan`` through its handler, timing each (``self._current`` names
        the instruction running, for the error message)."""
        for ins in plan.instructions:
            self._current = ins
            handler = HANDLERS.get(ins.op)
            if handler is None:
                raise ValueError(
                    f"no handler for opcode {ins.op!r} in {ins}; handled: {', '.join(o.value for o in HANDLERS)}"
                )
            t0 = clock()
            handler(self, ins)
            timeline.append((ins.key, t0, clock()))
        self._current = None

    def reduce_gradients(self) -> None:
        """``REDUCE``: sum tied-parameter gradients over their copies (on this rank, then over the ranks holding
        one), then gradients over the replicas."""
        if self.zero is not None and self.zero.shard_gradients:  # reduced per micro-batch; the tied pieces remain
            self.zero.reduce_tied(self.tied_params, self.tied)
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.gradient_peak_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params)
        for name in sorted(self.tied):
            first, *others = self.tied_params[name]
            for p in others:
                first.grad += p.grad
            group = self.tied[name].group
            if group is not None:
                dist.all_reduce(first.grad, group=group)
            for p in others:
                p.grad.copy_(first.grad)
        if self.zero is not None:
            self.zero.reduce_scatter()
        elif self.ctx.num_replicas > 1:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.params:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for grads in by_dtype.values():
                flat = _flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.ctx.dp_group)
                for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)

    def optimizer_step(self, global_loss_tokens: int) -> None:
        """``STEP``: world-wide gradient norm and loss, clipping, optimizer and LR-scheduler step."""
        ctx, zero = self.ctx, self.zero
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if zero is not None:  # the shards of a stage's replicas partition its summed gradients
            sq = zero.squared_norm()
        elif grads:
            # float64: torch's fp32 norm on CPU loses up to 1e-3 on a large token table's gradient; the shards of
            # --zero 1/2 are summed in float64 as well, so every --zero computes the same norm
            # (the public vector_norm, whose dtype argument every supported torch has; _foreach_norm's is private)
            sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum()
        totals = torch.stack([sq, self.loss_sum])  # the loss sum is zero except where the last stage is
        if ctx.world_size > 1:
            dist.all_reduce(totals)  # world: every replica's norm (equal after REDUCE) and every loss
        sq_total, loss_total = totals.tolist()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        replicas = 1 if zero is not None else ctx.num_replicas  # unsharded: every replica added the same norm
        self.grad_norm = math.sqrt(sq_total / replicas) / scale if sq_total >= 0 else math.nan
        self.loss = loss_total / global_loss_tokens
        # Every rank holds the same all-reduced totals, so every rank takes the same decision.
        self.skipped = not (math.isfinite(self.grad_norm) and math.isfinite(self.loss))
        if self.loss_scaler is not None:
            self.overflowed = self.loss_scaler.overflowed(self.loss, self.grad_norm)
            self.loss_scaler.update(self.skipped)
        if self.skipped:  # a non-finite loss or gradient: keep the weights and the optimizer state
            if zero is not None:
                zero.release_grads()
            if self.scheduler is not None:
                self.scheduler.step()  # the LR schedule follows the step number, skipped or not
            return
        coef = 1.0 if self.max_grad_norm is None else min(self.max_grad_norm / (self.grad_norm + 1e-6), 1.0)
        all_grads = zero.shard_grads() if zero is not None else [p.grad for p in self.params if p.grad is not None]
        if coef / scale != 1.0 and all_grads:  # clipping and unscaling in one pass
            torch._foreach_mul_(all_grads, coef / scale)
        self.optimizer.step()
        if zero is not None:
            zero.release_grads()
            zero.all_gather()
        if self.scheduler is not None:
            self.scheduler.step()

    def _evaluation_loss(self, global_loss_tokens: int) -> None:
        """End of an evaluation pass: the world-wide loss sum over the global loss tokens (no gradient norm)."""
        total = self.loss_sum.clone()
        if self.ctx.world_size > 1:
            dist.all_reduce(total)
        self.loss, self.grad_norm = total.item() / global_loss_tokens, math.nan

    def _peers(self, ins: Instr) -> str:
        """Who an instruction talks to, for error messages."""
        if ins.peer >= 0:
            return f"peer rank {ins.peer}"
        if ins.op is Op.REDUCE_GRADS:
            tied = "; ".join(f"{n} ranks {list(g.ranks)}" for n, g in sorted(self.tied.items()) if g.group is not None)
            return f"data-parallel ranks {list(self.ctx.dp_ranks)}" + (f"; tied {tied}" if tied else "")
        if ins.op is Op.OPTIMIZER_STEP:
            return f"all {self.ctx.world_size} ranks"
        return "local"

    def _state(self, ins: Instr) -> MicroBatchState:
        key = (ins.stage, ins.micro_batch)
        st = self.states.get(key)
        if st is None:
            st = self.states[key] = MicroBatchState()
        return st

    def _step_autocast(self):
        """The step's outer autocast region: disabled (backward and the rest run as without it), but while it is
        open autocast keeps its weight casts, so the per-forward regions nested in it share them (module docstring)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, enabled=False)

    def _forward_context(self, stage: int, m: int):
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype))
        if self.dropout_seed is not None:
            seed = seed_for(self.dropout_seed, self.inputs.plan.step, m, self.ctx.replica_index * self.num_stages + stage)
            stack.enter_context(forked_rng(seed, self.device))
        return stack


def predicted_gradient_peak(params: list[torch.nn.Parameter], shards: int) -> int:
    """:func:`~dynabatch.cost.model_states.gradient_peak_bytes` of ``params`` (their gradients in their own dtypes)
    sharded over ``shards`` replicas (1: unsharded)."""
    sizes = [p.numel() * p.element_size() for p in params]
    return int(gradient_peak_bytes(sum(sizes), max(sizes, default=0), shards))


def _by_dtype(params: list[torch.nn.Parameter]) -> dict[torch.dtype, list[torch.nn.Parameter]]:
    out: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        out.setdefault(p.dtype, []).append(p)
    return out
