"""Weighted means built only from `federated_mean` or the secure-sum family, and shared client plumbing.

GMA and RFA both reduce to weighted means `sum_i a_i w_i / sum_i a_i` of client values `w_i` with client
weights `a_i` (RFA: one per Weiszfeld pass, with reweighted `a_i`). This module provides the two weighted-mean
factories they use and the client-side steps they share:

* `FederatedMeanFactory` (`secure=False`): one `tff.federated_mean` of the pair `(a_i w_i, a_i)`; the server
  divides the two means, so `N` cancels and the result is the weighted mean. It returns zeros when the total
  weight is zero (a plain weighted `federated_mean` would return NaN there), and needs no bounds. The values
  reach the aggregation in the clear (the runtime sees them), as with TFF's default mean.
* `SecureWeightedMeanFactory` (`secure=True`): every float leaves the clients only through
  `tff.federated_secure_sum_bitwidth`, by TFF's own quantized secure sum (`tff.aggregators.secure_quantized_sum`,
  the primitive behind `tff.aggregators.SecureSumFactory` for floats). Each client clips its weight to
  `[0, weight_bound]` and each coordinate of its value to `[-value_bound, value_bound]` (both counted), and
  sends `u_i = a_i / weight_bound` in `[0, 1]` and `u_i w_i` in `[-value_bound, value_bound]`. Normalizing the
  weight *before* multiplying is what keeps `u_i w_i` inside the value bound (TFF's `MeanFactory` clips
  `a_i w_i` itself, so a client weight of 90 would clip an update of 0.02); the common factor `1 / weight_bound`
  cancels in the division.

Error of the secure mean. Per coordinate, let `m` be the exact weighted mean of the clipped values `w_i` with
the clipped weights `a_i` (real arithmetic), `M = max_i |w_i|`, `N` the number of clients in the round,
`U = sum_i a_i / weight_bound`, `B = value_bound`, `L = 2**32 - 1` (`SECAGG_LEVELS`) and `eps` the unit
roundoff of the coarser of the value's dtype and the weight's float dtype (2**-24 for float32). The result
differs from `m` by two kinds of error:

* Quantization. TFF's quantized secure sum maps a float `x` in `[lo, hi]` to the integer nearest to
  `x * L / (hi - lo)`, sums the integers exactly and scales the sum back, so each client adds at most
  `(hi - lo) / (2 L)` to a sum: `B / L` to each coordinate of `sum u_i w_i`, `1 / (2 L)` to `sum u_i`. The
  float64 arithmetic of that scaling adds less than 4e-6 of this, relative (TFF's
  `_client_tensor_shift_for_secure_sum` rounds `x * scale` in float64, at most 2**-20 of the 1/2 step; the
  decoding makes 3 float64 roundings of a sum of size at most `N * max(|lo|, |hi|)`, i.e. 3 * 2**-53 * L = 1.4e-6
  of `N (hi - lo) / (2 L)` for the values, twice that for the weights); `QUANTIZATION_SLACK = 1 + 1e-5` covers
  it. Dividing the two perturbed sums, with `s = QUANTIZATION_SLACK`:

      |mean - m| <= s N (B + |m| / 2) / (L U - s N / 2)            (`discretization_error_bound`)

* Float rounding. Each client rounds its weight up to three times (cast to float, divide by `weight_bound`,
  cast to the value's dtype; the weight of the weight sum twice) and `u_i w_i` once; the server rounds the two
  sums to their dtypes and the quotient, at most twice in casts and once in the division. The per-client
  relative errors of the weights move the mean by at most `4 eps M + 2 eps |m|` (`sum_i a_i (w_i - m) = 0`
  cancels the rest), the final roundings scale it by at most `1 + 4 eps`.

Together, to first order, `N (B + |m| / 2) / (L U) + eps (4 M + 6 |m|)`; `error_bound` computes the full
bound, with every higher-order term and rounded-up constant (they add less than a relative 1e-4). Example: 10
clients of weight 100, `weight_bound=1e4`, `value_bound=1`, values of size about 1: `U = 0.1`, quantization
2.3e-8, rounding about 6e-7 (float32 rounding dominates). Keep `weight_bound` near the largest real weight: the
quantization error grows as `weight_bound / sum a_i`.

Weight dtypes. A client weight is a scalar of any float or integer dtype (`check_weight_type`: what TFF's
`MeanFactory` accepts, less bool and complex). The clients cast it to `float_weight_dtype` (float32, or float64
for float64 weights) before anything else, so clipping to `weight_bound` and normalizing happen in float: the
bounds logic is the same for every weight dtype, and an integer weight gives the result of the same weight as a
float32.

Non-finite input. `drop_invalid_clients` replaces a client whose value has a NaN/Inf, or whose weight is
non-finite or negative, by a zero value with zero weight, and flags it so that the factories can count it with a
secure sum. Such a client then contributes nothing to any sum (and nothing to GMA's sign sums or counts).

Counting. Counts of clients (participating, dropped, clipped) are secure sums of 0/1 indicators with
`max_input=1`, in both modes: the server learns the counts, never which client they came from.
"""

from __future__ import annotations

import collections
import math
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import composition

SECAGG_LEVELS = 2**32 - 1  # Quantization levels of TFF's float secure sum (`primitives.secure_quantized_sum`).
QUANTIZATION_SLACK = 1 + 1e-5  # Covers the float64 arithmetic of that quantization (module docstring: < 4e-6).


# ----------------------------------------------------------------------------------------------------------------
# Plain TF (client side).


def all_finite(value) -> tf.Tensor:
  """Scalar bool: every element of every tensor of the structure `value` is finite."""
  leaves = tf.nest.flatten(value)
  if not leaves:
    return tf.constant(True)
  return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(x)) for x in leaves]))


def squared_norm_is_finite(value) -> tf.Tensor:
  """Scalar bool: the squared Euclidean norm of all elements of `value`, summed in float32, is finite."""
  leaves = tf.nest.flatten(value)
  if not leaves:
    return tf.constant(True)
  squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(x, tf.float32))) for x in leaves])
  return tf.math.is_finite(squares)


def float_weight(weight) -> tf.Tensor:
  """A client weight of any accepted dtype (`check_weight_type`) as a float tensor of `float_weight_dtype`."""
  weight = tf.convert_to_tensor(weight)
  return tf.cast(weight, float_weight_dtype(weight.dtype.as_numpy_dtype))


def drop_invalid_clients(value, weight):
  """Zeroes a client that must not reach the server; returns `(value, weight, keep)`.

  The weight is first cast to `float_weight_dtype` (integer weights become float32), and the returned weight
  has that dtype. A client is dropped when any element of `value` is NaN/Inf, when the squared Euclidean norm of
  its whole update overflows float32 (coordinates of about 1e19 and more: such an update cannot be averaged or
  measured in float32 without overflowing), or when its `weight` is non-finite or negative. A dropped client returns
  zeros of the value's structure and weight 0 (so that `0 * value` cannot produce NaN downstream). `keep` is an int32
  scalar, 1 for a kept client, 0 for a dropped one.
  """
  weight = float_weight(weight)
  weight_ok = tf.logical_and(tf.math.is_finite(weight), weight >= 0)
  keep = tf.logical_and(tf.logical_and(all_finite(value), squared_norm_is_finite(value)), weight_ok)
  clean_value = tf.nest.map_structure(lambda x: tf.where(keep, x, tf.zeros_like(x)), value)
  clean_weight = tf.where(keep, weight, tf.zeros_like(weight))
  return clean_value, clean_weight, tf.cast(keep, tf.int32)


def clip_to_bounds(value, weight, value_bound: float, weight_bound: float):
  """Clips `value` to `[-value_bound, value_bound]` and `weight` to `[0, weight_bound]`.

  Returns `(value, weight, value_clipped, weight_clipped)`, the last two int32 0/1 flags saying whether any
  coordinate of the value, resp. the weight, was changed. The bounds become constants of each tensor's dtype
  directly (`tf.cast` of a Python float would round it to float32 first, and clip a float64 value at the bound).
  """
  clipped = tf.nest.map_structure(
      lambda x: tf.clip_by_value(x, tf.constant(-value_bound, x.dtype), tf.constant(value_bound, x.dtype)), value)
  changed = [tf.reduce_any(tf.not_equal(x, c)) for x, c in zip(tf.nest.flatten(value), tf.nest.flatten(clipped))]
  value_clipped = tf.reduce_any(tf.stack(changed)) if changed else tf.constant(False)
  clipped_weight = tf.clip_by_value(weight, tf.zeros_like(weight), tf.constant(weight_bound, weight.dtype))
  weight_clipped = tf.not_equal(weight, clipped_weight)
  return clipped, clipped_weight, tf.cast(value_clipped, tf.int32), tf.cast(weight_clipped, tf.int32)


def discretization_error_bound(
    num_clients: int, total_weight: float, value_bound: float, weight_bound: float, mean_abs=0.0,
):
  """Worst-case per-coordinate quantization error of `SecureWeightedMeanFactory` (see the module docstring).

  `s N (B + |m| / 2) / (L U - s N / 2)`: the error of the mean if the secure sums' quantization were the only
  error (`error_bound` adds float rounding).

  Args:
    num_clients: N, the number of clients in the round.
    total_weight: `sum_i a_i` over kept clients (after clipping to `weight_bound`).
    value_bound: the secure value bound B.
    weight_bound: the secure weight bound.
    mean_abs: `|m|` for the coordinate (a number or an array of them; or its maximum over coordinates).

  Returns:
    The bound (0 for zero total weight, whose result is 0; inf if the quantization could swamp the weight sum).
  """
  normalized_total = total_weight / weight_bound
  if normalized_total <= 0:
    return 0.0
  value_error = QUANTIZATION_SLACK * num_clients * value_bound / SECAGG_LEVELS
  weight_error = QUANTIZATION_SLACK * num_clients / (2 * SECAGG_LEVELS)
  if weight_error >= normalized_total:
    return float('inf')
  return (value_error + np.asarray(mean_abs) * weight_error) / (normalized_total - weight_error)


def error_bound(
    num_clients: int, total_weight: float, value_bound: float, weight_bound: float, mean_abs, max_abs_value,
    dtype=np.float32,
):
  """Worst-case per-coordinate error of `SecureWeightedMeanFactory`'s result: quantization and float rounding.

  Against the exact weighted mean `m` of the clipped values with the clipped weights (module docstring). With
  `U_f` the normalized total weight as the clients compute it (within `eps` of `U`), the perturbed sums'
  quotient is off by at most

      E'' = (U / (1 - eps) ((4 eps + 7 eps^2) M + (2 eps + eps^2) |m|) + s N B / L + |m| s N / (2 L))
            / (U (1 - eps) (1 - 2 eps - eps^2) - s N / (2 L))

  and the final roundings add `((1 + eps)^2 / (1 - eps)^2 - 1) (|m| + E'') <= 4.0001 eps (|m| + E'')`.

  Args:
    num_clients: N, the number of clients in the round.
    total_weight: `sum_i a_i` over kept clients (after clipping to `weight_bound`).
    value_bound: the secure value bound B.
    weight_bound: the secure weight bound.
    mean_abs: `|m|` per coordinate (a number or an array).
    max_abs_value: `M = max_i |w_i|` per coordinate over the clients (clipped values; a number or an array).
    dtype: the coarser of the value's dtype and the weight's float dtype (`float_weight_dtype`), which sets
      `eps`: float32 unless both are float64.

  Returns:
    The bound, a float or an array shaped like `mean_abs` and `max_abs_value`.
  """
  normalized_total = total_weight / weight_bound
  if normalized_total <= 0:
    return 0.0 * np.asarray(mean_abs)
  eps = float(np.finfo(dtype).eps) / 2
  mean_abs, max_abs_value = np.asarray(mean_abs, np.float64), np.asarray(max_abs_value, np.float64)
  value_error = QUANTIZATION_SLACK * num_clients * value_bound / SECAGG_LEVELS
  weight_error = QUANTIZATION_SLACK * num_clients / (2 * SECAGG_LEVELS)
  denominator = normalized_total * (1 - eps) * (1 - 2 * eps - eps**2) - weight_error
  if denominator <= 0:
    return np.full(np.broadcast(mean_abs, max_abs_value).shape, np.inf)
  rounding = (4 * eps + 7 * eps**2) * max_abs_value + (2 * eps + eps**2) * mean_abs
  numerator = normalized_total / (1 - eps) * rounding + value_error + mean_abs * weight_error
  quotient_error = numerator / denominator
  return quotient_error + 4.0001 * eps * (mean_abs + quotient_error)


# ----------------------------------------------------------------------------------------------------------------
# Federated helpers.


def secure_count(indicators):
  """Secure sum of int32 0/1 indicators (a scalar or a structure) at CLIENTS, with the tightest `max_input=1`."""
  return tff.federated_secure_sum(indicators, 1)


def _leaves(value_type) -> list:
  return tff.structure.flatten(value_type) if isinstance(value_type, tff.StructType) else [value_type]


def check_float_structure(value_type, name: str = 'value_type') -> None:
  """Raises TypeError unless `value_type` is a non-federated tensor or structure of float tensors."""
  if isinstance(value_type, tff.FederatedType) or not isinstance(value_type, (tff.TensorType, tff.StructType)):
    raise TypeError(f'{name} must be an unplaced tff.TensorType or tff.StructType, got {value_type}')
  leaves = _leaves(value_type)
  if not leaves:
    raise TypeError(f'{name} must hold at least one tensor, got {value_type}')
  for leaf in leaves:
    if not isinstance(leaf, tff.TensorType) or not np.issubdtype(leaf.dtype, np.floating):
      raise TypeError(f'every tensor of {name} must be of a float dtype, got {value_type}')
    if leaf.shape is None or any(d is None for d in leaf.shape):
      raise TypeError(f'every tensor of {name} must have a fully defined shape, got {value_type}')


def check_weight_type(weight_type, name: str = 'weight_type') -> None:
  """Raises TypeError unless `weight_type` is an unplaced scalar of a real number dtype (float or integer).

  The weight dtypes TFF's `tff.aggregators.MeanFactory` accepts and runs, less bool (which TFF refuses too) and
  complex (a weight must be comparable with 0). TFF also accepts a non-scalar weight (multiplied elementwise
  into the value); a client weight here is one number per client.
  """
  if not (isinstance(weight_type, tff.TensorType) and weight_type.shape is not None
          and len(weight_type.shape) == 0  # pylint: disable=g-explicit-length-test
          and (np.issubdtype(weight_type.dtype, np.floating) or np.issubdtype(weight_type.dtype, np.integer))):
    raise TypeError(f'{name} must be an unplaced scalar tff.TensorType of a float or integer dtype, '
                    f'got {weight_type}')


def float_weight_dtype(weight_dtype) -> np.dtype:
  """The dtype client weights are computed in: float64 for float64 weights, float32 for every other dtype.

  Integer weights (example counts) are cast to float inside the client-side computation, before any check,
  clipping or normalization (a `weight_bound` of 1e4 does not fit an int8 or a float16 weight).
  """
  return np.dtype(np.float64) if np.dtype(weight_dtype) == np.float64 else np.dtype(np.float32)


def float_weight_type(weight_type) -> tff.TensorType:
  """The scalar `tff.TensorType` of `float_weight_dtype(weight_type.dtype)`: what inner weighted processes get."""
  return tff.TensorType(float_weight_dtype(weight_type.dtype))


def num_elements(value_type) -> int:
  """Total number of scalars in a (structure of) tensor type(s)."""
  return int(sum(math.prod(leaf.shape) for leaf in _leaves(value_type)))


# ----------------------------------------------------------------------------------------------------------------
# Factories.


class FederatedMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted mean through a single `tff.federated_mean`; zero when the total weight is zero.

  Clients send the pair `(a_i * w_i, a_i)` to one unweighted `federated_mean`; the server returns
  `mean(a w) / mean(a)` (`divide_no_nan`). Empty state, empty measurements.
  """

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    check_float_structure(value_type)
    check_weight_type(weight_type)

    # The weight's mean is carried in the widest float dtype of the values (float64 values keep their precision)
    # or of the weight (`float_weight_dtype`: integer weights are averaged as float32, float64 ones as float64).
    leaf_dtypes = {np.dtype(t.dtype) for t in _leaves(value_type)}
    float64 = np.dtype(np.float64)
    pair_weight_dtype = float64 if float64 in leaf_dtypes else float_weight_dtype(weight_type.dtype)

    @tff.tensorflow.computation(value_type, weight_type)
    def weighted_pair(value, weight):
      weight = float_weight(weight)
      weighted = tf.nest.map_structure(lambda x: x * tf.cast(weight, x.dtype), value)
      return weighted, tf.cast(weight, pair_weight_dtype)

    @tff.tensorflow.computation(weighted_pair.type_signature.result)
    def divide(mean_pair):
      weighted_mean, mean_weight = mean_pair
      # No client at all: federated_mean over an empty cohort is 0 / 0 = NaN for both; the result is zero then,
      # as for a zero total weight.
      has_weight = tf.logical_and(tf.math.is_finite(mean_weight), mean_weight > 0)
      return tf.nest.map_structure(
          lambda x: tf.where(has_weight, tf.math.divide_no_nan(x, tf.cast(mean_weight, x.dtype)), tf.zeros_like(x)),
          weighted_mean)

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


class SecureWeightedMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted mean whose floats leave the clients only through TFF's 32-bit quantized secure sum.

  Clients clip and normalize (see the module docstring) and send the pair `(u_i w_i, u_i)` to one
  `tff.aggregators.secure_quantized_sum`, with bounds `[-value_bound, value_bound]` for the weighted values and
  `[0, 1]` for the normalized weight; the server returns `sum u w / sum u` (zero when `sum u == 0`).

  This is the primitive TFF's `SecureSumFactory` uses for floats, with the same quantization; the result equals
  `tff.aggregators.MeanFactory(SecureSumFactory(value_bound), SecureSumFactory(1.0, 0.0), no_nan_division=True)`
  applied to the normalized weights (a test checks it), but one quantized sum carries both parts and the bounds
  are known, so the per-client max/min and clip counters of `SecureSumFactory` are not needed: three secure sums
  per mean instead of nine, which matters for RFA's several means per round.

  State: none. Measurements: `value_clipped_clients` and `weight_clipped_clients` (clients with any value
  coordinate outside `[-value_bound, value_bound]`, resp. a weight above `weight_bound`).
  """

  def __init__(self, value_bound: float, weight_bound: float = 1e4):
    """Args: `value_bound`: bound on the absolute value of every coordinate; `weight_bound`: largest weight."""
    self._value_bound = checks.check_positive_finite(value_bound, 'value_bound')
    self._weight_bound = checks.check_positive_finite(weight_bound, 'weight_bound')

  @property
  def value_bound(self) -> float:
    return self._value_bound

  @property
  def weight_bound(self) -> float:
    return self._weight_bound

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    check_float_structure(value_type)
    check_weight_type(weight_type)
    value_bound, weight_bound = self._value_bound, self._weight_bound
    weight_dtype = float_weight_dtype(weight_type.dtype)  # Clipped and normalized as a float (`float_weight`).

    def bounds(bound_value, weight_limit):
      per_leaf = tff.types.structure_from_tensor_type_tree(
          lambda t: np.asarray(bound_value, np.dtype(t.dtype)), value_type)
      return per_leaf, np.asarray(weight_limit, weight_dtype)

    @tff.tensorflow.computation(value_type, weight_type)
    def prepare(value, weight):
      weight = float_weight(weight)
      value, weight, value_clipped, weight_clipped = clip_to_bounds(value, weight, value_bound, weight_bound)
      normalized = weight / tf.constant(weight_bound, weight.dtype)
      weighted = tf.nest.map_structure(lambda x: x * tf.cast(normalized, x.dtype), value)
      return (weighted, normalized), (value_clipped, weight_clipped)

    @tff.tensorflow.computation(prepare.type_signature.result[0])
    def divide(sums):
      weighted_sum, weight_sum = sums
      return tf.nest.map_structure(lambda x: tf.math.divide_no_nan(x, tf.cast(weight_sum, x.dtype)), weighted_sum)

    @tff.federated_computation()
    def init_fn():
      return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      prepared = tff.federated_map(prepare, (value, weight))
      sums = tff.aggregators.secure_quantized_sum(prepared[0], bounds(-value_bound, 0.0), bounds(value_bound, 1.0))
      value_clipped, weight_clipped = secure_count(prepared[1])
      measurements = collections.OrderedDict(value_clipped_clients=value_clipped,
                                             weight_clipped_clients=weight_clipped)
      return tff.templates.MeasuredProcessOutput(
          state, tff.federated_map(divide, sums), tff.federated_zip(measurements))

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
  return SecureWeightedMeanFactory(value_bound, weight_bound)


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
