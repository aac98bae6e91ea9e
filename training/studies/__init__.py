"""The studies: GMA (`gma`, `gma_fmnist`, `gma_fmnist_claims`), RFA (`rfa`, `rfa_spread`), membership inference
(`membership`); what they share is in `training.studies.shared`."""
