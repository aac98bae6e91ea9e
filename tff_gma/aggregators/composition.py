"""Where this library's factories do not compose with TFF's, and the refusal that says so.

TFF takes any unweighted factory for a sum in `DifferentiallyPrivateFactory`'s `record_aggregation_factory` and in
`MeanFactory`'s sum factories; ours return means, so there the result would be silently wrong, and GMA and RFA have
no DP variant. The unweighted factories refuse those slots at `create`, and GMA and RFA a `mean_factory` that
ignores weights. A slot is recognised by the TFF `create` running above the factory's own (`sum_slot_above`).
"""

from __future__ import annotations

import sys
from typing import Optional

import tensorflow_federated as tff

from tff_gma import tff_internals

DOCS = 'tff_gma.aggregators.composition'  # Where a refusal's reader finds why: this module's docstring.


def _sum_slots() -> dict[type, str]:
  """Each TFF factory whose `create` creates an inner factory it treats as a sum -> the slot, in words."""
  aggregators = tff.aggregators
  return {
      aggregators.DifferentiallyPrivateFactory: "DifferentiallyPrivateFactory's record_aggregation_factory",
      aggregators.MeanFactory: "MeanFactory's value_sum_factory or weight_sum_factory",
      aggregators.UnweightedMeanFactory: "UnweightedMeanFactory's value_sum_factory or count_sum_factory",
  }


def sum_slot_above() -> Optional[str]:
  """The TFF sum slot whose `create` is on the Python stack above the caller, in words; `None` if none is.

  A consumer creates its inner process from inside its own `create`, so a frame running one of those `create`s
  (matched by code object, not by name) anywhere above, factories in between (a clipping factory) included, means
  the caller is being created for that slot.
  """
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
