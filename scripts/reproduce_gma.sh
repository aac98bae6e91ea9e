#!/usr/bin/env bash
# The GMA study (training/studies/gma.py): AVG vs GMA for FedAvg/FedProx/FedAdam/FedYogi on the embedded digits,
# tuned on a validation split, final runs over 4 seeds; writes outputs/gma_study/results.{md,json,png}. Extra
# arguments go to `python -m training.studies.gma` (e.g. --shard=0/2 and --shard=1/2 side by side, then once
# without --shard to collect). The full study takes hours (budget in the module docstring).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.studies.gma "$@"
