"""Where this library's factories do not compose with TFF's, and the refusal that says so.

Differential privacy. `tff.aggregators.DifferentiallyPrivateFactory(query, record_aggregation_factory=...)`
clips each client value into a record (`query.preprocess_record`), hands the records to
`record_aggregation_factory`, and adds noise to what comes back (`query.get_noised_result`), calibrated to the
sensitivity of a *sum* of clipped records (the Gaussian query then divides by the expected number of clients).
TFF checks only that the factory is unweighted: a mean has the same type as a sum. This library's unweighted
factories return means (GMA: the mask times the mean, RFA: a geometric median, `as_unweighted`: a weighted
mean), so in that slot the process runs and returns a wrong result, with no warning: with `noise_multiplier=0`
and 3 clients, `UnweightedGradientMaskedFactory(tau=0)` gives a third of the mean the default `SumFactory` gives
(the mean is divided by the number of clients twice), and the noise is calibrated to a quantity it is not added
to. Nor would a correct sum make GMA or RFA private: GMA's sign votes (per-coordinate counts of the clients'
signs, with the number of voters) and RFA's Weiszfeld weights (each client's `1 / ||v - w_i||`, a function of its
unclipped distance, that decides how much its update counts in every pass), and the objectives and counts both
report, would reach the server with no noise.

So this library supports no composition of GMA or RFA with differential privacy. Its unweighted factories refuse,
at `create`, to be a slot that TFF treats as a sum:

* `DifferentiallyPrivateFactory`'s `record_aggregation_factory` (also reached through the classmethods
  `tree_aggregation`, ..., and TFF's `PrivateQuantileEstimationProcess`, which build one);
* `MeanFactory`'s `value_sum_factory` / `weight_sum_factory` and `UnweightedMeanFactory`'s `value_sum_factory` /
  `count_sum_factory` (`MeanFactory` divides a sum by a sum; our factories are already means).

For differential privacy use TFF's DP aggregators themselves as the model aggregator (DP-FedAvg:
`tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(...)` with `build_unweighted_fed_avg`, or
`tff.learning.dp_aggregator`); they clip each update to an L2 norm, sum, add Gaussian noise to the sum and divide
by the expected number of clients. (Clipping before GMA or RFA for robustness, `tff.aggregators.clipping_factory(
clip, GradientMaskedFactory())`, composes correctly: the clipping factory passes clipped values to an inner
aggregator of any kind; it is not differential privacy.)

How the slot is recognised. The consumer creates the inner process from inside its own `create`
(`record_aggregation_factory.create(record_type)`, `value_sum_factory.create(value_type)`), so `check_not_in_sum_slot`
looks up the Python stack for a frame running the `create` of one of those TFF classes, compared by code object
(not by name, so no other function is taken for it). Found anywhere above, with factories between (e.g. a
clipping factory inside the DP factory, which still needs a sum), it refuses. This reads TFF's implementation
(`tff_gma.tff_internals.create_running_above`): the tests (`tests/tff_gma/aggregators/composition_test.py`,
`tests/tff_gma/tff_internals_test.py`) pin that the pinned TFF still calls it that way.

The weighted mean inside GMA and RFA. Their `mean_factory` argument must weight the clients: RFA's passes are
weighted means with the Weiszfeld weights, GMA's mean uses the client weights and gives dropped clients weight 0.
`tff.aggregators.as_weighted_aggregator(unweighted)` (the route to put an unweighted DP factory there) ignores the
weights, which would turn RFA into the plain mean of the clipped, noised updates, silently: `check_weighted_mean`
refuses it at construction.
"""

from __future__ import annotations

import sys
from typing import Optional

import tensorflow_federated as tff

from tff_gma import tff_internals

DOCS = 'docs/methods.md#differential-privacy'


def _sum_slots() -> dict[type, str]:
  """Each TFF factory whose `create` creates an inner factory it treats as a sum -> the slot, in words."""
  aggregators = tff.aggregators
  return {
      aggregators.DifferentiallyPrivateFactory: "DifferentiallyPrivateFactory's record_aggregation_factory",
      aggregators.MeanFactory: "MeanFactory's value_sum_factory or weight_sum_factory",
      aggregators.UnweightedMeanFactory: "UnweightedMeanFactory's value_sum_factory or count_sum_factory",
  }


def sum_slot_above() -> Optional[str]:
  """The TFF sum slot whose `create` is on the Python stack above the caller, in words; `None` if none is."""
  slots = _sum_slots()
  factory = tff_internals.create_running_above(sys._getframe(1), tuple(slots))  # pylint: disable=protected-access
  return None if factory is None else slots[factory]


def check_not_in_sum_slot(factory_name: str, returns: str) -> None:
  """Refuses (TypeError, one line) when called from within a TFF `create` that takes its factory for a sum.

  Args:
    factory_name: the refusing factory, as the user wrote it (e.g. `'UnweightedGradientMaskedFactory'`).
    returns: what it computes, in words (e.g. `'a masked mean'`).
  """
  slot = sum_slot_above()
  if slot is None:
    return
  if slot.startswith('DifferentiallyPrivateFactory'):
    instead = ('for differential privacy use tff.aggregators.DifferentiallyPrivateFactory (e.g. gaussian_fixed) '
               'itself as the model aggregator: GMA and RFA have no DP variant')
  else:
    instead = f'use {factory_name} itself as the aggregator'
  raise TypeError(f'{factory_name} cannot be {slot}: that slot must sum the client values and {factory_name} '
                  f'returns {returns}, so the result would be silently wrong; {instead} ({DOCS}).')


def _weight_ignoring_types() -> tuple[type, ...]:
  # TFF 0.87's `as_weighted_aggregator` returns a private class; take it from a call rather than by its name.
  return (type(tff.aggregators.as_weighted_aggregator(tff.aggregators.SumFactory())),)


def check_weighted_mean(mean_factory: tff.aggregators.WeightedAggregationFactory, owner: str, why: str) -> None:
  """Refuses (ValueError, one line) a `mean_factory` known to ignore the weights it is given.

  Args:
    mean_factory: the weighted-mean factory given to `owner`.
    owner: the factory it was given to, e.g. `'GeometricMedianFactory'`.
    why: what the weights are for in `owner`, in words.
  """
  if isinstance(mean_factory, _weight_ignoring_types()):
    raise ValueError(f'{owner}: mean_factory ignores the weights it is given (tff.aggregators.as_weighted_aggregator)'
                     f' and {why}; give a weighted mean such as FederatedMeanFactory() or '
                     f'SecureWeightedMeanFactory(...), and see {DOCS} for differential privacy.')
