"""A long sample's attention whole and in token slices, forward + backward, on one CPU thread.

Three ways to run one sample of ``L`` tokens: ``whole`` (one ``is_causal`` SDPA call, the flash kernel skips
the blocks above the diagonal); ``k`` slices with the ``masked`` call (SDPA with the bottom-right
``(s, c + s)`` mask, what slices ran before); ``k`` slices with the ``merged`` calls
(:mod:`dynabatch.models.context_attention`: the context unmasked and the slice's own keys ``is_causal``,
merged by log-sum-exp). Two levels:

* ``core``: the attention core alone, ``(1, heads, L, head_dim)`` queries, keys and values;
* ``model``: a whole model as one stage (embedding, every block, head and loss), the slices run as the
  runtime runs a chain (keys/values carried forward, their gradients carried back).

The three run alternately, ``--repeats`` times each after one warm-up; the table shows medians, the spread
(min-max) and each one's ratio to ``whole``.

    python scripts/bench_slice_attention.py [--lengths 4096,8192] [--slices 2,4] [--model gpt2-d256-8k] \
        [--levels core,model] [--ways whole,masked,merged] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from dynabatch.data.collate import collate_causal
from dynabatch.data.microbatch import token_slices
from dynabatch.data.sample import TokenizedSample
from dynabatch.model_presets import build_model
from dynabatch.models import context_attention
from dynabatch.models.presets import PAD_ID
from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for

WAYS = ("whole", "masked", "merged")


def _bounds(length: int, k: int) -> list[int]:
    return [round(i * length / k) for i in range(k + 1)]


def _core_runs(length: int, k: int, heads: int, head_dim: int):
    q, key, v = (torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3))

    def whole():
        F.scaled_dot_product_attention(q, key, v, is_causal=True).sum().backward()

    def sliced(merged: bool):
        def run():
            b = _bounds(length, k)
            for lo, hi in zip(b[:-1], b[1:]):
                qs, ks, vs = q[:, :, lo:hi], key[:, :, :hi], v[:, :, :hi]
                if merged and lo:
                    out = context_attention.context_causal_attention(qs, ks, vs, lo)
                else:
                    mask = torch.ones(hi - lo, hi, dtype=torch.bool).tril(lo)
                    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                out.sum().backward()
        return run

    return {"whole": whole, "masked": sliced(False), "merged": sliced(True)}


def _model_runs(length: int, k: int, preset: str):
    model = build_model(preset, vocab_size=32128, dropout=0.0, seed=0).train()
    layout = layout_for(model, 1)
    spec, stage = pipeline_spec_for(model, layout), build_stage(model, layout, 0, "segments")
    rng = np.random.default_rng(0)
    sample = TokenizedSample("t", rng.integers(3, 500, length - 1).astype(np.int32),
                             rng.integers(3, 500, 1).astype(np.int32))
    mb = collate_causal([sample], [[0]], pad_id=PAD_ID)

    def whole():
        stage.zero_grad(set_to_none=True)
        stage({}, micro_batch_inputs(mb, spec, 0)).loss_sum.backward()

    def sliced(merged: bool):
        def run():
            stage.zero_grad(set_to_none=True)
            applies = context_attention.applies
            if not merged:
                context_attention.applies = lambda *a: False
            try:
                outs, context = [], None
                for piece in token_slices(mb, _bounds(mb.shape[1], k)):
                    out = stage({}, micro_batch_inputs(piece, spec, 0), context, sliced=True)
                    context = out.slice_record.extend()
                    outs.append(out)
                carried = None
                for out in reversed(outs):
                    extra, grads = out.slice_record.backward_roots(carried)
                    torch.autograd.backward([out.loss_sum, *extra], [None, *grads])
                    carried = out.slice_record.context_grads(carried)
            finally:
                context_attention.applies = applies
        return run

    return {"whole": whole, "masked": sliced(False), "merged": sliced(True)}


def _time(runs: dict, repeats: int) -> dict[str, list[float]]:
    for fn in runs.values():  # warm-up
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():  # interleaved
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--slices", default="2,4")
    p.add_argument("--model", default="gpt2-d256-8k")
    p.add_argument("--levels", default="core,model")
    p.add_argument("--ways", default=",".join(WAYS), help="which of whole, masked, merged to run (whole always runs)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ways = ("whole",) + tuple(w for w in WAYS[1:] if w in args.ways.split(","))
    rows = []
    print(f"{'level':<6} {'L':>6} {'k':>3}  " + "  ".join(f"{w + ' s (min-max)':>24}" for w in ways)
          + "  " + " ".join(f"{w}/whole" for w in ways[1:]))
    for level in args.levels.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            for k in (int(x) for x in args.slices.split(",")):
                runs = (_core_runs(length, k, args.heads, args.head_dim) if level == "core"
                        else _model_runs(length, k, args.model))
                times = _time({w: runs[w] for w in ways}, args.repeats)
                med = {w: statistics.median(times[w]) for w in ways}
                cells = "  ".join(f"{med[w]:>8.3f} ({min(times[w]):.3f}-{max(times[w]):.3f})" for w in ways)
                print(f"{level:<6} {length:>6} {k:>3}  {cells}  "
                      + " ".join(f"{med[w] / med['whole']:>12.2f}" for w in ways[1:]), flush=True)
                rows.append({"level": level, "length": length, "slices": k, "times_s": times,
                             "median_s": med})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "heads": args.heads, "head_dim": args.head_dim,
                       "threads": args.threads, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
