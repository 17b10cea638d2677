"""What glibc's handling of freed memory costs a CPU training step: one sample's forward and backward, with the
C library's default allocator settings and with freed memory kept in the process.

On CPU, torch takes every tensor's memory from the C library's ``malloc``. glibc serves a request above its mmap
threshold (128 KiB, adjusted up to 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when the tensor
is freed, so the next step's tensors of the same size are new pages again: the kernel faults in and zeroes every
page on first touch. A long sample's activations and attention scores are gigabytes a step. With
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...`` every allocation comes from the heap and
freed memory stays there for the next step: no faults, at the price of a larger resident set (the heap cannot
give back what sits under live blocks).

Each setting runs in its own process (the tunables are read at start), the settings alternate ``--repeats`` times,
each process runs ``--steps`` forward-and-backward passes of one random sample of ``--length`` tokens (T5: and 256
target tokens) on one thread, and reports the median step after the first; the table gives the median over the
repeats, the minor page faults and system time of a step, and the peak resident set.

    python scripts/bench_cpu_allocator.py --model t5-d256 --length 4096
    python scripts/bench_cpu_allocator.py --model gpt2-d256-8k --length 8192

The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

KEEP = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
"""Every allocation from the heap (no mmap), and the heap trimmed only above 16 GiB free."""

SETTINGS = {"default": None, "keep": KEEP}


def one_process(model_name: str, length: int, steps: int) -> dict:
    """Forward and backward of one sample ``steps`` times in this process: each step's seconds, minor faults, system
    seconds, and the peak resident set."""
    import resource
    import time

    import torch

    from dynabatch.model_presets import build_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model(model_name, vocab_size=384)
    seq2seq = model.config.is_encoder_decoder
    ids = torch.randint(3, 300, (1, length))
    labels = torch.randint(3, 300, (1, 256)) if seq2seq else ids
    out = {"step_s": [], "minor_faults": [], "sys_s": []}
    for _ in range(steps):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        kwargs = {} if seq2seq else {"use_cache": False}
        model(input_ids=ids, labels=labels, **kwargs).loss.backward()
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        out["step_s"].append(seconds)
        out["minor_faults"].append(after.ru_minflt - before.ru_minflt)
        out["sys_s"].append(after.ru_stime - before.ru_stime)
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="t5-d256")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_process(a.model, a.length, a.steps)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(a.repeats):
        for name, tunables in SETTINGS.items():  # alternating, so both see the same background load
            env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
            if tunables:
                env["GLIBC_TUNABLES"] = tunables
            cmd = [sys.executable, __file__, "--child", "--model", a.model, "--length", str(a.length),
                   "--steps", str(a.steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {}
    print(f"{a.model}, one sample of {a.length} tokens, forward + backward, 1 thread; {a.repeats} processes per "
          f"setting, {a.steps - 1} steps each after the first")
    print(f"{'setting':<8} {'step s (median)':>16} {'per process':>24} {'faults/step':>12} {'sys s/step':>11} "
          f"{'max RSS MiB':>12}")
    for name, rs in runs.items():
        per = [float(np.median(r["step_s"][1:])) for r in rs]
        faults = float(np.median([f for r in rs for f in r["minor_faults"][1:]]))
        sys_s = float(np.median([s for r in rs for s in r["sys_s"][1:]]))
        rss = float(np.median([r["max_rss_mib"] for r in rs]))
        summary[name] = {"step_s_median": float(np.median(per)), "step_s_per_process": per,
                         "minor_faults_per_step": faults, "sys_s_per_step": sys_s, "max_rss_mib": rss}
        print(f"{name:<8} {np.median(per):>16.3f} {' / '.join(f'{x:.2f}' for x in per):>24} {faults:>12.0f} "
              f"{sys_s:>11.2f} {rss:>12.0f}")
    ratio = summary["default"]["step_s_median"] / summary["keep"]["step_s_median"]
    print(f"keep / default: {ratio:.2f}x faster, {summary['keep']['max_rss_mib'] / summary['default']['max_rss_mib']:.2f}x "
          "the resident set")
    print(json.dumps({"model": a.model, "length": a.length, "steps": a.steps, "repeats": a.repeats, "tunables": KEEP,
                      "speedup": ratio, **summary}))


if __name__ == "__main__":
    main()
