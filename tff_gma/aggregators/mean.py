"""The plain weighted mean, the choice between it and the secure one, and the unweighted use of a weighted factory.

GMA and RFA reduce to weighted means: `weighted_mean_factory(secure, ...)` gives `FederatedMeanFactory` (one
`federated_mean`, the values in the clear to the runtime) or `secure_mean.SecureWeightedMeanFactory` (secure sums
only); `as_unweighted` is the converse of TFF's `as_weighted_aggregator`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import client_values
from tff_gma.aggregators import composition
from tff_gma.aggregators import secure_mean


class FederatedMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted mean through a single `tff.federated_mean`; zero when the total weight is zero.

  Clients send the pair `(a_i * w_i, a_i)` to one unweighted `federated_mean`; the server returns
  `mean(a w) / mean(a)` (`divide_no_nan`). A client with a non-finite value or a non-finite or negative weight
  sends a zero value of weight 0 (`client_values.drop_invalid_clients`). Empty state, empty measurements.
  """

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)

    # The weight's mean is carried in the widest float dtype of the values (float64 values keep their precision)
    # or of the weight (`float_weight_dtype`: integer weights are averaged as float32, float64 ones as float64).
    leaf_dtypes = [np.dtype(t.dtype) for t in client_values.tensor_types(value_type)]
    float64 = np.dtype(np.float64)
    pair_weight_dtype = float64 if float64 in leaf_dtypes else client_values.float_weight_dtype(weight_type.dtype)

    @tff.tensorflow.computation(value_type, weight_type)
    def weighted_pair(value, weight):
      value, weight, _ = client_values.drop_invalid_clients(value, weight)
      # float16 and bfloat16 are weighted and averaged in float32: a weight of 1e5 times a float16 overflows.
      value = client_values.to_compute_dtypes(value)
      weighted = tf.nest.map_structure(lambda x: x * tf.cast(weight, x.dtype), value)
      return weighted, tf.cast(weight, pair_weight_dtype)

    @tff.tensorflow.computation(weighted_pair.type_signature.result)
    def divide(mean_pair):
      weighted_mean, mean_weight = mean_pair
      # No client at all: federated_mean over an empty cohort is 0 / 0 = NaN for both; the result is zero then,
      # as for a zero total weight.
      has_weight = tf.logical_and(tf.math.is_finite(mean_weight), mean_weight > 0)
      means = tf.nest.map_structure(
          lambda x: tf.where(has_weight, tf.math.divide_no_nan(x, tf.cast(mean_weight, x.dtype)), tf.zeros_like(x)),
          weighted_mean)
      return client_values.cast_leaves(means, leaf_dtypes)

    @tff.federated_computation()
    def init_fn():
      return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      mean_pair = tff.federated_mean(tff.federated_map(weighted_pair, (value, weight)))
      result = tff.federated_map(divide, mean_pair)
      return tff.templates.MeasuredProcessOutput(state, result, tff.federated_value((), tff.SERVER))

    return tff.templates.AggregationProcess(init_fn, next_fn)


def weighted_mean_factory(
    secure: bool, value_bound: Optional[float], weight_bound: float,
) -> tff.aggregators.WeightedAggregationFactory:
  """`SecureWeightedMeanFactory(value_bound, weight_bound)` when `secure`, else `FederatedMeanFactory()`."""
  if not secure:
    return FederatedMeanFactory()
  if value_bound is None:
    raise ValueError('value_bound is required when secure=True (the bound on |coordinate| that secure sums clip '
                     'to), got None')
  return secure_mean.SecureWeightedMeanFactory(value_bound, weight_bound)


# ----------------------------------------------------------------------------------------------------------------
# Unweighted use.


class _UnitWeightFactory(tff.aggregators.UnweightedAggregationFactory):
  """Runs a weighted factory with weight 1 for every client."""

  def __init__(self, weighted_factory: tff.aggregators.WeightedAggregationFactory):
    if not isinstance(weighted_factory, tff.aggregators.WeightedAggregationFactory):
      raise TypeError(f'expected a tff.aggregators.WeightedAggregationFactory, got {weighted_factory!r}')
    self._weighted_factory = weighted_factory

  def create(self, value_type) -> tff.templates.AggregationProcess:
    if type(self._weighted_factory).__module__.startswith('tff_gma.'):
      # This library's weighted factories all return means: never a slot TFF sums in (see `composition`).
      composition.check_not_in_sum_slot(f'as_unweighted({type(self._weighted_factory).__name__})', 'a mean')
    process = self._weighted_factory.create(value_type, tff.TensorType(np.float32))

    @tff.federated_computation(process.state_type, tff.FederatedType(value_type, tff.CLIENTS))
    def next_fn(state, value):
      return process.next(state, value, tff.federated_value(np.float32(1.0), tff.CLIENTS))

    return tff.templates.AggregationProcess(process.initialize, next_fn)


def as_unweighted(
    weighted_factory: tff.aggregators.WeightedAggregationFactory,
) -> tff.aggregators.UnweightedAggregationFactory:
  """The unweighted counterpart of a weighted factory: every client gets weight 1 (float32).

  The converse of TFF's `tff.aggregators.as_weighted_aggregator`, which TFF 0.87 does not provide.
  """
  return _UnitWeightFactory(weighted_factory)
