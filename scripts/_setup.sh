# Shared set-up for run.sh and test.sh (sourced, not executed).
# Creates .venv if missing and installs the project into it. Torch goes first:
# an importable torch (in .venv or the calling Python) is kept; otherwise
# torch==2.13.0 is installed from pip's index (a CPU wheel where the index or
# --find-links holds one; on Linux, PyPI alone gives the multi-GB CUDA build:
# install the CPU wheel into the calling Python first, README "Install").
# A stamp file makes the second run fast.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    # Reuse the torch the user already has.
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
VPY="$ROOT/.venv/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0"
fi
STAMP=".venv/.dynabatch-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VPY" -m pip install -q -e ".[dev]"
  touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
# numba caches compiled kernels next to the source; keep them in a writable place.
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$ROOT/.cache/numba}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# Huge pages for large CPU tensors (see docs/algorithms/cost_model.md); torch reads it at import.
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
