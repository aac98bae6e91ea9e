"""Names of the aggregators the drivers can select, and how each is built from hyperparameters."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow_federated as tff

_BUILDERS: dict[str, Callable[..., tff.aggregators.WeightedAggregationFactory]] = {
    'mean': lambda **_: tff.aggregators.MeanFactory(),
}
DESCRIPTIONS = {
    'mean': "TFF's weighted mean (plain FedAvg aggregation)",
}
NAMES = tuple(_BUILDERS)


def build(name: str, **hparams) -> tff.aggregators.WeightedAggregationFactory:
  if name not in _BUILDERS:
    raise ValueError(f'unknown aggregator {name!r}; known: {", ".join(NAMES)}')
  return _BUILDERS[name](**hparams)
