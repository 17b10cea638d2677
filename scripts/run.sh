#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job: train a small T5 on the built-in offline mixture
# with 2 pipeline stages (torchrun, gloo on CPU), then the same steps with packing from the same
# start, and print the summary (loss, tokens/s, padding efficiency, bubble, speed-up over packing).
# Writes runs/main/{metrics.jsonl,summary.json,timeline.png,timeline.json,checkpoints/}, replacing the
# files of an earlier main job there (--overwrite-output-dir).
# Extra args go to `dynabatch train` (e.g. --steps 100 --model t5-mini).
source "$(dirname "$0")/_setup.sh"
export OMP_NUM_THREADS=1
torchrun --standalone --nproc-per-node 2 -m dynabatch train \
  --stages 2 --steps 30 --compare-method packing --output-dir runs/main --overwrite-output-dir --log-every 10 "$@"
