"""Measured against predicted saved activations, per model x dtype x recompute mode x attention path.

Each configuration trains a few steps with ``dynabatch train`` (its own process) and reads metrics.jsonl:
``memory_measured_bytes`` (what autograd kept for backward, the executor's SavedActivationMeter) over
``memory_predicted_bytes`` (the schedule's simulated peak of stored bytes under the planner's analytic model).
A ratio above 1 is memory the planner does not see; the "Activation recomputation" tables of docs/algorithms/runtime.md come from
this script, and scripts/gpu_check.sh runs it on CUDA (``--device cuda --models gpt2-small,t5-small``).

    python scripts/memory_check.py                                   # CPU: tiny GPT-2, T5 and Llama, fp32 + bf16
    python scripts/memory_check.py --dtypes bf16 --recompute none,full --json out.json

``llama`` is a tiny Llama folder built from a config (RMSNorm, grouped-query attention, gated SiLU, rotary).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time


def _llama_folder(root: str, vocab_size: int = 8192) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dynabatch.data.tokenize import load_tokenizer

    path = os.path.join(root, "llama")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer("builtin").save_pretrained(path)
    return path


def _ratios(model: str, dtype: str, recompute: str, attention: str, args, root: str) -> dict:
    out = os.path.join(root, f"run_{abs(hash((model, dtype, recompute, attention)))}")
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", model, "--dtype", dtype, "--recompute", recompute,
           "--attention", attention, "--device", args.device, "--global-batch-tokens", str(args.global_batch_tokens),
           "--max-input-len", str(args.max_input_len), "--max-target-len", str(args.max_input_len // 4),
           "--steps", str(args.steps), "--log-every", "0", "--no-timeline", "--output-dir", out]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    row = {"model": os.path.basename(model), "dtype": dtype, "recompute": recompute, "attention": attention,
           "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {**row, "error": lines[-1][:300] if lines else f"exit {done.returncode}"}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    ratios = [max(m / p for m, p in zip(r["memory_measured_bytes"], r["memory_predicted_bytes"])) for r in records]
    return {**row, "ratios": [round(x, 3) for x in ratios], "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2-tiny,t5-tiny,llama", help="presets, HF folders, or `llama` (a tiny one)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--recompute", default="none,selective,full")
    p.add_argument("--attention", default="segments", help="segments and/or dense")
    p.add_argument("--device", default="auto")
    p.add_argument("--global-batch-tokens", type=int, default=4096)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    split = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as root:
        models = [_llama_folder(root) if m == "llama" else m for m in split(args.models)]
        print(f"{'model':<12} {'dtype':<5} {'recompute':<9} {'attention':<9} measured / predicted")
        for model, dtype, recompute, attention in itertools.product(models, split(args.dtypes), split(args.recompute),
                                                                    split(args.attention)):
            row = _ratios(model, dtype, recompute, attention, args, root)
            rows.append(row)
            shown = row.get("error") or f"{row['min']:.3f}-{row['max']:.3f}  ({row['seconds']} s)"
            print(f"{row['model']:<12} {dtype:<5} {recompute:<9} {attention:<9} {shown}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
