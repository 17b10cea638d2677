"""The external peer: ``torch.distributed.pipelining``'s ``Schedule1F1B`` running dynabatch's own stages.

Used by ``dynabatch bench`` (method ``pipelining``) and ``scripts/bench_executor.py`` to compare our
executor with what a user of PyTorch's own pipeline API would run: the *same* stage modules
(:class:`~dynabatch.models.stage.StageModule`, same weights, same masks), fixed-shape micro-batches
(every micro-batch ``rows`` x the row lengths; PyTorch's schedules split one batch into equal chunks)
and PyTorch's ``PipelineStage`` + ``Schedule1F1B`` for the order of work and the p2p transfers.

How a stage's inputs travel. ``PipelineStage`` feeds the first stage the chunks of the tensors given to
``schedule.step`` and every later stage only what the previous stage returned. Our stages also need
per-micro-batch host tensors (segment ids for the masks on every stage, T5's decoder ids on the first
decoder stage, the labels on the last), so :class:`PipeliningStage` makes every stage return its
activations *followed by* the host tensors that later stages still need (integer tensors: no gradient,
``PipelineStage`` skips them in backward). The last stage returns the summed token loss of its
micro-batch; the schedule's ``loss_fn`` divides it by the global batch's loss-token count (the same
normalisation as our executor), and ``scale_grads=False``. The schedule's ``target`` is unused (a
placeholder of one element per micro-batch).

After the schedule, our executor's own ``REDUCE_GRADS`` and ``OPTIMIZER_STEP`` handlers run on the
stage: the tied-parameter gradients (token table / tied head, T5's relative-position tables) are summed
over the stages that hold a copy, the gradient norm and the loss are all-reduced and the gradients
clipped like ``clip_grad_norm_``, and the optimizer steps, so both implementations train the same model
the same way. One replica (no data parallelism). Autocast as ``--dtype`` says, like the executor (no fp16).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dynabatch.data.microbatch import IGNORE_INDEX, MicroBatch
from dynabatch.models.split import micro_batch_inputs
from dynabatch.models.stage import StageModule
from dynabatch.engine.dist import DistContext
from dynabatch.schedule.ir import PipelineSpec
from dynabatch.engine.executor import Executor


def _load_names(spec: PipelineSpec, stage: int) -> list[str]:
    return [t.name for t in spec.load_tensors(stage, 1, 1, 1)]


def carried_names(spec: PipelineSpec, stage: int) -> list[str]:
    """Host tensors stage ``stage`` receives (from ``schedule.step`` on stage 0, else from the previous
    stage): those it or any later stage loads, in first-use order."""
    out: list[str] = []
    for s in range(stage, spec.num_stages):
        out += [n for n in _load_names(spec, s) if n not in out]
    return out


def _send_names(spec: PipelineSpec, stage: int) -> list[str]:
    return [t.name for t in spec.send_tensors(stage, 1, 1, 1)]


def stage_examples(spec: PipelineSpec, stage: int, shape: tuple[int, int, int], device) -> tuple[tuple, tuple]:
    """Example (input, output) tensors of stage ``stage`` for micro-batches of shape ``(rows, E, D)``.

    Given to ``PipelineStage`` so it runs in its *static* mode: its dynamic mode infers the shapes by
    running every stage on uninitialised tensors, which breaks on integer inputs (labels out of range)."""
    b, e, d = shape
    specs = {t.name: t for s in range(spec.num_stages) for t in spec.load_tensors(s, b, e, d)}

    def make(t):  # activations carry gradients, host tensors (integers) do not
        x = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
        return x.requires_grad_(x.is_floating_point())

    received = [make(t) for t in spec.send_tensors(stage - 1, b, e, d)] if stage > 0 else []
    inputs = tuple(received + [make(specs[n]) for n in carried_names(spec, stage)])
    if stage == spec.num_stages - 1:
        return inputs, (torch.empty(1, dtype=torch.float32, device=device, requires_grad=True),)
    outputs = [make(t) for t in spec.send_tensors(stage, b, e, d)]
    return inputs, tuple(outputs + [make(specs[n]) for n in carried_names(spec, stage + 1)])


class PipeliningStage(nn.Module):
    """A :class:`StageModule` as the positional-tensors-in, tuple-out module ``PipelineStage`` runs.

    Inputs: the previous stage's activations (``spec.send_tensors`` names), then :func:`carried_names`.
    Outputs: this stage's activations, then the carried tensors of the next stage; on the last stage the
    (1,) summed token loss.
    """

    def __init__(self, stage: StageModule, spec: PipelineSpec) -> None:
        super().__init__()
        s = stage.stage_index
        self.stage = stage
        self.is_last = s == spec.num_stages - 1
        self.received = _send_names(spec, s - 1) if s > 0 else []
        self.carried = carried_names(spec, s)
        self.loaded = _load_names(spec, s)
        self.sends = _send_names(spec, s)
        self.carried_out = [] if self.is_last else carried_names(spec, s + 1)

    def forward(self, *tensors: torch.Tensor):
        names = self.received + self.carried
        if len(tensors) != len(names):
            raise ValueError(f"stage {self.stage.stage_index} expects {names}, got {len(tensors)} tensors")
        values = dict(zip(names, tensors))
        out = self.stage({n: values[n] for n in self.received}, {n: values[n] for n in self.loaded})
        if self.is_last:
            return out.loss_sum.reshape(1)
        return tuple(out.sends[n] for n in self.sends) + tuple(values[n] for n in self.carried_out)


def fixed_shape_inputs(micro_batches: list[MicroBatch], spec: PipelineSpec, rows: int) -> tuple[dict[str, torch.Tensor], int]:
    """Stage 0's ``schedule.step`` inputs and the micro-batch count: the rows of all ``micro_batches`` in
    order, every host tensor concatenated along the batch dimension and padded with empty rows (segment 0,
    labels ignored) to a multiple of ``rows``; the schedule cuts them into chunks of ``rows`` rows.

    The micro-batches must share their row lengths (packing's rows do). Packing's micro-batches are
    consecutive runs of ``rows`` rows, so with its ``rows`` the chunks are its micro-batches (the last one
    filled up)."""
    names = carried_names(spec, 0)
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for mb in micro_batches:
        loaded: dict[str, torch.Tensor] = {}
        for s in range(spec.num_stages):
            loaded.update(micro_batch_inputs(mb, spec, s))
        for n in names:
            parts[n].append(loaded[n])
    uneven = {n: s for n, s in ((n, {tuple(t.shape[1:]) for t in v}) for n, v in parts.items()) if len(s) > 1}
    if uneven:
        raise ValueError(f"micro-batches of different row lengths cannot run as fixed shapes: {uneven}")
    out = {}
    for n, v in parts.items():
        t = torch.cat(v)
        missing = -t.shape[0] % rows
        if missing:
            t = torch.cat([t, t.new_full((missing, *t.shape[1:]), IGNORE_INDEX if n == "labels" else 0)])
        out[n] = t
    return out, out[names[0]].shape[0] // rows


class TorchPipeliningPeer:
    """One rank's side of ``Schedule1F1B`` over ``stage`` (see the module docstring).

    Construction is collective over the world (it builds an :class:`Executor` for the stage, whose
    ``reduce_gradients`` and ``optimizer_step`` (what its ``REDUCE`` and ``STEP`` run) finish each step: tied-gradient sums, clipping, loss
    and grad-norm all-reduce, optimizer step). :meth:`step` is called on every rank of the pipeline with
    the same micro-batch count and shape; stage 0 passes the inputs of :func:`fixed_shape_inputs`. One
    ``Schedule1F1B`` (and ``PipelineStage``, static shapes) is built per (count, shape), on first use.
    """

    def __init__(self, stage: StageModule, spec: PipelineSpec, ctx: DistContext, optimizer: torch.optim.Optimizer,
                 *, max_grad_norm: float | None = None, autocast_dtype: torch.dtype | None = None) -> None:

        if ctx.num_replicas != 1:
            raise ValueError(f"the torch.distributed.pipelining peer runs one replica, got {ctx.num_replicas}")
        self.ctx, self.spec = ctx, spec
        self.module = PipeliningStage(stage, spec).to(ctx.device)
        if autocast_dtype == torch.float16:
            raise ValueError("the torch.distributed.pipelining peer has no fp16 loss scaling; use --dtype bf16 or fp32, "
                             "or drop pipelining from --methods")
        self.autocast_dtype = autocast_dtype
        self.executor = Executor(stage, ctx, optimizer, max_grad_norm=max_grad_norm, autocast_dtype=autocast_dtype)
        self.schedules: dict[tuple[int, int, int, int], object] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.global_loss_tokens = 1

    @property
    def grad_norm(self) -> float:
        """Gradient norm of the whole model in the last step, before clipping."""
        return self.executor.grad_norm

    def _schedule(self, num_micro_batches: int, shape: tuple[int, int, int]):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        key = (num_micro_batches, *shape)
        if key not in self.schedules:
            ctx = self.ctx
            inputs, outputs = stage_examples(self.spec, ctx.stage_index, shape, ctx.device)
            pstage = PipelineStage(self.module, ctx.stage_index, ctx.num_stages, ctx.device, input_args=inputs,
                                   output_args=outputs, group=ctx.pipeline_group)
            self.schedules[key] = Schedule1F1B(pstage, n_microbatches=num_micro_batches, loss_fn=self._loss,
                                               scale_grads=False)
        return self.schedules[key]

    def _loss(self, loss_sum: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        self.loss_sum += loss_sum.detach().sum().double()
        return loss_sum.sum() / self.global_loss_tokens

    def step(self, num_micro_batches: int, shape: tuple[int, int, int], global_loss_tokens: int,
             inputs: dict[str, torch.Tensor] | None = None) -> float:
        """One training step of ``num_micro_batches`` micro-batches of ``shape`` = ``(rows, E, D)`` (GPT: D = 0);
        returns the step's mean token loss (the same on every rank)."""
        ctx, ex = self.ctx, self.executor
        schedule = self._schedule(num_micro_batches, tuple(int(x) for x in shape))
        self.global_loss_tokens = global_loss_tokens
        self.loss_sum.zero_()
        for p in ex.params:
            p.grad = None
        dtype = self.autocast_dtype
        with torch.autocast(ctx.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            args = ()
            if ctx.stage_index == 0:
                if inputs is None:
                    raise ValueError("stage 0 needs the step's inputs")
                args = tuple(inputs[n].to(ctx.device) for n in carried_names(self.spec, 0))
            last = ctx.stage_index == ctx.num_stages - 1  # a 1-stage pipeline is first and last
            schedule.step(*args, **({"target": torch.zeros(num_micro_batches, device=ctx.device)} if last else {}))
        # finish like our executor's REDUCE and STEP instructions
        ex.loss_sum = self.loss_sum
        ex.reduce_gradients()
        ex.optimizer_step(global_loss_tokens)
        return ex.loss
