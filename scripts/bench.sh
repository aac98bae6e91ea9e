#!/usr/bin/env bash
# The benchmark: aggregator overhead and client scaling in TFF's runtime, as ratios to the mean in one run, for
# every method of training/engine/registry.py (see `python -m training.bench --help`). Writes outputs/bench/bench.{json,md}.
# Sets up .venv first if needed. Extra arguments go to `python -m training.bench`: --quick (a few minutes),
# --smoke (seconds-sized, for the tests), none for the full benchmark (run it on a quiet machine), --output=PATH,
# --aggregators=mean,gma,rfa+num_passes=5, --profile=rfa, ...
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.bench "$@"
