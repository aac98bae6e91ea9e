"""The benchmark: `python -m training.bench` (`cli`), its sections (`sections`) and timing tools (`timing`)."""
