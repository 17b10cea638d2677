"""Where T5's time goes against packing_free: the same samples in three micro-batch layouts, stage by stage.

One global batch (``--lengths``, ``--tokens`` real tokens, random ids of exactly those lengths) is cut into the
same number of micro-batches three ways, and each micro-batch runs forward + backward through the stages of a
``--stages`` split in one process (each stage's time measured alone, one thread, as one pipeline rank runs):

* ``packing_free``: best-fit-decreasing rows of ``--max-input-len`` / ``--max-target-len`` (TRL's ``bfd``, the
  baseline's own :func:`~dynabatch.data.baselines.pack_rows`), one row per micro-batch;
* ``flat``: the samples sorted by input length, cut into runs of equal real tokens, each run one row of its
  samples back to back (``--pack-rows flat``'s layout);
* ``padded``: the same runs, one sample per row padded to the run's longest (``--pack-rows off``'s layout).

All three compute exactly the real tokens' attention (padding-free attention); only ``padded`` computes pad in
the other layers. Medians over ``--repeats`` interleaved rounds, per stage.

    python scripts/bench_row_layouts.py [--model t5-d256] [--lengths data/heavy_tail_1024.npz] [--seeds 0,1,2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dynabatch.commands.common import write_json
from dynabatch.data.baselines import pack_rows
from dynabatch.data.batching import LengthLimits
from dynabatch.data.collate import collate_seq2seq
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.model_presets import build_model
from dynabatch.models.presets import PAD_ID
from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for
from dynabatch.training.workload import load_lengths


def global_batch(path: str, tokens: int, limits: LengthLimits, vocab: int, seed: int) -> GlobalBatch:
    """Samples drawn at random from the lengths file, truncated to the limits, until ``tokens`` real tokens."""
    lengths = load_lengths(path)
    rng = np.random.default_rng(seed)
    e_all = np.minimum(lengths.input_len, limits.max_input_len)
    d_all = np.minimum(lengths.target_len, limits.max_target_len)
    samples, total = [], 0
    for i in rng.permutation(len(e_all)):
        if total + e_all[i] + d_all[i] > tokens:
            break
        ids = rng.integers(3, vocab, e_all[i] + d_all[i]).astype(np.int32)
        samples.append(TokenizedSample("t", ids[: e_all[i]], ids[e_all[i]:]))
        total += int(e_all[i] + d_all[i])
    return GlobalBatch(seed, tuple(samples))


def layouts(batch: GlobalBatch, limits: LengthLimits) -> dict[str, list[list[list[int]]]]:
    """Micro-batches (lists of rows of sample indices) of each layout, as many in each as BFD makes rows."""
    e, d = np.asarray(batch.input_lens), np.asarray(batch.target_lens)
    longest_first = (lambda i: (-(e[i] / limits.max_input_len + d[i] / limits.max_target_len), i))
    bfd = pack_rows(batch, limits, longest_first)
    by_length = np.argsort(e, kind="stable")
    tokens = np.cumsum(e[by_length] + d[by_length])
    cuts = np.searchsorted(tokens, np.arange(1, len(bfd)) * tokens[-1] / len(bfd))
    runs = [run.tolist() for run in np.split(by_length, cuts)]
    return {"packing_free": [[row] for row in bfd], "flat": [[run] for run in runs],
            "padded": [[[i] for i in run] for run in runs]}


def stage_times(stages, spec, batch: GlobalBatch, micro_batches) -> list[float]:
    """Forward + backward seconds of every stage over the micro-batches (the next stage gets detached copies of
    what the previous one sends, and the previous one a gradient of ones)."""
    out = [0.0] * len(stages)
    for rows in micro_batches:
        mb = collate_seq2seq(batch.samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
        received = {}
        for s, stage in enumerate(stages):
            loaded = micro_batch_inputs(mb, spec, s)
            stage.zero_grad(set_to_none=True)
            start = time.perf_counter()
            result = stage(received, loaded)
            if s == len(stages) - 1:
                result.loss_sum.backward()
            else:
                sends = list(result.sends.values())
                torch.autograd.backward(sends, [torch.ones_like(t) for t in sends])
            out[s] += time.perf_counter() - start
            received = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in result.sends.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5-d256")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--lengths", default="data/heavy_tail_1024.npz")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-target-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seeds", default="0,1,2", help="one global batch per seed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the results (stdout's last line) to PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, dropout=0.0, seed=0).train()
    layout = layout_for(model, args.stages)
    spec = pipeline_spec_for(model, layout)
    stages = [build_stage(model, layout, s, "segments") for s in range(args.stages)]
    limits = LengthLimits("t5", max_input_len=args.max_input_len, max_target_len=args.max_target_len)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        batch = global_batch(args.lengths, args.tokens, limits, model.config.vocab_size, seed)
        cands = layouts(batch, limits)
        for mbs in cands.values():
            stage_times(stages, spec, batch, mbs)  # warm-up
        times = {name: [] for name in cands}
        for _ in range(args.repeats):
            for name, mbs in cands.items():  # interleaved
                times[name].append(stage_times(stages, spec, batch, mbs))
        med = {name: np.median(np.array(t), axis=0).tolist() for name, t in times.items()}
        spread = {name: (np.array(t).sum(axis=1).min(), np.array(t).sum(axis=1).max()) for name, t in times.items()}
        for name in cands:
            print(f"seed {seed} {len(batch)} samples {len(cands[name])} micro-batches {name:<13} per stage "
                  + " / ".join(f"{x:.3f}" for x in med[name])
                  + f" s (total {sum(med[name]):.3f}, {spread[name][0]:.3f}-{spread[name][1]:.3f}; "
                  f"{sum(med[name]) / sum(med['packing_free']):.3f}x packing_free)", flush=True)
        results.append({"seed": seed, "samples": len(batch), "micro_batches": len(cands["flat"]), "stage_s": med})
    summary = {"model": args.model, "stages": args.stages, "lengths": args.lengths, "repeats": args.repeats,
               "results": results}
    print(json.dumps(summary))
    if args.json:
        write_json(summary, args.json)


if __name__ == "__main__":
    main()
