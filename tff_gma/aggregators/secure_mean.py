"""`SecureWeightedMeanFactory`: a weighted mean whose floats leave the clients only through secure sums.

GMA and RFA reduce to weighted means `sum_i a_i w_i / sum_i a_i` of client values `w_i` with client weights `a_i`;
with `secure=True` they take this one (`mean.weighted_mean_factory`; the plain one is `mean.FederatedMeanFactory`).
Every float leaves the clients only through `tff.federated_secure_sum_bitwidth`, by TFF's own quantized secure sum
(`tff.aggregators.secure_quantized_sum`, the primitive behind `tff.aggregators.SecureSumFactory` for floats). Each
client clips its weight to `[0, weight_bound]` and each coordinate of its value to `[-value_bound, value_bound]`
(both counted), and sends `u_i = a_i / weight_bound` in `[0, 1]` and `u_i w_i` in `[-value_bound, value_bound]`.
Normalizing the weight *before* multiplying is what keeps `u_i w_i` inside the value bound (TFF's `MeanFactory`
clips `a_i w_i` itself, so a client weight of 90 would clip an update of 0.02); the common factor
`1 / weight_bound` cancels in the division.

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

Weight dtypes. The clients cast a weight of any float or integer dtype to float before clipping and normalizing
it (`client_values.float_weight_dtype`), so the bounds logic is the same for every weight dtype.

Counting. Counts of clients (participating, dropped, clipped) are secure sums of 0/1 indicators with
`max_input=1`, in both modes: the server learns the counts, never which client they came from.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values

SECAGG_LEVELS = 2**32 - 1  # Quantization levels of TFF's float secure sum (`primitives.secure_quantized_sum`).
QUANTIZATION_SLACK = 1 + 1e-5  # Covers the float64 arithmetic of that quantization (module docstring: < 4e-6).


# ----------------------------------------------------------------------------------------------------------------
# Error bounds (NumPy).


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
  return tff.federated_secure_sum(indicators, 1)


# ----------------------------------------------------------------------------------------------------------------
# Factories.


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
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    value_bound, weight_bound = self._value_bound, self._weight_bound
    # Weights are clipped and normalized as floats (`client_values.float_weight`).
    weight_dtype = client_values.float_weight_dtype(weight_type.dtype)

    def bounds(bound_value, weight_limit):
      per_leaf = tff.types.structure_from_tensor_type_tree(
          lambda t: np.asarray(bound_value, np.dtype(t.dtype)), value_type)
      return per_leaf, np.asarray(weight_limit, weight_dtype)

    @tff.tensorflow.computation(value_type, weight_type)
    def prepare(value, weight):
      weight = client_values.float_weight(weight)
      value, weight, value_clipped, weight_clipped = client_values.clip_to_bounds(
          value, weight, value_bound, weight_bound)
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
