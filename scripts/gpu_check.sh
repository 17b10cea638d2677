#!/usr/bin/env bash
# The prepared device check for a machine with one GPU (at most about 9.5 minutes: run it with timeout_s 590;
# each part capped, each writes its own log, so a part that fails or overruns loses only itself):
#   1. scripts/gpu_check_kernels.py: varlen / flex / auto against per-segment SDPA (loss, gradients, time)
#   2. scripts/gpu_bench.py: gpt2-small at 2048 on the heavy-tailed lengths file (varlen path), analytic plan
#   M. scripts/memory_check.py: measured / predicted saved activations of gpt2-small and t5-small in bf16 (appended
#      to kernels.log), checking the planner's memory model before part 3 relies on it
#   3. the same under a binding --memory-gib with tuned baselines (issue 16's regime)
#   4. scripts/gpu_bench.py: t5-small at 2048 on the built-in mixture, profile + check + interleaved bench
# The device tool returns at most 8 files: the parts' 4 logs, the gpt/mem/t5 bench JSONs and t5's profile.json
# (so do not also tee this script's output into OUT_DIR; the tool's output_tail has its end).
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# The lent machine has torch and transformers but not `datasets`: carry its wheels in .whl/ (docs/development.md,
# "The GPU check"); they are installed into /tmp/site when present.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false NUMBA_CACHE_DIR=/tmp/numba
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L
python3 -c "import torch, transformers, numba, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__,
'numba', numba.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name())"

# progress bars (\r-separated) stay in the logs only
quiet() { tr '\r' '\n' | grep -v -E "examples/s|it/s\]|s/it\]|examples \[|^ *$"; }

# Each part is skipped when its time limit is 0. The defaults are sized from the H200 runs of 2026-12-04
# (docs/benchmarks/gpu_h200/): a first call with T5 at 131,072 tokens and GPT-2 at 6 steps timed out in both
# benches; KERNELS_S=90 KERNEL_FAMILIES=gpt2,t5 T5_S=0 GPT_S=170 GPT_TOKENS=65536 GPT_STEPS=4
# GPT_METHODS=dynamic,packing_free,token_budget took 101 s for the GPT part; a later run of all four parts
# (KERNELS_S=60: T5 rows only) took 55 s for the GPT part, and T5 with its profile did not reach the bench in
# 180 s (with T5_ARGS=--skip-profile it took 145 s). Since then `dynamic` on CUDA plans with --pack-rows auto
# (the `device` default), so dynamic_flat replaces dynamic_packed.
# Next to measure: part 3 (memory-bound), whose measured saved activations exceeded the prediction by 1.7-2.2x;
# the bf16-autocast terms behind that were since found on CPU (docs/algorithms/runtime.md, "Activation
# recomputation"), and part M checks them on the GPU first. Defaults sum to 580 s.
if [ "${KERNELS_S:-50}" != 0 ]; then
  timeout -k 5 "${KERNELS_S:-50}" python3 scripts/gpu_check_kernels.py --repeats 3 --families "${KERNEL_FAMILIES:-t5,llama}" \
    --dtypes "${KERNEL_DTYPES:-bf16}" \
    2>&1 | tee "$out/kernels.log" | quiet
  echo "kernels: rc ${PIPESTATUS[0]}"
fi
if [ "${GPT_S:-140}" != 0 ]; then
  timeout -k 5 "${GPT_S:-140}" python3 scripts/gpu_bench.py --model gpt2-small --skip-profile --steps "${GPT_STEPS:-4}" \
    --global-batch-tokens "${GPT_TOKENS:-65536}" --lengths data/heavy_tail_2048.npz \
    --methods "${GPT_METHODS:-dynamic,dynamic_plan_calibrated,dynamic_flat,packing_free,token_budget}" --out "$out/gpt" 2>&1 \
    | tee "$out/gpt.log" | quiet
  echo "gpt bench: rc ${PIPESTATUS[0]}"
fi
if [ "${MEMCHK_S:-60}" != 0 ]; then  # the bf16 memory terms, so far measured on CPU autocast only
  timeout -k 5 "${MEMCHK_S:-60}" python3 scripts/memory_check.py --device cuda --models "${MEMCHK_MODELS:-gpt2-small,t5-small}" \
    --dtypes bf16 --recompute "${MEMCHK_RECOMPUTE:-none,full}" --global-batch-tokens 16384 --max-input-len 1024 \
    2>&1 | tee -a "$out/kernels.log" | quiet
  echo "memory check: rc ${PIPESTATUS[0]}"
fi
if [ "${MEM_S:-150}" != 0 ]; then  # issue 16: a binding memory limit; every baseline at its best knob that fits
  timeout -k 5 "${MEM_S:-150}" python3 scripts/gpu_bench.py --model gpt2-small --skip-profile --steps "${MEM_STEPS:-3}" \
    --global-batch-tokens 65536 --lengths data/heavy_tail_2048.npz --memory-gib "${MEM_GIB:-8}" --tune-baselines \
    --token-budget-tokens 4096 --packing-free-rows 2 --samples-per-micro-batch 2 \
    --methods "${MEM_METHODS:-dynamic,dynamic_flat,packing_free,token_budget}" --out "$out/mem" 2>&1 \
    | tee "$out/mem.log" | quiet
  echo "memory-bound bench: rc ${PIPESTATUS[0]}"
fi
if [ "${T5_S:-180}" != 0 ]; then
  # shellcheck disable=SC2086  # T5_ARGS: extra flags, e.g. --skip-profile (the profile took 73 s on the H200)
  timeout -k 5 "${T5_S:-180}" python3 scripts/gpu_bench.py --steps "${T5_STEPS:-4}" --global-batch-tokens "${T5_TOKENS:-65536}" ${T5_ARGS:---skip-profile} \
    --methods "${T5_METHODS:-dynamic,dynamic_flat,packing_free,token_budget}" --out "$out/t5" 2>&1 | tee "$out/t5.log" | quiet
  echo "t5 bench: rc ${PIPESTATUS[0]}"
  rm -f "$out/t5/profile_check.json"  # its table is in t5.log; the device tool returns at most 8 files
fi
