#!/usr/bin/env bash
# The RFA robustness study on the embedded digits: accuracy against the corruption level rho in {0, 0.1, 0.25, 0.4}
# for data_negate, data_flip_labels, gaussian and omniscient corruption; mean, rfa (3 passes), rfa_one_step, gma
# and the (non-private) median, trimmed_mean, krum, clip_mean, zeroing_mean; linear model and CNN; several seeds.
# Writes outputs/reproduce_rfa/results.{md,json,png}. Extra arguments go to `python -m training.studies.rfa`
# (e.g. --seeds=0 --rounds=8 --models=logistic --aggregators=mean,rfa). The default grid is 702 runs (measured:
# 108 minutes on 2 cores as two processes): run `--shard=0/2` and `--shard=1/2` side by side, then once with
# no --shard to collect the finished cells into one report (docs/research/results.md).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_module.sh" training.studies.rfa "$@"
