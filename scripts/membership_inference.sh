#!/usr/bin/env bash
# Membership inference (GMA paper, App. F): FedAvg with mean vs GMA aggregation on the embedded digits, then a
# logistic-regression attacker on the final models' logits; writes outputs/membership_inference/results.{md,json}.
# Extra arguments go to `python -m training.studies.membership` (e.g. --seeds=0,1 --rounds=20 --model=logistic).
# The defaults (3 seeds, 30 rounds, CNN, label skew: 6 runs) take about 5-10 minutes on 2 cores.
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.studies.membership "$@"
