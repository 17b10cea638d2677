#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job: train a small T5 on the built-in offline mixture with 2
# pipeline stages (torchrun, gloo on CPU), then the same steps from the same start with `packing_free` at one
# packed row per micro-batch, and print the summary (loss, tokens/s, padding efficiency, bubble, and the speed-up
# of dynamic over packing_free on the same batches).
#
# Why packing_free with 1 row: padding-free packing is the baseline users pick today, and one row per
# micro-batch was its fastest setting in every tuned run on CPU (docs/benchmarks/cpu_matrix/ and
# docs/benchmarks/cpu_tuned_baselines/: `dynabatch bench --tune-baselines` picked 1 row each time); its default of
# 4 rows puts a whole step into one or two micro-batches and leaves a 2-stage pipeline idle half the step.
# --planner process: dynamic plans in a niced child process, off rank 0 (the busiest stage); with a planner thread
# its planning is taken from rank 0 (docs/benchmarks/main_job/).
#
# Writes runs/main/{metrics.jsonl,summary.json,timeline.png,timeline.json,checkpoints/}, replacing the files of an
# earlier main job there (--overwrite-output-dir). On a terminal it shows progress bars; redirected to a file it
# writes plain periodic lines (a 30-step run's log stays well under 100 lines).
# Extra args go to `dynabatch train` (e.g. --max-steps 100 --model t5-mini).
source "$(dirname "$0")/_setup.sh"
export OMP_NUM_THREADS=1
torchrun --standalone --nproc-per-node 2 -m dynabatch train \
  --stages 2 --max-steps 30 --compare-method packing_free --packing-free-rows 1 --planner process \
  --output-dir runs/main --overwrite-output-dir --logging-steps 10 "$@"
