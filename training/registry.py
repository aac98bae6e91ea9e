"""Names of the aggregators the drivers can select, and how each is built from hyperparameters.

Every builder takes the same keyword arguments (the runner's aggregator flags) and ignores those it has no use
for, so a flagfile can carry all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import tensorflow_federated as tff

from tff_gma import aggregators


@dataclasses.dataclass(frozen=True)
class AggregatorParams:
  tau: float = 0.4  # GMA agreement threshold (paper: 0.4).
  num_passes: int = 3  # RFA secure averages per round (paper: 3).
  smoothing: float = 1e-6  # RFA nu.
  secure: bool = False  # Float sums through secure sums as well (bounded, discretized).
  secure_bound: Optional[float] = None  # Per-coordinate bound for secure float sums (None: the factory's default).


def _mean(p: AggregatorParams):
  if p.secure:
    return aggregators.SecureWeightedMeanFactory(**({} if p.secure_bound is None else {'value_bound': p.secure_bound}))
  return tff.aggregators.MeanFactory()


def _gma(mask: str):
  return lambda p: aggregators.GradientMaskedFactory(
      tau=p.tau, mask=mask, secure=p.secure, value_bound=p.secure_bound)


def _rfa(one_step: bool):
  return lambda p: aggregators.GeometricMedianFactory(
      num_passes=None if one_step else p.num_passes, smoothing=p.smoothing, one_step=one_step, secure=p.secure,
      value_bound=p.secure_bound)


_BUILDERS: dict[str, Callable[[AggregatorParams], tff.aggregators.WeightedAggregationFactory]] = {
    'mean': _mean,
    'gma': _gma('soft'),
    'gma_binary': _gma('binary'),
    'rfa': _rfa(False),
    'rfa_one_step': _rfa(True),
}
DESCRIPTIONS = {
    'mean': 'weighted mean (plain FedAvg aggregation)',
    'gma': 'gradient masked averaging, soft mask (tau)',
    'gma_binary': 'gradient masked averaging, binary AND-mask (tau)',
    'rfa': 'geometric median, smoothed Weiszfeld (num_passes secure averages)',
    'rfa_one_step': 'one-step RFA (a single reweighted secure average)',
}
NAMES = tuple(_BUILDERS)


def build(name: str, params: Optional[AggregatorParams] = None) -> tff.aggregators.WeightedAggregationFactory:
  if name not in _BUILDERS:
    raise ValueError(f'unknown aggregator {name!r}; known: {", ".join(NAMES)}')
  return _BUILDERS[name](params or AggregatorParams())
