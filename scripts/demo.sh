#!/usr/bin/env bash
# The demo: FedAvg on the embedded digits with plain averaging and every aggregator of tff_gma.
# Sets up .venv first if needed. Extra arguments go to `python -m training.demo` (e.g. --rounds=10).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"  # C++ logs (incl. CUDA-plugin noise); Python errors still raise
export PYTHONUNBUFFERED=1
exec "$root/.venv/bin/python" -m training.demo "$@"
