"""``DynaBatchTrainer``: a Hugging Face ``Trainer`` whose optimizer step is one dynamic global batch.

The stock ``Trainer`` accumulates a fixed number of equal-shape batches per step and normalises each
by its own size. Here one step is one :class:`~dynabatch.integrations.dataloader.StepBatch`: a
variable number of variable-shape micro-batches, normalised by the loss tokens of the whole global
batch. The override is deliberately narrow, so logging, checkpoints, evaluation, LR schedules,
clipping, callbacks and mixed precision stay the Trainer's own:

* ``get_train_dataloader`` returns the :class:`DynaBatchDataLoader`; each "batch" the Trainer pulls
  is a ``StepBatch`` and ``gradient_accumulation_steps`` must be 1 (the token budget sets the step).
* ``get_batch_samples`` skips HF's label counting (``num_items_in_batch`` is not needed: the
  denominator comes with the step).
* ``training_step`` runs, per micro-batch, ``forward_loss(model, mb, attention).loss_sum / T`` (padding-free
  attention by default, ``attention="dense"`` for 4-D masks; ``T``: the global
  batch's loss tokens over all replicas) and a backward, freeing each micro-batch's activations before
  the next; it returns the step's token-normalised loss, which the Trainer logs as ``loss``.
* Data parallelism (torchrun, one process per device): DDP's per-backward all-reduce cannot work when
  ranks run different numbers of micro-batches (a rank with more backwards would wait forever). All
  micro-batches run under ``no_sync`` and on the unwrapped module, and after the last one the
  gradients (and the loss) are summed over ranks in flat buckets. Since each rank's
  loss is already divided by the global ``T``, the sum is exactly the gradient of the global batch's
  token-normalised loss, with no division by the world size.
* ``evaluate`` runs an eval loader (or a dict of them) and reports ``eval_loss`` = summed token loss /
  loss tokens over the whole evaluation set; with ``predict_with_generate`` (``Seq2SeqTrainingArguments``)
  it also generates and adds ``compute_metrics(EvalPrediction(generated ids, label ids))``, prefixed (per eval step,
  with ``compute_result``, under ``batch_eval_metrics``); ``Seq2SeqTrainingArguments(generation_config=...)`` is the
  model's generation config, and ``bf16_full_eval`` / ``fp16_full_eval`` cast the model first outside ``train()``,
  as ``Trainer`` does. ``predict`` always generates and returns a ``PredictionOutput`` (``Seq2SeqTrainer``'s
  ``predict_with_generate``). Generated ids go to the host batch by batch as ``generate`` makes them and the loss is one
  scalar, so no outputs pile up on the device: ``eval_accumulation_steps`` (how many steps of outputs ``Trainer``
  keeps there) holds for any value, and the results do not depend on it.
* Checkpoints also hold the loader's stream position (``dynabatch_loader.json``); resuming restores it
  instead of replaying batches (whatever ``TrainingArguments(ignore_data_skip=...)`` says), and the ``Trainer``
  counts the steps before it as trained, so ``state.epoch`` continues as in the uninterrupted run. A later
  ``train()`` without a checkpoint starts the train loader over, as the stock ``Trainer``'s new dataloader does.

Logs also carry ``padding_efficiency`` (real / computed tokens), ``micro_batches_per_step`` and
``plan_time_s`` of this process's replica, averaged since the previous log, and ``truncated``: the samples cut to
the loader's limits since then (one warning after ``train()`` gives the total). ``train_samples_per_second``
counts the samples the steps held, not ``per_device_train_batch_size`` per step. What the constructor refuses,
warns about or takes from ``TrainingArguments`` is :mod:`dynabatch.integrations.trainer_checks`: the
``TrainingArguments`` of the stock dataloaders (its ``DECIDED_BY_LOADER``) have no effect, and setting one is a
warning; a train loader that tokenized datasets without ``seed=`` is ordered by ``data_seed`` or ``seed``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Mapping

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    EvalPrediction,
    PredictionOutput,
    get_last_checkpoint,
    speed_metrics,
)

from dynabatch.core.allocator import freed_tensors_kept, host_memory_gib
from dynabatch.integrations.dataloader import DynaBatchDataLoader, StepBatch, model_sequence_kind
from dynabatch.integrations.eval_rows import generation_settings, padded, with_last
from dynabatch.integrations.grad_sum import all_reduce_sum
from dynabatch.integrations.trainer_checks import (
    check_arguments,
    check_constructor,
    check_loaders,
    check_pricing,
    check_replica,
    seed_train_loader,
    use_generation_config,
    warn_endless_epochs,
    warn_ignored_arguments,
    warn_unused_metrics_arguments,
)
from dynabatch.models.forward import forward_loss
from dynabatch.training.config.resolve import Found, args_view, decide_why
from dynabatch.training.evaluate import generate_ids

LOADER_STATE_NAME = "dynabatch_loader.json"
"""File in each checkpoint folder holding the train loader's stream position."""


class DynaBatchTrainer(Trainer):
    """``Trainer`` whose optimizer step is one :class:`DynaBatchDataLoader` step (more: the module docstring and
    ``docs/huggingface.md``)::

        args = TrainingArguments(output_dir="out", max_steps=1000, eval_strategy="steps", eval_steps=200,
                                 save_steps=200, report_to=[])
        train = DynaBatchDataLoader(data, limits, token_budget=65_536, model_config=model.config, tokenizer=tok,
                                    num_replicas=args.world_size, replica_index=args.process_index)
        evals = DynaBatchDataLoader(eval_data, limits, token_budget=65_536, model_config=model.config,
                                    tokenizer=tok, num_replicas=args.world_size,
                                    replica_index=args.process_index, each_row_once=True)
        DynaBatchTrainer(model=model, args=args, train_loader=train, eval_loader=evals).train()

    Arguments besides ``Trainer``'s own (``model``, ``args``, ``compute_metrics``, ``callbacks``, ...):

    * ``train_loader``: the :class:`DynaBatchDataLoader` :meth:`train` runs (in place of ``train_dataset``).
    * ``eval_loader``: an ``each_row_once=True`` loader, or a dict of named ones (in place of ``eval_dataset``).
    * ``attention``: the :func:`~dynabatch.models.forward.forward_loss` path, ``segments`` (padding-free, default)
      or ``dense`` (4-D masks).
    * ``cpu_allocator``: ``auto``, ``keep`` or ``system``, as ``dynabatch train --cpu-allocator``.

    ``train_dataset``, ``eval_dataset`` and ``data_collator`` are refused, and so is ``gradient_accumulation_steps``
    other than 1 (the token budget sets the step); the other set-up checks are
    :mod:`~dynabatch.integrations.trainer_checks`.
    """

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        train_loader: DynaBatchDataLoader | None = None,
        eval_loader: DynaBatchDataLoader | Mapping[str, DynaBatchDataLoader] | None = None,
        attention: str = "segments",
        cpu_allocator: str = "auto",
        **kwargs,
    ):
        check_constructor(args, eval_loader, attention, cpu_allocator, kwargs)
        super().__init__(model=model, args=args, eval_dataset=eval_loader, **kwargs)
        self.train_loader = train_loader
        self.attention = attention
        """``segments`` (padding-free, :mod:`dynabatch.models.attention`) or ``dense`` (4-D masks)."""
        self.cpu_allocator = cpu_allocator
        """``--cpu-allocator``: ``keep`` (freed memory stays in the process while :meth:`train` runs,
        :func:`~dynabatch.core.allocator.freed_tensors_kept`), ``system``, or ``auto`` (the resolver's rule, as
        ``dynabatch train`` decides it: ``keep`` for an encoder-decoder on CPU whose budget fits the host)."""
        self.resolved: dict = {}
        """``{field: (value, reason)}`` of the options decided for the user: ``data_seed`` (the train loader's,
        from ``TrainingArguments``) and ``cpu_allocator`` (by the resolver, when :meth:`train` starts)."""
        check_arguments(self.args)
        check_loaders(self.args, self.model, train_loader, eval_loader)
        check_pricing(self.args, attention, train_loader)
        warn_endless_epochs(self.args, train_loader)
        seeded = seed_train_loader(self.args, train_loader)
        if seeded is not None:
            self.resolved["data_seed"] = seeded
        warn_ignored_arguments(self.args)
        use_generation_config(self.args, self.model)
        warn_unused_metrics_arguments(self.args, self.compute_metrics)
        self._train_calls = 0
        self._trained_samples = self._trained_truncated = 0
        self._num_non_embedding_params: int | None = None
        self._reset_step_stats()

    # ------------------------------------------------------------------ training

    def get_train_dataloader(self) -> DynaBatchDataLoader:
        """The ``train_loader`` as it is (no ``torch`` ``DataLoader``, sampler or workers: it plans and collates)."""
        if self.train_loader is None:
            raise ValueError("DynaBatchTrainer: training needs train_loader=DynaBatchDataLoader(...)")
        return self.train_loader

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device) -> tuple[list, None]:
        """The next ``num_batches`` (= 1) StepBatches; no label counting, the step carries its denominator."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    def training_step(self, model: torch.nn.Module, inputs: StepBatch, num_items_in_batch=None) -> torch.Tensor:
        """Forward + backward of every micro-batch of the step; gradients summed over replicas at the end."""
        if not isinstance(inputs, StepBatch):
            raise TypeError(f"DynaBatchTrainer trains on StepBatch inputs, got {type(inputs).__name__}")
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        module = self.accelerator.unwrap_model(model)
        denominator = max(inputs.num_loss_tokens, 1)
        loss_total = torch.zeros((), dtype=torch.float32, device=self.args.device)
        with self.accelerator.no_sync(model):
            for mb in inputs.micro_batches:
                with self.compute_loss_context_manager(), self.accelerator.autocast():
                    loss = forward_loss(module, mb, self.attention).loss_sum / denominator
                self.accelerator.backward(loss)
                loss_total += loss.detach().to(loss_total.device)
        if inputs.num_replicas > 1:
            all_reduce_sum(module, loss_total)
        self._record_step_stats(inputs)
        return loss_total

    def compute_loss(self, model, inputs: StepBatch, return_outputs: bool = False, num_items_in_batch=None):
        """Token-normalised loss of this replica's share of a step (forward only, graph kept)."""
        module = self.accelerator.unwrap_model(model)
        denominator = max(inputs.num_loss_tokens, 1)
        outputs = []
        with self.accelerator.autocast():
            for mb in inputs.micro_batches:
                outputs.append(forward_loss(module, mb, self.attention))
        loss = sum((o.loss_sum for o in outputs), torch.zeros((), device=self.args.device)) / denominator
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs) -> int:
        """HF's estimate ``6 x tokens x non-embedding parameters``, over computed (padded) tokens."""
        if not isinstance(inputs, StepBatch) or not hasattr(self.model, "num_parameters"):
            return 0
        if self._num_non_embedding_params is None:
            self._num_non_embedding_params = int(self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs.stats.computed_tokens * self._num_non_embedding_params

    def _track_num_input_tokens(self, inputs) -> None:
        """``num_input_tokens_seen``: inputs + targets, real (``non_padding``) or computed (``all``)."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no" or not isinstance(inputs, StepBatch):
            return
        count = inputs.stats.real_tokens if mode == "non_padding" else inputs.stats.computed_tokens
        tokens = torch.tensor(count, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum().item())

    # ------------------------------------------------------------------ logging

    def _reset_step_stats(self) -> None:
        self._stat_steps = self._stat_micro_batches = self._stat_real = self._stat_computed = 0
        self._stat_truncated = 0
        self._stat_plan_s = 0.0

    def _record_step_stats(self, step: StepBatch) -> None:
        self._trained_samples += len(step.batch)  # the global batch: every replica's samples
        self._trained_truncated += step.batch.num_truncated
        self._stat_truncated += step.batch.num_truncated
        self._stat_steps += 1
        self._stat_micro_batches += step.stats.num_micro_batches
        self._stat_real += step.stats.real_tokens
        self._stat_computed += step.stats.computed_tokens
        self._stat_plan_s += step.stats.plan_time_s

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._stat_steps:
            logs["padding_efficiency"] = self._stat_real / max(self._stat_computed, 1)
            logs["micro_batches_per_step"] = self._stat_micro_batches / self._stat_steps
            logs["plan_time_s"] = self._stat_plan_s / self._stat_steps
            logs["truncated"] = self._stat_truncated
            self._reset_step_stats()
        if "train_runtime" in logs and "train_samples_per_second" in logs:
            # Trainer counts per_device_train_batch_size samples a step; the steps held these
            logs["train_samples_per_second"] = round(self._trained_samples / max(logs["train_runtime"], 1e-9), 3)
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval",
                 **gen_kwargs) -> dict[str, float]:
        """``{prefix}_loss``: summed token loss / loss tokens over every step of the eval loader(s) (``eval_dataset``:
        a loader, a dict of them, or the name of one in a dict ``eval_loader``, as ``Trainer.evaluate``). With
        ``args.predict_with_generate`` (``Seq2SeqTrainingArguments``) and without ``args.prediction_loss_only`` it
        also generates for every sample and adds ``compute_metrics``' metrics, prefixed, as ``Seq2SeqTrainer`` does
        (see :meth:`predict`)."""
        loader = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(loader, str):  # as Trainer.evaluate: the name of one loader of a dict eval_loader
            named = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {}
            if loader not in named:
                raise ValueError(f"evaluate({loader!r}) names an eval loader, but eval_loader has "
                                 f"{sorted(named) if named else 'no names (it is not a dict)'}")
            loader = named[loader]
        if loader is None:
            raise ValueError("DynaBatchTrainer: evaluation needs "
                             "eval_loader=DynaBatchDataLoader(..., each_row_once=True)")
        if isinstance(loader, Mapping):
            metrics: dict[str, float] = {}
            for name, sub in loader.items():
                metrics.update(self.evaluate(sub, ignore_keys, f"{metric_key_prefix}_{name}", **gen_kwargs))
            return metrics
        # as Seq2SeqTrainer: prediction_loss_only evaluates the loss alone, without generating
        generate = bool(getattr(self.args, "predict_with_generate", False)) and not self.args.prediction_loss_only
        metrics = self._evaluation_loop(loader, metric_key_prefix, generate, gen_kwargs, keep=False).metrics
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs) -> PredictionOutput:
        """Generate for every sample of this process's micro-batches of ``test_dataset`` (a
        :class:`DynaBatchDataLoader` with ``max_steps``), as ``Seq2SeqTrainer.predict`` with
        ``predict_with_generate``: greedy unless ``num_beams`` (``gen_kwargs``, else ``args.generation_num_beams``),
        at most ``max_new_tokens`` new tokens (``gen_kwargs``' ``max_new_tokens`` or ``max_length``, else
        ``args.generation_max_length``, else 32). ``predictions``: (N, L) generated ids cut at EOS, padded with
        the pad id; ``label_ids``: (N, T) target ids (EOS included) padded with -100; samples in loader order
        (replicas gathered in replica order). ``metrics``: ``{prefix}_loss`` and ``compute_metrics(EvalPrediction)``
        prefixed with ``{prefix}_``. Callbacks' ``on_predict`` gets the metrics, as after ``Trainer.predict``."""
        output = self._evaluation_loop(test_dataset, metric_key_prefix, True, gen_kwargs)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return output

    def _evaluation_loop(self, loader, prefix: str, generate: bool, gen_kwargs: dict,
                         keep: bool = True) -> PredictionOutput:
        """Loss over every step of ``loader``; with ``generate``, predictions, labels and ``compute_metrics``.

        With ``args.batch_eval_metrics`` (as ``Trainer``'s evaluation loop) each step's samples are generated and
        handed to ``compute_metrics(EvalPrediction, compute_result=<last step>)`` as the step ends, and the metrics
        are those of the last call; the predictions are kept only for ``predict`` (``keep``). With
        ``args.bf16_full_eval`` / ``fp16_full_eval`` outside ``train()`` the model is cast to that dtype first, as
        ``Trainer`` casts it (in place: it stays in that dtype)."""
        if not isinstance(loader, DynaBatchDataLoader):
            raise ValueError(f"evaluate() / predict() take a DynaBatchDataLoader, got a {type(loader).__name__}; build "
                             "one on the data with each_row_once=True (every row once)")
        if loader.max_steps is None:
            raise ValueError("evaluate() / predict() got an endless DynaBatchDataLoader (a training stream, which draws "
                             "rows with repetition and never ends); build it with each_row_once=True (every row once)")
        check_replica(self.args, "the loader of evaluate() / predict()", loader)
        self._memory_tracker.start()
        start = time.time()
        if not self.is_in_train and (self.args.fp16_full_eval or self.args.bf16_full_eval):
            dtype = torch.float16 if self.args.fp16_full_eval else torch.bfloat16
            self.model = self.model.to(dtype=dtype, device=self.args.device)
        module = self.model
        was_training = module.training
        module.eval()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.args.device)
        num_tokens = num_samples = num_steps = num_truncated = 0
        samples = []
        per_step = generate and self.args.batch_eval_metrics
        generated: list[list[int]] = []
        targets: list[list[int]] = []
        computed = None
        pad = loader.batcher.data.tokens.pad_id
        with torch.no_grad():
            for step, last in with_last(loader):
                step_samples = []
                for mb in step.micro_batches:
                    with self.accelerator.autocast():
                        loss_sum += forward_loss(module, mb, self.attention).loss_sum.float().to(loss_sum.device)
                    step_samples += [step.batch.samples[i] for row in mb.sample_ids for i in row]
                num_tokens += step.num_loss_tokens
                num_samples += len(step.batch)
                num_truncated += step.batch.num_truncated
                num_steps += 1
                if not per_step:
                    samples += step_samples
                    continue
                gen, tgt = self._generate(module, loader, step_samples, gen_kwargs)
                if keep:
                    generated += gen
                    targets += tgt
                if self.compute_metrics is not None:
                    batch = EvalPrediction(predictions=padded(gen, pad), label_ids=padded(tgt, -100))
                    computed = self.compute_metrics(batch, compute_result=last)
        if loader.num_replicas > 1:
            torch.distributed.all_reduce(loss_sum)
        module.train(was_training)
        metrics = {f"{prefix}_loss": loss_sum.item() / max(num_tokens, 1), f"{prefix}_loss_tokens": num_tokens,
                   f"{prefix}_truncated": num_truncated}
        predictions = labels = None
        if generate:
            if not per_step:
                generated, targets = self._generate(module, loader, samples, gen_kwargs)
            if keep or not per_step:
                predictions, labels = padded(generated, pad), padded(targets, -100)
            if self.compute_metrics is not None and not per_step:
                computed = self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=labels))
            if computed is not None:
                metrics.update({k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in computed.items()})
        metrics.update(speed_metrics(prefix, start, num_samples=num_samples, num_steps=num_steps))
        self._memory_tracker.stop_and_update_metrics(metrics)
        return PredictionOutput(predictions=predictions, label_ids=labels, metrics=metrics)

    def _generate(self, module, loader: DynaBatchDataLoader, samples: list, gen_kwargs: dict):
        """(generated ids, target ids) of ``samples`` (:meth:`predict`), rows gathered over the replicas. Other
        ``gen_kwargs`` than the lengths and ``num_beams`` go to ``model.generate`` as given (``Seq2SeqTrainer``'s)."""
        max_new, beams, extra = generation_settings(self.args, module, gen_kwargs)
        generated = generate_ids(module, samples, loader.batcher.data.tokens, max_new, num_beams=beams, extra=extra)
        targets = [s.target_ids.tolist() for s in samples]
        if loader.num_replicas > 1:
            parts: list = [None] * loader.num_replicas
            torch.distributed.all_gather_object(parts, (generated, targets))
            generated = [g for part in parts for g in part[0]]
            targets = [t for part in parts for t in part[1]]
        return generated, targets

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.train_loader is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, LOADER_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(self.train_loader.state_dict(), f)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; when resuming, the train loader continues at the checkpoint's stream position and the
        ``Trainer`` counts the steps before it as trained (:func:`_trained_steps_counted`). A later ``train()``
        without a checkpoint starts the train loader over at its first step (:meth:`DynaBatchDataLoader.restart`), as
        the stock ``Trainer``'s new dataloader does; the model keeps the weights it trained."""
        if self.train_loader is not None and self.train_loader.max_steps is None and self.args.max_steps <= 0:
            # else Trainer's own "args.max_steps must be set to a positive value if dataloader does not have a length"
            raise ValueError("the train_loader is endless (no max_steps), so the run's length is yours to set: pass "
                             "TrainingArguments(max_steps=N), or build the loader with max_steps=N (steps per epoch) "
                             "to train num_train_epochs epochs of N steps")
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)  # None: Trainer.train raises its own error
        if isinstance(checkpoint, str) and self.train_loader is not None:
            if not os.path.isdir(checkpoint):
                raise ValueError(f"resume_from_checkpoint={checkpoint!r} is not a folder; pass a checkpoint-N folder "
                                 f"or True (the last checkpoint in output_dir {self.args.output_dir!r})")
            path = os.path.join(checkpoint, LOADER_STATE_NAME)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    self.train_loader.load_state_dict(json.load(f))
            else:
                warnings.warn(f"{checkpoint} has no {LOADER_STATE_NAME}; the data stream continues from where the loader is")
        elif self._train_calls and self.train_loader is not None:
            # as Trainer.train, which builds a new dataloader: a second run without a checkpoint starts the data over
            self.train_loader.restart()
        self._train_calls += 1
        allocator, why = self._decided_cpu_allocator()
        if self.cpu_allocator == "auto":
            self.resolved["cpu_allocator"] = (allocator, why)
        self._trained_samples = self._trained_truncated = 0
        resuming = isinstance(checkpoint, str) and self.train_loader is not None
        with freed_tensors_kept(allocator == "keep"), _trained_steps_counted(self.args, resuming):
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        if self._trained_truncated and self.is_world_process_zero():
            warnings.warn(f"{self._trained_truncated} of the {self._trained_samples} samples trained were truncated "
                          f"to the train loader's limits ({self.train_loader.limits.describe()}); the logs count "
                          "them as 'truncated'. Raise the LengthLimits to train on them whole")
        return output

    def get_resumed_dataloader(self, dataloader: DynaBatchDataLoader, num_batches: int) -> DynaBatchDataLoader:
        """The train loader as it is: :meth:`train` has restored its position from the checkpoint, so the
        ``num_batches`` steps the ``Trainer`` would skip to reach it are behind it already."""
        return dataloader

    def _decided_cpu_allocator(self) -> tuple[str, str | None]:
        """:attr:`cpu_allocator` as the resolver's ``cpu_allocator`` rule decides it for this process: its device, the
        model's sequence kind, the world size, the host's memory and the device memory the train loader plans for."""
        cost = getattr(self.train_loader, "cost_model", None)
        memory = getattr(cost, "device_memory_bytes", None) or getattr(cost, "memory_budget_bytes", 0.0)
        on_cuda = self.args.device.type == "cuda"
        config = getattr(self.model, "config", None)
        found = Found(cuda_available=on_cuda, world_size=self.args.world_size, host_memory_gib=host_memory_gib(),
                      sequence_kind=None if config is None else model_sequence_kind(config))
        view = args_view(cpu_allocator=self.cpu_allocator, device="cuda" if on_cuda else "cpu",
                         memory_gib=float(memory) / 2**30)
        value, why = decide_why(view, "cpu_allocator", found)
        return ("system", "the model's sequence kind is not known") if value == "auto" else (value, why)


@contextlib.contextmanager
def _trained_steps_counted(args: TrainingArguments, resuming: bool) -> Iterator[None]:
    """While resuming, ``args.ignore_data_skip`` is ``False``: the ``Trainer`` then counts the checkpoint's steps of
    the epoch it stopped in as trained (``state.epoch`` and that epoch's remaining steps continue as the
    uninterrupted run's) and asks :meth:`DynaBatchTrainer.get_resumed_dataloader` for the loader past them, which
    the loader's restored position already is. With ``True`` the ``Trainer`` would count that epoch from its first
    step, though the data continues from the checkpoint either way."""
    if not resuming or not args.ignore_data_skip:
        yield
        return
    args.ignore_data_skip = False
    try:
        yield
    finally:
        args.ignore_data_skip = True
