"""The benchmark: `python -m training.bench` (`cli`), what a run measures (`presets`), its entries (`candidates`), its
sections (`sections`, `small_rounds`, `runner_runs`), the in-graph floor (`floor`) and timing tools (`timing`)."""
