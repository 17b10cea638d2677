"""Padding-free attention kernels on one device: each against per-segment SDPA, loss, gradients and time.

    python scripts/gpu_check_kernels.py                 # CUDA: sdpa / varlen / flex / auto, bf16 and fp32, fwd + bwd
    python scripts/gpu_check_kernels.py --device cpu    # CPU: flex forward only (the CUDA kernels cannot run here)

For GPT-2, Llama (GQA) and T5 stages (one stage = the whole small model) on a packed, a padded and (causal
models) a token-sliced micro-batch of heavy-tailed lengths, each kernel of
:mod:`dynabatch.models.attention_kernels` runs the same micro-batch; the script prints, per family, layout,
dtype and kernel, which kernels served the calls, the loss's and the gradients' largest relative
difference from ``sdpa``, and the median forward + backward time over ``--repeats``. It ends with one JSON
line. ``tests/unit/models/test_attention_kernels.py`` checks the same on CPU (flex forward, varlen's packing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "unit")]  # the small family configs the tests use


def _samples(rng, num: int, causal: bool):
    import numpy as np

    from dynabatch.data.sample import TokenizedSample

    lengths = np.minimum(rng.lognormal(4.0, 0.9, num).astype(int) + 4, 400)  # most short, a few long
    return [TokenizedSample("t", rng.integers(3, 500, n).astype(np.int32),
                            rng.integers(3, 500, max(2, n // (8 if causal else 4))).astype(np.int32)) for n in lengths]


def _micro_batch(family: str, layout: str, rng):
    from dynabatch.data.collate import collate_causal, collate_seq2seq
    from dynabatch.models.presets import PAD_ID

    samples = _samples(rng, 12, family != "t5")
    rows = [list(range(i, i + 4)) for i in range(0, 12, 4)] if layout == "packed" else [[i] for i in range(12)]
    if family == "t5":
        return collate_seq2seq(samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
    return collate_causal(samples, rows, pad_id=PAD_ID)


def _run(stage, spec, mb, sliced: bool, grad: bool):
    from dynabatch.data.microbatch import token_slices
    from dynabatch.models.split import micro_batch_inputs

    stage.zero_grad(set_to_none=True)
    if not sliced:
        out = stage({}, micro_batch_inputs(mb, spec, 0))
        if grad:
            out.loss_sum.backward()
        return out.loss_sum.detach().float()
    width = mb.shape[1]
    outs, context = [], None
    for piece in token_slices(mb, [0, width // 4, width // 2, width]):
        out = stage({}, micro_batch_inputs(piece, spec, 0), context, sliced=True)
        context = out.slice_record.extend()
        outs.append(out)
    if grad:
        carried = None
        for out in reversed(outs):
            extra, grads = out.slice_record.backward_roots(carried)
            import torch

            torch.autograd.backward([out.loss_sum, *extra], [None, *grads])
            carried = out.slice_record.context_grads(carried)
    return sum(o.loss_sum.detach().float() for o in outs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--families", default="t5,llama,gpt2", help="in this order (the first GPU run covered gpt2 only: "
                   "every new flex shape compiles, about 10 s each)")
    p.add_argument("--dtypes", default=None, help="CUDA: bf16,fp32 (default); CPU: fp32")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from dynabatch.models import attention_kernels as ak
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
    from test_attention import MODELS

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    kernels = ("sdpa", "varlen", "flex", "auto") if cuda else ("sdpa", "flex")
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else (("bf16", "fp32") if cuda else ("fp32",))
    results = []
    for family in args.families.split(","):
        model = MODELS[family]()
        layout = layout_for(model, 1)
        spec = pipeline_spec_for(model, layout)
        stage = build_stage(model, layout, 0, "segments").to(device)
        for shape in ("packed", "padded") + (("sliced",) if family != "t5" else ()):
            mb = _micro_batch(family, "packed" if shape == "sliced" else shape, np.random.default_rng(0))
            for dtype in dtypes:
                autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16"
                            else contextlib.nullcontext())
                reference = None
                for name in kernels:
                    ak.use_attention_kernel(name)
                    times = []
                    for _ in range(args.repeats):
                        before = ak.KERNEL_CALLS.copy()
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        with autocast, torch.set_grad_enabled(cuda):
                            loss = _run(stage, spec, mb, shape == "sliced", grad=cuda)
                        if cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                    grads = {n: q.grad.float().clone() for n, q in stage.named_parameters() if q.grad is not None}
                    row = {"family": family, "shape": shape, "dtype": dtype, "kernel": name,
                           "served_by": ak.calls_since(before), "median_s": statistics.median(times)}
                    if reference is None:
                        reference = (loss, grads)
                    else:
                        row["loss_rel_diff"] = float((loss - reference[0]).abs() / reference[0].abs())
                        row["grad_rel_diff"] = max((float((g - reference[1][n]).norm() / reference[1][n].norm().clamp_min(1e-12))
                                                    for n, g in grads.items()), default=None)
                    results.append(row)
                    print(f"{family:5s} {shape:6s} {dtype} {name:6s} served by {row['served_by']}  "
                          f"{row['median_s'] * 1e3:8.2f} ms  loss diff {row.get('loss_rel_diff', 0):.2e}  "
                          f"grad diff {row.get('grad_rel_diff') or 0:.2e}", flush=True)
    ak.use_attention_kernel("auto")
    print(json.dumps({"device": str(device), "torch": torch.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
