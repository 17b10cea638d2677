"""Padding-free (per-segment) attention against the dense 4-D mask, forward + backward, on real stages.

For each model (a whole model as one stage: embedding, every block, head and loss) and each packed-row
pattern (``32x64``: one 2048-token row of 32 samples of 64 tokens; ``4x512``; ``1x2048``; ``sorted8``: 8
rows of one sample each, 200-256 tokens, padded to the longest: a dynamic micro-batch), the two stage
builds (``attention="dense"`` and ``"segments"``) run forward + backward alternately, ``--repeats`` times
each after one warm-up; the table shows medians, the spread (min-max over the repeats) and the ratio
segments / dense of the medians. T5 samples split 3:1 into inputs and targets.

    python scripts/bench_attention.py [--models gpt2-d256,llama-d256,t5-d256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.sample import TokenizedSample
from dynabatch.model_presets import build_model
from dynabatch.models.presets import PAD_ID
from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for
from dynabatch.core.sequence import is_seq2seq

PATTERNS = {"32x64": [[64] * 32], "4x512": [[512] * 4], "1x2048": [[2048]],
            "sorted8": [[n] for n in (256, 250, 242, 236, 228, 220, 212, 200)]}


def _micro_batch(seq2seq: bool, rows: list[list[int]], vocab: int):
    rng = np.random.default_rng(0)
    samples, index_rows = [], []
    for row in rows:
        index_rows.append([])
        for n in row:
            n_in = max(1, 3 * n // 4) if seq2seq else n // 2
            ids = rng.integers(3, vocab, n).astype(np.int32)
            samples.append(TokenizedSample("t", ids[:n_in], ids[n_in:]))
            index_rows[-1].append(len(samples) - 1)
    if seq2seq:
        return collate_seq2seq(samples, index_rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
    return collate_causal(samples, index_rows, pad_id=PAD_ID)


def _step(stage, loaded) -> float:
    stage.zero_grad(set_to_none=True)
    start = time.perf_counter()
    stage({}, loaded).loss_sum.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-d256,llama-d256,t5-d256")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    print(f"{'model':<12} {'pattern':<8} {'dense s':>9} {'(spread)':>15} {'segments s':>11} {'(spread)':>15} {'ratio':>6}")
    for name in args.models.split(","):
        model = build_model(name, dropout=0.0, seed=0).train()
        layout = layout_for(model, 1)
        spec = pipeline_spec_for(model, layout)
        stages = {path: build_stage(model, layout, 0, path) for path in ("dense", "segments")}
        seq2seq = is_seq2seq(spec.family)
        for pattern in args.patterns.split(","):
            loaded = micro_batch_inputs(_micro_batch(seq2seq, PATTERNS[pattern], model.config.vocab_size), spec, 0)
            times = {path: [] for path in stages}
            for path, stage in stages.items():
                _step(stage, loaded)  # warm-up
            for _ in range(args.repeats):
                for path, stage in stages.items():  # interleaved
                    times[path].append(_step(stage, loaded))
            med = {p: statistics.median(t) for p, t in times.items()}
            ratio = med["segments"] / med["dense"]
            print(f"{name:<12} {pattern:<8} {med['dense']:9.3f} ({min(times['dense']):.3f}-{max(times['dense']):.3f}) "
                  f"{med['segments']:11.3f} ({min(times['segments']):.3f}-{max(times['segments']):.3f}) {ratio:6.2f}",
                  flush=True)
            results.append({"model": name, "pattern": pattern, "dense_s": med["dense"], "segments_s": med["segments"],
                            "ratio": ratio})
    print(json.dumps({"repeats": args.repeats, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
