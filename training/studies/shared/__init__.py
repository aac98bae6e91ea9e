"""What the studies share, so that no study module imports another.

`study_runs` (a run's directory, read back once finished; its metrics; shards; the cost table), `gma_protocol` (the
GMA studies' run cell, flags, convergence and chance rules), `fmnist_protocol` (the Fashion-MNIST studies' grid, edge
rule and archived cells), `intervals` (95% t intervals and their verdicts), `report` (results files and figures) and
`claims_report` (`gma_fmnist_claims`' report, kept apart from that study for its size).
"""
