"""Names of the aggregators the drivers can select, and how each is built from hyperparameters.

Every builder takes the same keyword arguments (the runner's aggregator flags) and ignores those it has no use
for, so a flagfile can carry all of them.

The baselines of the RFA robustness study (`NON_PRIVATE`: `median`, `trimmed_mean`, `krum` collect every client's
update at the server, see `tff_gma.aggregators.robust_baselines`; they refuse `secure=True`) and TFF's own norm
clipping/zeroing in front of TFF's weighted mean (`clip_mean`, `zeroing_mean`). `trimmed_mean` and `krum` are
told the corruption level (`corrupt_fraction`), as in the RFA paper.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma.aggregators import geometric_median
from tff_gma.aggregators import gradient_masked
from tff_gma.aggregators import robust_baselines


@dataclasses.dataclass(frozen=True)
class AggregatorParams:
  tau: float = gradient_masked.DEFAULT_TAU  # GMA agreement threshold.
  num_passes: int = geometric_median.DEFAULT_NUM_PASSES  # RFA secure averages per round.
  smoothing: float = geometric_median.DEFAULT_SMOOTHING  # RFA nu.
  rfa_init: str = geometric_median.DEFAULT_INIT  # Where RFA's Weiszfeld starts: 'mean' or 'zero'.
  secure: bool = False  # Float sums through secure sums as well (bounded, discretized).
  secure_bound: Optional[float] = None  # Per-coordinate bound for secure float sums (None: the factory's default).
  corrupt_fraction: float = 0.0  # The corruption level rho, known to trimmed_mean and krum.


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
      value_bound=p.secure_bound, init=None if one_step else p.rfa_init)


def _non_private(build: Callable[[AggregatorParams], tff.aggregators.WeightedAggregationFactory], name: str):
  def builder(p: AggregatorParams):
    if p.secure:
      raise ValueError(f'secure: aggregator {name!r} needs every client update at the server and cannot run with '
                       f'secure=True')
    return build(p)
  return builder


# TFF's adaptive norm bounds (`tff.aggregators.PrivateQuantileEstimationProcess.no_noise`, no noise added):
# clipping at an estimate of the median update norm; zeroing above an estimate of the 0.98 quantile (TFF's
# `tff.learning.robust_aggregator` defaults), so that neither needs the corruption level.
def _clip_mean(p: AggregatorParams):
  del p
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=1.0, target_quantile=0.5, learning_rate=0.2)
  return tff.aggregators.clipping_factory(norm, tff.aggregators.MeanFactory())


def _zeroing_mean(p: AggregatorParams):
  del p
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=10.0, target_quantile=0.98, learning_rate=math.log(10.0), multiplier=2.0, increment=1.0)
  return tff.aggregators.zeroing_factory(norm, tff.aggregators.MeanFactory())


_BUILDERS: dict[str, Callable[[AggregatorParams], tff.aggregators.WeightedAggregationFactory]] = {
    'mean': _mean,
    'gma': _gma('soft'),
    'gma_binary': _gma('binary'),
    'rfa': _rfa(False),
    'rfa_one_step': _rfa(True),
    'median': _non_private(lambda p: robust_baselines.CoordinateMedianFactory(), 'median'),
    'trimmed_mean': _non_private(lambda p: robust_baselines.TrimmedMeanFactory(p.corrupt_fraction), 'trimmed_mean'),
    'krum': _non_private(lambda p: robust_baselines.MultiKrumFactory(p.corrupt_fraction), 'krum'),
    'clip_mean': _clip_mean,
    'zeroing_mean': _zeroing_mean,
}
DESCRIPTIONS = {
    'mean': 'weighted mean (plain FedAvg aggregation)',
    'gma': 'gradient masked averaging, soft mask (tau)',
    'gma_binary': 'gradient masked averaging, binary AND-mask (tau)',
    'rfa': 'geometric median, smoothed Weiszfeld (num_passes secure averages)',
    'rfa_one_step': 'one-step RFA (a single reweighted secure average)',
    'median': 'coordinate-wise median (NOT private: every update at the server)',
    'trimmed_mean': 'coordinate-wise trimmed mean, trimming corrupt_fraction per side (NOT private)',
    'krum': 'multi-Krum with f = corrupt_fraction * n, averaging n - f (NOT private)',
    'clip_mean': "TFF's norm clipping at an adaptive median norm, then the weighted mean",
    'zeroing_mean': "TFF's zeroing of updates above an adaptive 0.98-quantile norm, then the weighted mean",
}
NAMES = tuple(_BUILDERS)
NON_PRIVATE = ('median', 'trimmed_mean', 'krum')


def build(name: str, params: Optional[AggregatorParams] = None) -> tff.aggregators.WeightedAggregationFactory:
  if name not in _BUILDERS:
    raise ValueError(f'unknown aggregator {name!r}; known: {", ".join(NAMES)}')
  return _BUILDERS[name](params or AggregatorParams())
