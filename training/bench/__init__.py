"""The benchmark: aggregator overhead, client scaling and round cost in TFF's runtime, as ratios in one process.

`python -m training.bench` (`cli`), what a run measures (`presets`), its entries (`candidates`), its sections
(`sections`, `small_rounds`, `runner_runs`), the in-graph floor (`floor`) and timing tools (`timing`).
Sections, keys and method: docs/research/benchmark.md#sections-keys-and-method"""
