"""Rank 0's per-step data-path work, tensors delivered against layouts delivered, on the same planned steps.

One process, no ranks: ``StepPlanner`` plans ``--steps`` steps of a ``dynabatch train`` configuration (default: the
built-in mixture, t5-tiny, 2 stages; ``--replicas 2`` for a 2 x 2 run; ``--calibrate off``), then each step's data
path is timed both ways, each part ``--repeat`` times (median per step, then the median and p10-p90 over steps):

* tensors (main before the thin data path): the planner collates every replica's micro-batches, the planner
  process's message carries them (pickled with the tensors as numpy arrays, as its pickler did) and the batch's
  samples, rank 0 cuts every rank's tensors (``step_payloads``) and packs each other rank's message;
* layouts (now): the planner process's message holds plans only (``PlannedStep.without_data``) and the parent
  rebuilds the batch (``StepPlanner.with_data``); rank 0 makes each replica's layout and the loss tokens, packs each
  other rank's message (plan + layout) and collates its own replica; another rank unpacks its message and collates
  its own (``own_inputs``).

    python scripts/bench_data_path.py [--replicas 2] [--steps 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import time


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _former_dumps(obj) -> bytes:
    """The planner process's pickler before plans only: CPU tensors as numpy arrays."""
    import torch

    class Pickler(pickle.Pickler):
        def reducer_override(self, o):
            if type(o) is torch.Tensor:
                return torch.from_numpy, (o.numpy(),)
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _fresh(planned):
    """``planned`` without its collated micro-batches (a new object: the cache is per object)."""
    from dataclasses import replace

    return replace(planned)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    import torch

    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.training.trainer import load_training_data
    from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
    from dynabatch.engine.delivery import pack, unpack
    from dynabatch.engine.step import layout_payloads, own_inputs, step_payloads
    from dynabatch.models.families import check_model
    from dynabatch.models.presets import build_run_model
    from dynabatch.models.split import layout_for, pipeline_spec_for
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.cost_model import planner_cost_model
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.planner_process import _dumps
    from dynabatch.training.step_data import StepData
    from dynabatch.training.trainer import resolve_run

    torch.set_num_threads(1)
    cfg = resolve_run(TrainConfig(stages=args.stages, replicas=args.replicas, calibrate="off")).config
    family = check_model(cfg.model, cfg.max_input_len, cfg.slice_long).sequence_kind
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
    info = tokenizer_info(tokenizer)
    model = build_run_model(cfg.model, cfg.tokenizer, info, family, seed=cfg.seed)
    layout = layout_for(model, cfg.stages)
    spec = pipeline_spec_for(model, layout, "float32")
    data = load_training_data(cfg, tokenizer, family)
    limits = LengthLimits(family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)

    def batcher():
        return GlobalBatcher(data, limits, token_budget=cfg.global_batch_tokens, overlong=cfg.overlong)

    planner = StepPlanner(batcher(), cfg, planner_cost_model(cfg, model.config, layout), data.tokens, spec=spec)
    rank0, other = StepData(planner.batcher, cfg, data.tokens), StepData(batcher(), cfg, data.tokens)
    steps = [planner() for _ in range(args.steps)]
    last = max(steps[0].plans)  # the last rank: last stage of the last replica
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for planned in steps:
        # tensors: the planner collates everything; its process pickles it; rank 0 cuts and packs every rank's
        t_collate, _ = _timed(lambda: _fresh(planned).replica_micro_batches, args.repeat)
        full = _fresh(planned)
        full.replica_micro_batches
        message = _former_dumps(full)
        t_loads, _ = _timed(lambda: pickle.loads(message), args.repeat)
        t_pack, packed = _timed(lambda: [pack(p) for r, p in step_payloads(full.plans, full.replica_micro_batches,
                                                                            spec).items() if r], args.repeat)
        add("tensors: planner collates every replica, ms", 1e3 * t_collate)
        add("tensors: planner process message, KB", len(message) / 1e3)
        add("tensors: parent unpickles it, ms", 1e3 * t_loads)
        add("tensors: rank 0 cuts and packs the other ranks' messages, ms", 1e3 * t_pack)
        add("tensors: bytes sent to the other ranks, KB", sum(int(h[5] if len(h) > 6 else h[4]) for h, _ in packed) / 1e3)
        # layouts: plans only from the planner process; rank 0 packs layouts and collates its own replica
        thin = _dumps(planned.without_data())
        t_in, _ = _timed(lambda: planner.with_data(pickle.loads(thin)), args.repeat)

        def rank0_side():
            fresh = planner.with_data(pickle.loads(thin))
            payloads = layout_payloads(fresh.plans, rank0.layouts(fresh), rank0.loss_tokens(fresh))
            sent = [pack(p) for r, p in payloads.items() if r]
            return sent, own_inputs(payloads[0], spec, rank0.micro_batches)

        t0_side, (sent, _) = _timed(rank0_side, args.repeat)
        header, payload = sent[last - 1]

        def other_side():
            other._recent.clear()
            return own_inputs(unpack(header, payload), spec, other.micro_batches)

        t_other, _ = _timed(other_side, args.repeat)
        add("layouts: planner process message, KB", len(thin) / 1e3)
        add("layouts: parent unpickles it and rebuilds the batch, ms", 1e3 * t_in)
        add("layouts: rank 0 takes it in, packs layouts, collates its own replica, ms", 1e3 * t0_side)
        add("layouts: bytes sent to the other ranks, KB", sum(int(h[5]) for h, _ in sent) / 1e3)
        add(f"layouts: rank {last} unpacks and collates its own replica, ms", 1e3 * t_other)

    print(f"{cfg.model}, {cfg.stages} stages x {cfg.replicas} replicas, {cfg.global_batch_tokens}-token batches, "
          f"{args.steps} steps, median of {args.repeat} per step; per step over steps: median (p10-p90)")
    for name, values in rows.items():
        q = statistics.quantiles(values, n=10)
        print(f"  {name}: {statistics.median(values):.2f} ({q[0]:.2f}-{q[-1]:.2f})")


if __name__ == "__main__":
    main()
