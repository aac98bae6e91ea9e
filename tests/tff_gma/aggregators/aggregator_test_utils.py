"""Test helpers for the aggregation factories, after TFF's `aggregators/aggregator_test_utils.py`.

TFF's `SumPlusOneFactory` (an unweighted inner factory whose state counts the calls and whose measurement is a
constant) is not in TFF's pip package (its `aggregator_test_utils` is a test-only module), and every inner factory
of `tff_gma.aggregators` is a weighted one, so `WeightedMeanPlusOneFactory` is its weighted analogue:

* state: an int32 counter at SERVER, 0 after `initialize`, incremented by every `next`;
* result: the weighted mean of the client values plus 1 in every coordinate (0 + 1 for zero total weight), so an
  outer factory that returns its inner mean (GMA with tau = 0, RFA with one pass from the mean, FedGMA with step
  0) visibly returns this one's;
* measurements: the int32 constant `MEASUREMENT_CONSTANT` at SERVER.

`process_types` builds, by hand, the `initialize` and `next` type signatures TFF's `mean_test.py` expects of an
aggregation process, from the state, value, weight and measurements types given.
"""

import collections
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

MEASUREMENT_CONSTANT = 42

# TFF's `mean_test.py` test types: a float tensor, and a structure with a float32 vector and a float64 scalar.
FLOAT_TYPE = tff.TensorType(np.float32)
STRUCT_TYPE = tff.to_type(((np.float32, (2,)), np.float64))
# The weight dtypes TFF's `mean_test.py` creates `MeanFactory` processes with.
WEIGHT_DTYPES = (np.float32, np.float64, np.int32, np.int64)


class WeightedMeanPlusOneFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted "mean + 1" with a call counter as state and a constant measurement (module docstring)."""

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:

    @tff.federated_computation()
    def init_fn():
      return tff.federated_value(np.int32(0), tff.SERVER)

    @tff.tensorflow.computation(np.int32)
    def increment(count):
      return count + 1

    @tff.tensorflow.computation(value_type, weight_type)
    def weighted_pair(value, weight):
      weight = tf.cast(weight, tf.float64)
      return tf.nest.map_structure(lambda x: x * tf.cast(weight, x.dtype), value), weight

    @tff.tensorflow.computation(weighted_pair.type_signature.result)
    def mean_plus_one(sums):
      weighted_sum, weight_sum = sums
      return tf.nest.map_structure(lambda x: tf.math.divide_no_nan(x, tf.cast(weight_sum, x.dtype)) + 1,
                                   weighted_sum)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      sums = tff.federated_sum(tff.federated_map(weighted_pair, (value, weight)))
      return tff.templates.MeasuredProcessOutput(
          tff.federated_map(increment, state), tff.federated_map(mean_plus_one, sums),
          tff.federated_value(np.int32(MEASUREMENT_CONSTANT), tff.SERVER))

    return tff.templates.AggregationProcess(init_fn, next_fn)


def process_types(state_type, value_type, weight_type: Optional[tff.TensorType], measurements_type,
                  result_type=None):
  """(initialize type, next type) of an aggregation process, as TFF's `mean_test.py` writes them.

  Args:
    state_type: the state's type at SERVER (unplaced; placed here).
    value_type: the client value's type (unplaced).
    weight_type: the client weight's type (unplaced), or None for an unweighted process.
    measurements_type: the measurements' type at SERVER (unplaced).
    result_type: the result's type at SERVER (unplaced); default `value_type`.
  """
  result_type = value_type if result_type is None else result_type
  server_state = tff.FederatedType(state_type, tff.SERVER)
  parameter = collections.OrderedDict(state=server_state, value=tff.FederatedType(value_type, tff.CLIENTS))
  if weight_type is not None:
    parameter['weight'] = tff.FederatedType(weight_type, tff.CLIENTS)
  initialize_type = tff.FunctionType(parameter=None, result=server_state)
  next_type = tff.FunctionType(
      parameter=parameter,
      result=tff.templates.MeasuredProcessOutput(
          server_state, tff.FederatedType(result_type, tff.SERVER), tff.FederatedType(measurements_type, tff.SERVER)))
  return initialize_type, next_type


def assert_process_types(process, state_type, value_type, weight_type, measurements_type, result_type=None):
  """`process` is an AggregationProcess with exactly the `process_types(...)` signatures (and weighted iff
  `weight_type` is given)."""
  assert isinstance(process, tff.templates.AggregationProcess)
  assert process.is_weighted == (weight_type is not None)
  initialize_type, next_type = process_types(state_type, value_type, weight_type, measurements_type, result_type)
  assert process.initialize.type_signature.is_equivalent_to(initialize_type), (
      f'initialize: got {process.initialize.type_signature}, expected {initialize_type}')
  assert process.next.type_signature.is_equivalent_to(next_type), (
      f'next: got {process.next.type_signature}, expected {next_type}')


# ----------------------------------------------------------------------------------------------------------------
# Client values for the weighted means' tests (`mean_test.py`, `secure_mean_test.py`), with a NumPy reference.

NESTED_TYPE = tff.to_type(collections.OrderedDict(
    a=tff.TensorType(np.float32, [3]), b=[tff.TensorType(np.float32, [2, 2])]))  # 7 float32 coordinates.


def random_nested_values(rng: np.random.Generator, num_clients: int, scale: float = 1.0) -> list:
  """`num_clients` values of `NESTED_TYPE`, every coordinate normal with standard deviation `scale`."""
  return [collections.OrderedDict(a=np.float32(scale * rng.normal(size=3)),
                                  b=[np.float32(scale * rng.normal(size=(2, 2)))]) for _ in range(num_clients)]


def flat(structure) -> np.ndarray:
  """All coordinates of a structure of arrays, in `tf.nest` order, as one float64 vector."""
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in tf.nest.flatten(structure)])


def weighted_mean(values, weights) -> np.ndarray:
  """NumPy reference: the weighted mean of `NESTED_TYPE` values, flattened; zeros for zero total weight."""
  w = np.asarray(weights, np.float64)
  return w @ np.stack([flat(v) for v in values]) / w.sum() if w.sum() > 0 else np.zeros(7)
