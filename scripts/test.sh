#!/usr/bin/env bash
# Runs the whole test suite (sets up .venv first if needed). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"  # C++ logs (incl. CUDA-plugin noise); Python errors still raise
export PYTHONUNBUFFERED=1
exec "$root/.venv/bin/python" -m pytest "$@"
