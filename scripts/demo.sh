#!/usr/bin/env bash
# The demo: FedAvg on the embedded digits with plain averaging and every aggregator of tff_gma.
# Sets up .venv first if needed. Extra arguments go to `python -m training.demo` (e.g. --rounds=10).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.demo "$@"
