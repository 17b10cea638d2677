"""Evaluation during ``dynabatch train``: token-normalised loss per task through the pipeline, and generation
metrics (exact match, ROUGE-L) per task from ``generate()`` on the gathered model.

**The evaluation set** (rank 0, once, before the first step; the same samples at every evaluation): the
``--eval-mixture`` spec's sources, or, with ``--eval-holdout F``, a fraction ``F`` of every task's rows that
:func:`hold_out` takes out of the training data. Every row of it once per evaluation (``--eval-samples N``: at
most ``N`` rows per task, chosen by a permutation seeded with the mixture's seed), truncated to the run's
length limits (``--max-input-len`` / ``--max-target-len``), whatever ``--overlong`` says for training.

**Loss** (collective, every rank): the set is cut once into length-sorted micro-batches (the ``token_budget``
baseline: longest first, each at most ``global_batch_tokens / (2 * stages)`` padded tokens, so a replica's
pipeline gets at least ``2 S`` micro-batches per global batch of samples) and dealt to the replicas. They
are not planned by the dynamic planner: a forward keeps no activations for a backward, so these fit where
the training step's fit, and fixed shapes make every evaluation the same computation. Rank 0 lowers a GPipe
schedule and strips it to its forwards (:func:`~dynabatch.engine.step.forward_only_plan`); the plans travel
and run like a training step's (:func:`~dynabatch.engine.step.train_step` with ``forward_only=True``), so
the loss goes through the same stages, ranks and attention kernels, under ``no_grad`` with the stages in
eval mode, and changes no weight, optimizer, scheduler or RNG state. The per-task losses come from the last
stages' per-segment losses (:func:`gather_task_losses`); the overall loss is the
summed token loss over every loss token of the set.

**Generation** (every ``--generate-every`` evaluations, and always at the end): the ranks of replica 0 send
their stage's parameters under their Hugging Face names to rank 0 (``gather_object``), which copies them
into a full model built like the trainer's (once, under a forked RNG) and runs greedy ``generate()`` with
``--generation-max-new-tokens``: T5 from the inputs, a causal model from the inputs as the prompt
(left-padded) with the target as the continuation to predict. Outputs are cut at EOS and decoded with the
run's tokenizer, as are the references; :func:`normalise` strips them and collapses whitespace. Exact match
is the fraction of equal strings, ROUGE-L the mean F-measure of ``rouge-score`` (its default tokenizer:
lower-cased alphanumeric words). On a CUDA device without room for the whole model, generation is skipped
with a warning. The other ranks wait for rank 0's generation up to ``--startup-timeout-s`` (the wait for
rank 0's own work), not the per-step ``--timeout-s``.

Rows in ``metrics.jsonl`` (never in the training summary's records):
``{"step": s, "kind": "eval", "eval": {"loss", "task_loss", "loss_tokens", "samples", "exact_match",
"rouge_l", "time_s", ...}}``, where ``s`` is the step after whose update the evaluation ran (a resume from
a checkpoint at step ``N`` keeps the rows of ``s < N``); :func:`flat_metrics` names them for trackers
(``eval/loss``, ``eval/<task>/loss``, ``eval/<task>/exact_match``, ``eval/<task>/rouge_l``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dynabatch.data.batching import LengthLimits, evaluation_rows, truncate_sample
from dynabatch.data.microbatch import MicroBatch
from dynabatch.data.pipeline import MixtureData, TokenColumn
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.tokenize import TokenizerInfo, load_tokenizer, tokenizer_info
from dynabatch.engine.dist import DistContext, gather_to_planner
from dynabatch.training.metrics import MetricsWriter
from dynabatch.data.mixture import MixtureSpec, mixture_rates
from dynabatch.data.baselines import RowGroup, group_shape, make_batcher
from dynabatch.plan.candidates import deal_to_replicas
from dynabatch.engine.step import train_step
from dynabatch.models.families import check_model
from dynabatch.models.presets import build_run_model

_DONE_TAG = 7
"""Tag of rank 0's "generation finished" message to the other ranks (delivery uses 0 and 1)."""


@dataclass(frozen=True)
class EvalSet:
    """The fixed evaluation samples of a run and their micro-batches (rank 0)."""

    batch: GlobalBatch
    """Every evaluation sample (step -1), truncated to the run's limits."""
    replica_micro_batches: tuple[tuple[MicroBatch, ...], ...]
    """Per replica, its micro-batches (rows index ``batch.samples``)."""

    @property
    def tasks(self) -> list[str]:
        return sorted({s.task for s in self.batch.samples})

    @property
    def replica_rows(self) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]:
        """Per replica, per micro-batch, its rows of ``batch`` sample indices (as a planned step's)."""
        return tuple(tuple(mb.sample_ids for mb in mbs) for mbs in self.replica_micro_batches)


# ---------------------------------------------------------------------------------------------- the set


def select_samples(data: MixtureData, per_task: int | None, seed: int) -> list[TokenizedSample]:
    """Every row of ``data`` once (``per_task``: at most that many of every task), each source's rows in the
    order of a permutation seeded with ``(seed, source index)``: deterministic, and a cap is not biased by
    the order of the files (:func:`~dynabatch.data.batching.evaluation_rows`)."""
    return [data.sample(k, row) for k, row in evaluation_rows(data, per_task, seed)]


def _take_rows(column: TokenColumn, rows: np.ndarray) -> TokenColumn:
    lengths = column.lengths[rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    parts = [column[int(r)] for r in rows]
    values = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, dtype=np.int32)
    return TokenColumn(values=values, offsets=offsets)


def hold_out(data: MixtureData, fraction: float, seed: int) -> tuple[MixtureData, MixtureData]:
    """``(training data, held-out data)``: of every task in every source, ``round(fraction * rows)`` rows (at
    least one, and one fewer than all) chosen by a permutation seeded with ``(seed, source index)`` go to the
    held-out data and out of the training data; mixing rates are recomputed from the rows left. Rows keep
    their place in the source files (``source_rows``) for error messages."""

    train, held = [], []
    for k, source in enumerate(data.sources):
        tasks = np.asarray(source.tasks, dtype=object)
        is_held = np.zeros(len(source), dtype=bool)
        order = np.random.default_rng([seed, k]).permutation(len(source))
        for task in dict.fromkeys(source.tasks):
            rows = order[tasks[order] == task]
            if len(rows) < 2:
                raise ValueError(f"--eval-holdout: task {task!r} of source {source.name!r} has {len(rows)} row; "
                                 "holding rows out needs at least 2 per task; use --eval-mixture instead")
            is_held[rows[: min(len(rows) - 1, max(1, round(fraction * len(rows))))]] = True
        for keep, out in ((~is_held, train), (is_held, held)):
            rows = np.flatnonzero(keep)
            source_rows = np.array([source.source_row(int(r)) for r in rows], dtype=np.int64)
            out.append(dataclasses.replace(
                source, tasks=[source.tasks[int(r)] for r in rows], input_ids=_take_rows(source.input_ids, rows),
                target_ids=_take_rows(source.target_ids, rows), source_rows=source_rows))
    rates = [mixture_rates(data.spec, [len(s) for s in part]) for part in (train, held)]
    return (dataclasses.replace(data, sources=tuple(train), rates=rates[0]),
            dataclasses.replace(data, sources=tuple(held), rates=rates[1]))


def eval_micro_batch_tokens(cfg, limits: LengthLimits) -> int:
    """Padded tokens per evaluation micro-batch: ``global_batch_tokens / (2 * stages)``, at least one maximal sample."""
    return max(limits.max_tokens, cfg.global_batch_tokens // (2 * cfg.stages))


def build_eval_set(samples: list[TokenizedSample], limits: LengthLimits, tokens: TokenizerInfo, max_tokens: int,
                   num_replicas: int) -> EvalSet:
    """Truncate ``samples`` to ``limits`` and cut them into length-sorted micro-batches of at most ``max_tokens``
    padded tokens (fewer when needed so that every replica gets one), dealt to the replicas largest first."""

    batch = GlobalBatch(-1, tuple(truncate_sample(s, limits, tokens.eos_id) for s in samples))
    if len(batch) < num_replicas:
        raise ValueError(f"the evaluation set has {len(batch)} samples, fewer than the {num_replicas} replicas; "
                         "raise (or drop) --eval-samples or give a larger --eval-mixture")
    batcher = make_batcher("token_budget", limits, tokens, max_tokens=max(limits.max_tokens, max_tokens))
    groups = batcher.group(batch)
    while len(groups) < num_replicas:  # a few long samples: halve the group of the most rows
        k = max(range(len(groups)), key=lambda i: len(groups[i].rows))
        rows = groups.pop(k).rows
        groups[k:k] = [RowGroup(rows[: len(rows) // 2]), RowGroup(rows[len(rows) // 2:])]
    shapes = [group_shape(batch, g, limits.family) for g in groups]
    replicas = deal_to_replicas(groups, [b * (e + d) for b, e, d in shapes], num_replicas)
    return EvalSet(batch, tuple(tuple(batcher.collate(batch, g) for g in gs) for gs in replicas))


# ---------------------------------------------------------------------------------------------- generation


def normalise(text: str) -> str:
    """A string as exact match compares it: stripped, runs of whitespace as one space."""
    return " ".join(text.split())


def _continuation(ids: np.ndarray, tokens: TokenizerInfo) -> list[int]:
    """Generated ids up to (without) the first EOS, without pad ids and ids past the tokenizer's vocabulary."""
    out = []
    for t in ids.tolist():
        if t == tokens.eos_id:
            break
        if t != tokens.pad_id and t < tokens.vocab_size:
            out.append(t)
    return out


def generate_ids(model, samples, tokens: TokenizerInfo, max_new_tokens: int, *, num_beams: int = 1,
                 batch_rows: int = 64, extra: dict | None = None) -> list[list[int]]:
    """Per sample, the ids ``model.generate`` continues its ``input_ids`` with (greedy unless ``num_beams > 1``),
    cut at EOS (:func:`_continuation`); ``extra``: further ``generate`` keywords (``do_sample=True``,
    ``repetition_penalty``...), over the defaults. Prompts go in batches of ``batch_rows``, sorted by length:
    right-padded for an encoder-decoder, left-padded for a causal model (the prompt's end next to its continuation).
    The model is in eval mode during the call and back in its mode after."""
    seq2seq = bool(model.config.is_encoder_decoder)
    device = next(model.parameters()).device
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].input_ids), i))
    out: list[list[int]] = [[] for _ in samples]
    options = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=num_beams, pad_token_id=tokens.pad_id,
                   eos_token_id=tokens.eos_id)
    if seq2seq:
        options["decoder_start_token_id"] = tokens.decoder_start_id
    options.update(extra or {})
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_rows):
                chunk = order[start : start + batch_rows]
                width = max(1, max(len(samples[i].input_ids) for i in chunk))
                ids = torch.full((len(chunk), width), tokens.pad_id, dtype=torch.long)  # (B, W)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, i in enumerate(chunk):
                    x = torch.as_tensor(np.asarray(samples[i].input_ids, dtype=np.int64))
                    span = slice(0, len(x)) if seq2seq else slice(width - len(x), width)
                    ids[r, span], mask[r, span] = x, 1
                generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **options)
                new = (generated[:, 1:] if seq2seq else generated[:, width:]).cpu().numpy()  # T5: after the start id
                for r, i in enumerate(chunk):
                    out[i] = _continuation(new[r], tokens)
    finally:
        model.train(was_training)
    return out


def decode(tokenizer, ids) -> str:
    """``ids`` as text (special tokens skipped), :func:`normalise` d."""
    return normalise(tokenizer.decode(list(ids), skip_special_tokens=True))


def reference_text(tokenizer, sample: TokenizedSample, tokens: TokenizerInfo) -> str:
    """A sample's target as the text generation should produce: its ids up to EOS, decoded."""
    return decode(tokenizer, _continuation(np.asarray(sample.target_ids), tokens))


def generation_scores(predictions: list[str], references: list[str], tasks: list[str]) -> dict[str, Any]:
    """Exact match and ROUGE-L (F-measure) of normalised strings: ``{"exact_match": {task: mean}, "rouge_l":
    {task: mean}, "exact_match_all": mean over every sample, "rouge_l_all": ...}``."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    em = np.array([normalise(p) == normalise(r) for p, r in zip(predictions, references)], dtype=np.float64)
    rl = np.array([1.0 if same else scorer.score(normalise(r), normalise(p))["rougeL"].fmeasure
                   for p, r, same in zip(predictions, references, em)], dtype=np.float64)
    by_task = np.asarray(tasks, dtype=object)
    names = sorted(set(tasks))
    return {"exact_match": {t: float(em[by_task == t].mean()) for t in names},
            "rouge_l": {t: float(rl[by_task == t].mean()) for t in names},
            "exact_match_all": float(em.mean()), "rouge_l_all": float(rl.mean())}


# ---------------------------------------------------------------------------------------------- gathering


def gather_weights(ctx: DistContext, stage) -> dict[str, torch.Tensor] | None:
    """Collective: rank 0 gets replica 0's parameters under their Hugging Face names (CPU tensors), from every
    stage's ``parameter_map``; the others get ``None``. Tied copies are equal, so any holder serves."""
    mine = None
    if ctx.replica_index == 0:
        mine = {stage.parameter_map[n]: p.detach().cpu() for n, p in stage.named_parameters()}
    gathered = gather_to_planner(ctx, mine, "the weights")
    if not ctx.is_planner:
        return None
    weights: dict[str, torch.Tensor] = {}
    for part in gathered:
        weights.update(part or {})
    return weights


def load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (HF name -> tensor) into ``model``'s parameters; ``ValueError`` if one is not covered."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(f"the gathered stages do not cover parameters {missing[:5]} of the model")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


def fits_device(model, device: torch.device) -> bool:
    """Whether ``model``'s parameters (and as much again for generation) fit ``device``'s free memory (CPU: yes)."""
    if device.type != "cuda":
        return True
    need = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return torch.cuda.mem_get_info(device)[0] > need


# ---------------------------------------------------------------------------------------------- the run


def flat_metrics(row: dict[str, Any]) -> dict[str, float]:
    """An evaluation row as tracker metrics: ``eval/loss``, ``eval/<task>/loss``, ``eval/exact_match`` (over
    every sample), ``eval/<task>/exact_match``, ``eval/rouge_l`` and ``eval/<task>/rouge_l``."""
    ev = row["eval"]
    out = {"eval/loss": ev["loss"]}
    out.update({f"eval/{t}/loss": v for t, v in ev["task_loss"].items()})
    for key in ("exact_match", "rouge_l"):
        if key in ev:
            out[f"eval/{key}"] = ev[f"{key}_all"]
            out.update({f"eval/{t}/{key}": v for t, v in ev[key].items()})
    return out


def format_eval(row: dict[str, Any]) -> str:
    """The one line rank 0 prints after an evaluation."""
    ev = row["eval"]
    tasks = len(ev["task_loss"])
    done = row["step"] + 1  # as the progress bar and the checkpoint folders count (metrics.jsonl's step is from 0)
    line = (f"eval after {done} step{'s' if done != 1 else ''}: loss {ev['loss']:.4f} over {ev['samples']} samples of "
            f"{tasks} task{'s' if tasks != 1 else ''}")
    if tasks > 1:
        worst = max(ev["task_loss"].items(), key=lambda kv: kv[1])
        line += f" (highest task loss: {worst[0]} {worst[1]:.4f})"
    if "exact_match" in ev:
        line += f", exact match {ev['exact_match_all']:.3f}, ROUGE-L {ev['rouge_l_all']:.3f}"
    return line + f" ({ev['time_s']:.1f} s)"


def evaluation_enabled(cfg) -> bool:
    return bool(cfg.eval_mixture or cfg.eval_holdout)


def gather_task_losses(ctx: DistContext, result, planned) -> dict[str, float] | None:
    """Collective: rank 0 gets the step's mean token loss per task, from every replica's last stage."""
    payload = {m: t.numpy() for m, t in result.segment_losses.items()}
    gathered = gather_to_planner(ctx, payload, f"step {result.step}'s task losses")
    if not ctx.is_planner:
        return None
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for r in range(ctx.num_replicas):
        for m, arr in gathered[ctx.rank_of(r, ctx.num_stages - 1)].items():
            for row, ids in enumerate(planned.replica_rows[r][m]):
                for k, i in enumerate(ids[: arr.shape[1]]):  # a token slice may hold a row's first segments only
                    task = planned.batch.samples[i].task
                    sums[task] = sums.get(task, 0.0) + float(arr[row, k, 0])
                    counts[task] = counts.get(task, 0.0) + float(arr[row, k, 1])
    return {t: sums[t] / counts[t] for t in sorted(sums) if counts[t] > 0}


@dataclass
class Evaluator:
    """Evaluation of one training run on this rank (see the module docstring); rank 0 holds the set."""

    cfg: Any
    ctx: DistContext
    eval_set: EvalSet | None = None
    tokenizer: Any = None
    tokens: TokenizerInfo | None = None
    model: Any = None
    """Rank 0: the full model generation runs on, built at the first generation."""
    writer: MetricsWriter | None = None
    """Rank 0: appends each evaluation's row to the run's ``metrics.jsonl``."""
    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def create(cls, cfg, ctx: DistContext, metrics_path: str | None = None,
               held_out: MixtureData | None = None) -> "Evaluator":
        """Rank 0 loads the set (``held_out``: the data :func:`hold_out` kept from training, else
        ``cfg.eval_mixture``) and writes rows to ``metrics_path``; the other ranks only take part in the
        collectives."""
        ev = cls(cfg, ctx)
        if not ctx.is_planner:
            return ev
        ev.writer = MetricsWriter(metrics_path) if metrics_path else None
        family = check_model(cfg.model, cfg.max_input_len, cfg.slice_long).sequence_kind
        ev.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
        ev.tokens = tokenizer_info(ev.tokenizer)
        data = held_out
        if data is None:
            data = MixtureData.load(MixtureSpec.from_file(cfg.eval_mixture), ev.tokenizer, family, bad_rows=cfg.bad_rows)
        limits = LengthLimits(family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                              max_seq_len=cfg.max_input_len)
        samples = select_samples(data, cfg.eval_samples, data.spec.seed)
        ev.eval_set = build_eval_set(samples, limits, ev.tokens, eval_micro_batch_tokens(cfg, limits), cfg.replicas)
        return ev

    def due(self, step: int) -> bool:
        """Evaluate after step ``step``: every ``eval_steps`` steps and after the last."""
        every = self.cfg.eval_steps
        return step + 1 == self.cfg.max_steps or bool(every and (step + 1) % every == 0)

    def generates(self, step: int) -> bool:
        """The evaluation after ``step`` also generates: every ``generate_every``-th evaluation, and the last."""
        every, k = self.cfg.generate_every, self.cfg.eval_steps
        periodic = bool(every and k and (step + 1) % k == 0 and ((step + 1) // k) % every == 0)
        return step + 1 == self.cfg.max_steps or periodic

    def evaluate(self, run, step: int) -> dict[str, Any] | None:
        """Collective: evaluate ``run`` (the trainer's ``_Run``) after step ``step``; rank 0 returns the row."""

        t0 = time.perf_counter()
        es = self.eval_set
        result = train_step(run.executor, self.ctx, step, es.replica_micro_batches if es else None, spec=run.spec,
                            policy="gpipe", forward_only=True, placement=run.placement)
        task_loss = gather_task_losses(self.ctx, result, es)  # collective
        row = None
        if self.ctx.is_planner:
            row = {"step": step, "kind": "eval",
                   "eval": {"loss": result.loss, "task_loss": task_loss, "loss_tokens": result.num_loss_tokens,
                            "samples": len(es.batch)}}
        if self.generates(step):
            scores = self._generation(run)  # collective
            if row is not None and scores is not None:
                row["eval"].update(scores)
        if row is not None:
            row["eval"]["time_s"] = time.perf_counter() - t0
            self.rows.append(row)
            if self.writer is not None:
                self.writer.write(row)
        return row

    def _generation(self, run) -> dict[str, Any] | None:
        """Collective: gather the model on rank 0, which generates and scores; the others wait for it."""
        weights = gather_weights(self.ctx, run.stage)
        if not self.ctx.is_planner:
            self._wait_for_rank0()
            return None
        try:
            return self._generate_and_score(weights)
        finally:
            self._release_others()

    def _generate_and_score(self, weights: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        if self.model is None:
            family = check_model(self.cfg.model, None).sequence_kind
            with torch.random.fork_rng(devices=[]):  # build_model seeds the global RNG
                self.model = build_run_model(self.cfg.model, self.cfg.tokenizer, self.tokens, family,
                                             seed=self.cfg.seed)
        load_weights(self.model, weights)
        if not fits_device(self.model, self.ctx.device):
            warnings.warn(f"generation metrics skipped: the whole model does not fit rank 0's {self.ctx.device}",
                          stacklevel=2)
            return None
        self.model.to(self.ctx.device)
        samples = self.eval_set.batch.samples
        ids = generate_ids(self.model, samples, self.tokens, self.cfg.generation_max_new_tokens)
        predictions = [decode(self.tokenizer, x) for x in ids]
        references = [reference_text(self.tokenizer, s, self.tokens) for s in samples]
        scores = generation_scores(predictions, references, [s.task for s in samples])
        scores["generation_time_s"] = time.perf_counter() - t0
        return scores

    def _release_others(self) -> None:
        works = [dist.isend(torch.zeros(1), dst=r, group=self.ctx.delivery_group, tag=_DONE_TAG)
                 for r in range(1, self.ctx.world_size)]
        for w in works:
            w.wait()

    def _wait_for_rank0(self) -> None:
        flag = torch.zeros(1)
        dist.irecv(flag, src=0, group=self.ctx.delivery_group, tag=_DONE_TAG).wait(
            timedelta(seconds=self.cfg.startup_timeout_s))
