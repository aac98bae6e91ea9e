#!/usr/bin/env bash
# AVG vs GMA for FedAvg/FedProx/FedAdam/FedYogi on the embedded digits (label and feature skew, several seeds):
# writes outputs/reproduce_gma/results.{md,json,png}. Extra arguments go to `python -m training.reproduce_gma`
# (e.g. --seeds=0,1 --rounds=20). About 25 s per run on 2 cores: the default 48 runs take about 20-25 minutes.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.reproduce_gma "$@"
