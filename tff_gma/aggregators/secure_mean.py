"""`SecureWeightedMeanFactory`: a weighted mean whose floats leave the clients only through secure sums.

What GMA, RFA, Elastic and FedGMA use with `secure=True`: clients clip to the bounds, normalize their weight by
`weight_bound` before multiplying (so `u_i w_i` stays inside the value bound) and send both through TFF's quantized
secure sum. `discretization_error_bound` and `error_bound` bound the result's error (quantization, float rounding).
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values
from tff_gma.aggregators import context_check

SECAGG_LEVELS = 2**32 - 1  # Quantization levels of TFF's float secure sum (`primitives.secure_quantized_sum`).
QUANTIZATION_SLACK = 1 + 1e-5  # Covers the float64 arithmetic of that quantization (< 4e-6).


# ----------------------------------------------------------------------------------------------------------------
# Error bounds (NumPy).


def discretization_error_bound(
    num_clients: int, total_weight: float, value_bound: float, weight_bound: float, mean_abs=0.0,
):
  """Worst-case per-coordinate quantization error of `SecureWeightedMeanFactory`.

  `s N (B + |m| / 2) / (L U - s N / 2)`: the error of the mean if the secure sums' quantization were the only
  error (`error_bound` adds float rounding). Each client adds at most `B / L` to each coordinate of the values'
  sum and `1 / (2 L)` to the normalized weights' sum `U`, with `L = SECAGG_LEVELS` and `s = QUANTIZATION_SLACK`.

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

  Against the exact weighted mean `m` of the clipped values with the clipped weights; to first order
  `N (B + |m| / 2) / (L U) + eps (4 M + 6 |m|)`.
  With `U_f` the normalized total weight as the clients compute it (within `eps` of `U`), the perturbed sums'
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
    dtype: the coarser of the value's dtype and the weight's float dtype (`client_values.float_weight_dtype`),
      which sets `eps`: float32 unless both are float64.

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
  # Every factory of the library traces this while TFF builds its process: the one place to say, in one line, that
  # TFF's default context cannot run it (TFF's own error comes only from `next`, as a long gRPC error).
  context_check.warn_if_context_cannot_run('federated_secure_sum')
  return tff.federated_secure_sum(indicators, 1)


# ----------------------------------------------------------------------------------------------------------------
# Factories.


class SecureWeightedMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """Weighted mean whose floats leave the clients only through TFF's 32-bit quantized secure sum.

  Clients clip each coordinate of their value to `[-value_bound, value_bound]` and their weight a_i to
  `[0, weight_bound]`, normalize the weight first, u_i = a_i / weight_bound (so that u_i w_i stays inside the
  value bound; the factor cancels in the division), and send the pair `(u_i w_i, u_i)` to one
  `tff.aggregators.secure_quantized_sum`, with bounds `[-value_bound, value_bound]` for the weighted values and
  `[0, 1]` for the normalized weight; the server returns `sum u w / sum u` (zero when `sum u == 0`). A client with
  a non-finite value or a non-finite or negative weight sends zeros (`client_values.drop_invalid_clients`).

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
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    value_bound, weight_bound = self._value_bound, self._weight_bound
    # Weights are clipped and normalized as floats (`client_values.float_weight`).
    weight_dtype = client_values.float_weight_dtype(weight_type.dtype)

    # float16 and bfloat16 are quantized and summed as float32 (`client_values.compute_dtype`), and cast back.
    leaf_dtypes = [np.dtype(t.dtype) for t in client_values.tensor_types(value_type)]

    def bounds(bound_value, weight_limit):
      per_leaf = tff.types.structure_from_tensor_type_tree(
          lambda t: np.asarray(bound_value, client_values.compute_dtype(t.dtype)), value_type)
      return per_leaf, np.asarray(weight_limit, weight_dtype)

    @tff.tensorflow.computation(value_type, weight_type)
    def prepare(value, weight):
      value, weight, _ = client_values.drop_invalid_clients(value, weight)
      value = client_values.to_compute_dtypes(value)
      value, weight, value_clipped, weight_clipped = client_values.clip_to_bounds(
          value, weight, value_bound, weight_bound)
      normalized = weight / tf.constant(weight_bound, weight.dtype)
      weighted = tf.nest.map_structure(lambda x: x * tf.cast(normalized, x.dtype), value)
      return (weighted, normalized), (value_clipped, weight_clipped)

    @tff.tensorflow.computation(prepare.type_signature.result[0])
    def divide(sums):
      weighted_sum, weight_sum = sums
      means = tf.nest.map_structure(lambda x: tf.math.divide_no_nan(x, tf.cast(weight_sum, x.dtype)), weighted_sum)
      return client_values.cast_leaves(means, leaf_dtypes)

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
