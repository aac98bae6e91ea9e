#!/usr/bin/env bash
# Runs `python -m MODULE ARGS...` from the repo root in .venv (set up first if needed): the one launcher the other
# scripts/*.sh wrap. Usage: scripts/run_module.sh MODULE [ARGS...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[[ $# -ge 1 ]] || { echo "usage: scripts/run_module.sh MODULE [ARGS...]" >&2; exit 2; }
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"  # C++ logs (incl. CUDA-plugin noise); Python errors still raise
export PYTHONUNBUFFERED=1
exec "$root/.venv/bin/python" -m "$@"
