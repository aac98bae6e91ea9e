"""Robust aggregation baselines that need every client's update at the server. NOT PRIVATE.

The RFA paper's comparisons (Sec. 5.2): the coordinate-wise median, the trimmed mean (Yin et al., 2018) and
multi-Krum (Blanchard et al., 2017). None is a function of sums or means, so none can use secure aggregation: each
collects every client's update at the server with `federated_aggregate`, which the audit reports as a violation.
"""

from __future__ import annotations

import collections
import numbers
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values

# ----------------------------------------------------------------------------------------------------------------
# Plain TF on stacked client vectors: points [n, d] (n dynamic), weights [n].


def round_half_up(fraction: float, count: tf.Tensor) -> tf.Tensor:
  """int32 floor(fraction * count + 0.5)."""
  return tf.cast(tf.floor(fraction * tf.cast(count, tf.float64) + 0.5), tf.int32)


def coordinate_median(points: tf.Tensor) -> tf.Tensor:
  """Per-coordinate median of the rows of `points` ([n, d] -> [d]); zeros for n = 0."""
  n = tf.shape(points)[0]

  def median():
    ordered = tf.sort(points, axis=0)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2

  return tf.cond(n > 0, median, lambda: tf.zeros([points.shape[1]], points.dtype))


def trim_count(trim_fraction: float, n: tf.Tensor) -> tf.Tensor:
  """k = round(trim_fraction * n), at most (n - 1) // 2 so that at least one value remains."""
  return tf.maximum(tf.minimum(round_half_up(trim_fraction, n), (n - 1) // 2), 0)


def trimmed_mean(points: tf.Tensor, trim_fraction: float) -> tuple[tf.Tensor, tf.Tensor]:
  """(per-coordinate mean after dropping the k largest and k smallest values, k); zeros for n = 0."""
  n = tf.shape(points)[0]
  k = trim_count(trim_fraction, n)
  kept = tf.sort(points, axis=0)[k:n - k]
  mean = tf.math.divide_no_nan(tf.reduce_sum(kept, axis=0), tf.cast(tf.shape(kept)[0], points.dtype))
  return mean, k


def _sorted_columns(points: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(each coordinate's values sorted, [d, n]; their clients' weights in that order, float64 [d, n])."""
  columns = tf.transpose(points)
  order = tf.argsort(columns, axis=1, stable=True)
  return tf.gather(columns, order, batch_dims=1), tf.gather(tf.cast(weights, tf.float64), order)


def weighted_coordinate_median(points: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
  """Per coordinate, the smallest value whose cumulative weight reaches half the total weight A, or the mean of it
  and the next value when its cumulative weight is exactly A / 2 (`np.median` for equal weights); zeros for n = 0."""
  n = tf.shape(points)[0]

  def median():
    values, ordered_weights = _sorted_columns(points, weights)
    cumulative = tf.cumsum(ordered_weights, axis=1)
    half = cumulative[:, -1] / 2
    index = tf.minimum(tf.reduce_sum(tf.cast(cumulative < half[:, None], tf.int32), axis=1), n - 1)
    at = lambda tensor, i: tf.gather(tensor, i[:, None], batch_dims=1)[:, 0]
    exact = tf.equal(at(cumulative, index), half)
    upper = at(values, tf.minimum(index + 1, n - 1))
    return tf.where(exact, (at(values, index) + upper) / 2, at(values, index))

  return tf.cond(n > 0, median, lambda: tf.zeros([points.shape[1]], points.dtype))


def weighted_trimmed_mean(points: tf.Tensor, weights: tf.Tensor, trim_fraction: float) -> tuple[tf.Tensor, tf.Tensor]:
  """(per-coordinate weighted mean after trimming weight beta * A from each side, beta * A as float32).

  Per coordinate, with the values sorted and c_j their cumulative weight, value j keeps the weight of
  [c_{j-1}, c_j] inside [beta A, (1 - beta) A]: a value across a boundary keeps a fraction of its weight. Zeros for
  n = 0.
  """
  values, ordered_weights = _sorted_columns(points, weights)
  cumulative = tf.cumsum(ordered_weights, axis=1)
  total = tf.reduce_sum(ordered_weights, axis=1, keepdims=True)
  cut = trim_fraction * total
  kept = tf.maximum(tf.minimum(cumulative, total - cut) - tf.maximum(cumulative - ordered_weights, cut), 0)
  mean = tf.math.divide_no_nan(tf.reduce_sum(kept * tf.cast(values, tf.float64), axis=1), tf.reduce_sum(kept, axis=1))
  return tf.cast(mean, points.dtype), tf.cast(trim_fraction * tf.reduce_sum(tf.cast(weights, tf.float64)), tf.float32)


def krum_scores(points: tf.Tensor, num_byzantine: tf.Tensor) -> tf.Tensor:
  """Each row's sum of squared distances to its n - f - 2 nearest other rows (clamped to [1, n - 1])."""
  n = tf.shape(points)[0]
  squared_norms = tf.reduce_sum(tf.square(points), axis=1)
  distances = squared_norms[:, None] + squared_norms[None, :] - 2 * tf.matmul(points, points, transpose_b=True)
  distances = tf.maximum(distances, 0)
  # Exclude each row itself: it sorts last.
  distances = tf.where(tf.eye(n, dtype=tf.bool), tf.fill([n, n], tf.constant(np.inf, points.dtype)), distances)
  neighbours = tf.clip_by_value(n - num_byzantine - 2, 1, tf.maximum(n - 1, 1))
  nearest = tf.sort(distances, axis=1)[:, :neighbours]
  return tf.reduce_sum(tf.where(tf.math.is_finite(nearest), nearest, tf.zeros_like(nearest)), axis=1)


def multi_krum(points: tf.Tensor, weights: tf.Tensor, byzantine_fraction: float,
               num_selected: Optional[int] = None) -> tuple[tf.Tensor, tf.Tensor]:
  """(weighted mean of the m lowest-score rows, m); m = n - f (or `num_selected`, at most n); zeros for n = 0."""
  n = tf.shape(points)[0]
  f = round_half_up(byzantine_fraction, n)
  if num_selected is None:
    m = tf.maximum(n - f, 1)
  else:
    m = tf.constant(num_selected, tf.int32)
  m = tf.minimum(m, n)
  selected = tf.argsort(krum_scores(points, f), stable=True)[:m]
  chosen_weights = tf.cast(tf.gather(weights, selected), points.dtype)
  mean = tf.math.divide_no_nan(
      tf.reduce_sum(tf.gather(points, selected) * chosen_weights[:, None], axis=0), tf.reduce_sum(chosen_weights))
  return mean, m


# ----------------------------------------------------------------------------------------------------------------
# Federated plumbing: collect every client's (flattened update, weight) at the server.


def _flat_size(value_type) -> int:
  return client_values.num_elements(value_type)


def _collected_type(size: int) -> tff.StructWithPythonType:
  return tff.StructWithPythonType(
      [('points', tff.TensorType(np.float32, [None, size])), ('weights', tff.TensorType(np.float32, [None]))],
      collections.OrderedDict)


def collect_at_server(pairs, size: int):
  """`federated_aggregate` stacking every client's (float32[size], float32 weight) pair: NOT PRIVATE.

  Returns OrderedDict(points=float32[n, size], weights=float32[n]) at SERVER.
  """
  collected_type = _collected_type(size)
  pair_type = tff.StructType([tff.TensorType(np.float32, [size]), tff.TensorType(np.float32)])

  @tff.tensorflow.computation
  def zero():
    # Dynamic leading dimension: the accumulator grows by one row per client.
    return collections.OrderedDict(
        points=tf.compat.v1.placeholder_with_default(tf.zeros([0, size]), shape=[None, size]),
        weights=tf.compat.v1.placeholder_with_default(tf.zeros([0]), shape=[None]))

  @tff.tensorflow.computation(collected_type, pair_type)
  def accumulate(collected, pair):
    point, weight = pair
    return collections.OrderedDict(points=tf.concat([collected['points'], point[None]], axis=0),
                                   weights=tf.concat([collected['weights'], weight[None]], axis=0))

  @tff.tensorflow.computation(collected_type, collected_type)
  def merge(a, b):
    return collections.OrderedDict(points=tf.concat([a['points'], b['points']], axis=0),
                                   weights=tf.concat([a['weights'], b['weights']], axis=0))

  @tff.tensorflow.computation(collected_type)
  def report(collected):
    return collected

  return tff.federated_aggregate(pairs, zero(), accumulate, merge, report)


class CollectingFactory(tff.aggregators.WeightedAggregationFactory):
  """Base: collects the clients' flattened updates at the server and applies `_rule` there (NOT PRIVATE).

  The rule sees the n clients with a finite update and a positive finite weight; the others are dropped. A round
  without clients returns zeros. Measurements (at SERVER): `participating_clients` (n), `dropped_clients`, and the
  rule's own. State: none, or with `_counts_rounds` the int32 number of calls so far (`_round_rule` gets it).
  """

  _counts_rounds = False

  def _rule(self, points: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, collections.OrderedDict]:
    """(aggregate [d], extra measurements) of the kept clients' points [n, d] and weights [n]."""
    raise NotImplementedError

  def _round_rule(self, points: tf.Tensor, weights: tf.Tensor,
                  round_num: tf.Tensor) -> tuple[tf.Tensor, collections.OrderedDict]:
    """`_rule`, in a call that knows its round (0, 1, ... with `_counts_rounds`, else always 0)."""
    del round_num
    return self._rule(points, weights)

  def stacked_rule(self, points: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, collections.OrderedDict]:
    """The rule on stacked clients at the server (what `bucketing` applies to buckets)."""
    return self._rule(points, weights)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    size = _flat_size(value_type)
    rule, counts_rounds = self._round_rule, self._counts_rounds

    @tff.tensorflow.computation(value_type, weight_type)
    def flatten(value, weight):
      value, weight, _ = client_values.drop_invalid_clients(value, weight)
      flat = tf.concat([tf.reshape(tf.cast(x, tf.float32), [-1]) for x in tf.nest.flatten(value)], axis=0)
      return flat, tf.cast(weight, tf.float32)

    @tff.tensorflow.computation(_collected_type(size), np.int32)
    def aggregate(collected, round_num):
      keep = collected['weights'] > 0  # Invalid clients were given weight 0 at the client.
      points = tf.boolean_mask(collected['points'], keep)
      weights = tf.boolean_mask(collected['weights'], keep)
      flat, extra = rule(points, weights, round_num)
      # Unflatten in tf.nest's order, the order `flatten` used (it sorts dict keys).
      template = tff.types.structure_from_tensor_type_tree(lambda t: t, value_type)
      leaves, offset = [], 0
      for leaf in tf.nest.flatten(template):
        count = int(np.prod(leaf.shape))
        leaves.append(tf.cast(tf.reshape(flat[offset:offset + count], leaf.shape), leaf.dtype))
        offset += count
      result = tf.nest.pack_sequence_as(template, leaves)
      measurements = collections.OrderedDict(
          participating_clients=tf.shape(points)[0],
          dropped_clients=tf.shape(collected['points'])[0] - tf.shape(points)[0])
      measurements.update(extra)
      return result, measurements

    @tff.tensorflow.computation(np.int32)
    def increment(round_num):
      return round_num + 1

    @tff.federated_computation()
    def init_fn():
      return tff.federated_value(np.int32(0) if counts_rounds else (), tff.SERVER)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      collected = collect_at_server(tff.federated_map(flatten, (value, weight)), size)
      round_num = state if counts_rounds else tff.federated_value(np.int32(0), tff.SERVER)
      result, measurements = tff.federated_map(aggregate, (collected, round_num))
      new_state = tff.federated_map(increment, state) if counts_rounds else state
      return tff.templates.MeasuredProcessOutput(new_state, result, measurements)

    return tff.templates.AggregationProcess(init_fn, next_fn)


def _check_fraction_below_half(value, name: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < 0.5:
    raise ValueError(f'{name} must be a number in [0, 0.5), got {value!r}')
  return float(value)


# The median and the trimmed mean ignore the client weights by default (`weighted=False`), as the papers' rules: a
# client's weight is its own claim (its example count), and a weighted median follows a client that claims half the
# total weight, whatever its update. `weighted=True` honours the weights, for trusted weights.


class CoordinateMedianFactory(CollectingFactory):
  """Coordinate-wise median of the client updates. NOT PRIVATE: every update reaches the server.

  Unweighted (default): the mean of the two middle values for an even count, as `np.median`; the weights only decide
  who is dropped. `weighted=True`: `weighted_coordinate_median`, the same for equal weights.
  """

  def __init__(self, weighted: bool = False):
    """Args: `weighted`: honour the client weights (see the comment above the class)."""
    self._weighted = checks.check_bool(weighted, 'weighted')

  def _rule(self, points, weights):
    if self._weighted:
      return weighted_coordinate_median(points, weights), collections.OrderedDict()
    return coordinate_median(points), collections.OrderedDict()


class TrimmedMeanFactory(CollectingFactory):
  """Coordinate-wise trimmed mean. NOT PRIVATE: every update reaches the server.

  Unweighted (default): per coordinate, drops the k largest and k smallest values, k = round(beta * n) (halves up)
  capped at (n - 1) // 2, and averages the rest; measures `trimmed_per_side` (k). `weighted=True`: trims weight
  beta * A from each side (`weighted_trimmed_mean`; the unweighted rule when beta * n is an integer and the weights
  equal); measures `trimmed_weight_per_side` (beta * A, float32).
  """

  def __init__(self, trim_fraction: float, weighted: bool = False):
    """Args: `trim_fraction`: beta in [0, 0.5), the share trimmed on each side (the corruption level); `weighted`:
    trim weight instead of clients (see the comment above `CoordinateMedianFactory`)."""
    self._trim_fraction = _check_fraction_below_half(trim_fraction, 'trim_fraction')
    self._weighted = checks.check_bool(weighted, 'weighted')

  def _rule(self, points, weights):
    if self._weighted:
      mean, trimmed = weighted_trimmed_mean(points, weights, self._trim_fraction)
      return mean, collections.OrderedDict(trimmed_weight_per_side=trimmed)
    mean, k = trimmed_mean(points, self._trim_fraction)
    return mean, collections.OrderedDict(trimmed_per_side=k)


class MultiKrumFactory(CollectingFactory):
  """Multi-Krum: the weighted mean of the lowest-score updates. NOT PRIVATE: every update reaches the server.

  With f = round(beta * n) (halves up), a client's score is the sum of squared distances to its n - f - 2 nearest
  other clients (at least 1, at most n - 1); the m = n - f lowest (or `num_selected`, at most n; 1 is Krum) are
  averaged with their weights. Measures `selected_clients` (m).
  """

  def __init__(self, byzantine_fraction: float, num_selected: Optional[int] = None):
    """Args: `byzantine_fraction`: beta in [0, 0.5), f = round(beta * n); `num_selected`: m (default n - f)."""
    self._byzantine_fraction = _check_fraction_below_half(byzantine_fraction, 'byzantine_fraction')
    self._num_selected = checks.check_positive_int(num_selected, 'num_selected', optional=True)

  def _rule(self, points, weights):
    mean, m = multi_krum(points, weights, self._byzantine_fraction, self._num_selected)
    return mean, collections.OrderedDict(selected_clients=m)
