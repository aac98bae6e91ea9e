"""The studies: each a program that runs a paper's experiment as many runs of the runner and reports it.

GMA (`gma`, `gma_fmnist`, `gma_fmnist_claims`), RFA (`rfa`, `rfa_spread`), membership inference (`membership`);
what they share is in `training.studies.shared`. Commands and results: docs/experiments.md#the-studies"""
