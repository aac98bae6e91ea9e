"""The secure weighted mean (`secure_mean`): its result within the documented error bound, its weights and types."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import mean
from tff_gma.aggregators import secure_mean
from tests.tff_gma.aggregators import aggregator_test_utils as utils

VALUE_TYPE = utils.NESTED_TYPE
WEIGHT_TYPE = tff.TensorType(np.float32)


def assert_within_documented_bound(result, values, weights, value_bound, weight_bound):
  """|result - m| <= `secure_mean.error_bound` in every coordinate, m the weighted mean of the clipped values."""
  clipped = np.clip(np.stack([utils.flat(v) for v in values]), -value_bound, value_bound)
  clipped_weights = np.minimum(np.asarray(weights, np.float64), weight_bound)
  expected = clipped_weights @ clipped / clipped_weights.sum()
  bound = secure_mean.error_bound(len(values), clipped_weights.sum(), value_bound, weight_bound, np.abs(expected),
                                  np.max(np.abs(clipped), axis=0))
  error = np.abs(utils.flat(result) - expected)
  assert np.all(error <= bound), f'error {error} above the documented bound {bound}'
  return expected, bound


def test_secure_mean_matches_reference_within_documented_bound():
  value_bound, weight_bound = 2.0, 10.0
  proc = secure_mean.SecureWeightedMeanFactory(value_bound, weight_bound).create(VALUE_TYPE, WEIGHT_TYPE)
  rng = np.random.default_rng(1)
  for n in (1, 3, 8):
    values, weights = utils.random_nested_values(rng, n, scale=0.5), [np.float32(w) for w in rng.uniform(1, 9, n)]
    output = proc.next(proc.initialize(), values, weights)
    expected, bound = assert_within_documented_bound(output.result, values, weights, value_bound, weight_bound)
    # The bound is far below the values' scale (float32 rounding dominates; quantization is below 1e-8) ...
    assert np.max(bound) < 2e-6
    assert secure_mean.discretization_error_bound(n, float(np.sum(weights)), value_bound, weight_bound,
                                                  float(np.max(np.abs(expected)))) < 1e-8
    # ... and tight enough to catch one client's weight off by 1e-4 (so the check above can fail).
    off = np.asarray(weights, np.float64) * np.where(np.arange(n) == 0, 1 + 1e-4, 1.0)
    points = np.stack([utils.flat(v) for v in values])
    if n > 1:
      assert np.any(np.abs(off @ points / off.sum() - expected) > bound)
    assert output.measurements['value_clipped_clients'] == 0
    assert output.measurements['weight_clipped_clients'] == 0
  # Out-of-bound values and weights are clipped (never wrap) and counted.
  values = utils.random_nested_values(rng, 3, scale=0.5)
  values[0]['a'][1] = np.float32(1e9)
  values[2]['b'][0][0, 0] = np.float32(-5.0)
  weights = [np.float32(1.0), np.float32(50.0), np.float32(2.0)]
  output = proc.next(proc.initialize(), values, weights)
  assert_within_documented_bound(output.result, values, weights, value_bound, weight_bound)
  assert output.measurements['value_clipped_clients'] == 2
  assert output.measurements['weight_clipped_clients'] == 1
  # Zero total weight: zeros.
  result = proc.next(proc.initialize(), utils.random_nested_values(rng, 2), [np.float32(0)] * 2).result
  np.testing.assert_array_equal(utils.flat(result), 0.0)


def test_float64_values_at_the_bound_are_not_clipped():
  """The clip bound is exactly `value_bound` in float64 (not `value_bound` rounded to float32)."""
  value_bound = 0.01  # Not a float32 number: float32(0.01) < 0.01.
  proc = secure_mean.SecureWeightedMeanFactory(value_bound, 1.0).create(
      tff.TensorType(np.float64, [3]), tff.TensorType(np.float64))
  values = [np.array([0.01, -0.01, 0.004]), np.array([0.002, 0.01, -0.01])]
  output = proc.next(proc.initialize(), values, [1.0, 1.0])
  assert output.measurements['value_clipped_clients'] == 0
  expected = np.mean(values, axis=0)
  bound = secure_mean.error_bound(2, 2.0, value_bound, 1.0, np.abs(expected), np.max(np.abs(values), axis=0),
                                  np.float64)
  assert np.all(np.abs(output.result - expected) <= bound)
  assert np.max(bound) < 1e-11  # Quantization only: float32 rounding of the bound would be 1e-10 off.


def test_secure_mean_equals_tff_mean_factory_with_secure_sums():
  """Same quantization as TFF's own composition, fed the normalized weights (as the module docstring claims)."""
  value_bound, weight_bound = 3.0, 8.0
  value_type = tff.TensorType(np.float32, [5])
  ours = secure_mean.SecureWeightedMeanFactory(value_bound, weight_bound).create(value_type, WEIGHT_TYPE)
  tffs = tff.aggregators.MeanFactory(
      tff.aggregators.SecureSumFactory(value_bound), tff.aggregators.SecureSumFactory(1.0, 0.0),
      no_nan_division=True).create(value_type, WEIGHT_TYPE)
  rng = np.random.default_rng(2)
  values = [np.float32(rng.normal(size=5)) for _ in range(6)]
  weights = [np.float32(w) for w in rng.uniform(1, 8, 6)]
  got = ours.next(ours.initialize(), values, weights).result
  want = tffs.next(tffs.initialize(), values, [np.float32(w / weight_bound) for w in weights]).result
  # The same float32 operations in the same order (weight / weight_bound, value * weight, the quantized sums,
  # the division): the same numbers.
  np.testing.assert_array_equal(got, want)


def test_error_bounds_are_the_documented_formulas():
  levels, slack = 2**32 - 1, secure_mean.QUANTIZATION_SLACK
  # s N (B + |m| / 2) / (L U - s N / 2); to first order N (B + |m| / 2) / (L U).
  quantization = secure_mean.discretization_error_bound(10, 1000.0, 1.0, 1e4, 0.5)
  assert quantization == pytest.approx(slack * 10 * 1.25 / (levels * 0.1 - slack * 10 / 2), rel=1e-12)
  assert quantization == pytest.approx(10 * 1.25 / (levels * 0.1), rel=2e-5)
  # It grows as weight_bound / sum a_i (up to the denominator's s N / 2, 1e-6 of L U at U = 0.001).
  assert (secure_mean.discretization_error_bound(10, 1000.0, 1.0, 1e6)
          == pytest.approx(100 * secure_mean.discretization_error_bound(10, 1000.0, 1.0, 1e4), rel=2e-6))
  assert secure_mean.discretization_error_bound(3, 0.0, 1.0, 1.0) == 0.0
  # error_bound: to first order the quantization plus eps (4 M + 6 |m|); the rest adds less than 1e-4 of it.
  eps = 2.0**-24
  total = secure_mean.error_bound(10, 1000.0, 1.0, 1e4, np.array([0.5, 0.0]), np.array([1.0, 0.3]))
  first_order = secure_mean.discretization_error_bound(10, 1000.0, 1.0, 1e4, np.array([0.5, 0.0])) + eps * (
      4 * np.array([1.0, 0.3]) + 6 * np.array([0.5, 0.0]))
  np.testing.assert_allclose(total, first_order, rtol=1e-4)
  assert np.all(total >= first_order)
  eps64 = 2.0**-53
  total64 = secure_mean.error_bound(10, 1000.0, 1.0, 1e4, 0.5, 1.0, np.float64)
  assert total64 == pytest.approx(quantization + eps64 * 7, rel=1e-4)


@pytest.mark.parametrize('kwargs,name', [
    (dict(value_bound=0.0), 'value_bound'), (dict(value_bound=float('nan')), 'value_bound'),
    (dict(value_bound=1.0, weight_bound=-2.0), 'weight_bound'), (dict(value_bound='1'), 'value_bound'),
])
def test_secure_mean_invalid_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    secure_mean.SecureWeightedMeanFactory(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types and weight dtypes (the plain mean's beside the secure one's).


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
def test_secure_mean_type_properties(weight_dtype):
  factory = secure_mean.SecureWeightedMeanFactory(1.0)
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  process = factory.create(utils.STRUCT_TYPE, tff.TensorType(weight_dtype))
  utils.assert_process_types(
      process, state_type=(), value_type=utils.STRUCT_TYPE, weight_type=tff.TensorType(weight_dtype),
      measurements_type=collections.OrderedDict(value_clipped_clients=np.int32, weight_clipped_clients=np.int32))


@functools.lru_cache(maxsize=None)
def _mean_process(secure, weight_dtype):
  factory = (secure_mean.SecureWeightedMeanFactory(2.0, 10.0) if secure
             else mean.FederatedMeanFactory())
  return factory.create(VALUE_TYPE, tff.TensorType(weight_dtype))


@pytest.mark.parametrize('weight_dtype', [np.int32, np.int64])
@pytest.mark.parametrize('secure', [False, True])
def test_int_weights_give_the_float32_result(secure, weight_dtype):
  """TFF's MeanFactory takes int weights; these do, cast to float32 on the clients: the same numbers."""
  rng = np.random.default_rng(4)
  values = utils.random_nested_values(rng, 5, scale=0.5)
  int_weights = [weight_dtype(w) for w in (3, 1, 9, 4, 0)]
  float_weights = [np.float32(w) for w in int_weights]
  got = _mean_process(secure, weight_dtype).next(_mean_process(secure, weight_dtype).initialize(), values,
                                                 int_weights)
  want = _mean_process(secure, np.float32).next(_mean_process(secure, np.float32).initialize(), values,
                                                float_weights)
  for g, w in zip(tf.nest.flatten(got.result), tf.nest.flatten(want.result)):
    np.testing.assert_array_equal(g, w)
  if secure:
    assert got.measurements == want.measurements


def test_secure_bounds_hold_for_narrow_int_weights():
  """Weights are clipped and normalized in float: a weight_bound no uint8 holds (1e4, which tf.cast to uint8 would
  wrap), and int16 weights above the bound, clipped and counted as float32 weights are."""
  rng = np.random.default_rng(5)
  values = utils.random_nested_values(rng, 3, scale=0.5)
  process = secure_mean.SecureWeightedMeanFactory(2.0, 1e4).create(VALUE_TYPE, tff.TensorType(np.uint8))
  weights = (3, 200, 7)
  output = process.next(process.initialize(), values, [np.uint8(w) for w in weights])
  assert output.measurements['weight_clipped_clients'] == 0
  assert_within_documented_bound(output.result, values, weights, 2.0, 1e4)
  process = secure_mean.SecureWeightedMeanFactory(2.0, 10.0).create(VALUE_TYPE, tff.TensorType(np.int16))
  weights = (1, 50, 2)
  got = process.next(process.initialize(), values, [np.int16(w) for w in weights])
  want = _mean_process(True, np.float32).next(_mean_process(True, np.float32).initialize(), values,
                                              [np.float32(w) for w in weights])
  for g, w in zip(tf.nest.flatten(got.result), tf.nest.flatten(want.result)):
    np.testing.assert_array_equal(g, w)
  assert got.measurements['weight_clipped_clients'] == 1
  assert_within_documented_bound(got.result, values, weights, 2.0, 10.0)


@pytest.mark.parametrize('weight_type', [
    tff.TensorType(np.bool_), tff.TensorType(np.complex64), tff.TensorType(np.float32, [2]),
    tff.TensorType(np.str_), tff.FederatedType(np.float32, tff.CLIENTS)])
def test_weight_types_refused(weight_type):
  for factory in (mean.FederatedMeanFactory(), secure_mean.SecureWeightedMeanFactory(1.0)):
    with pytest.raises(TypeError):
      factory.create(utils.FLOAT_TYPE, weight_type)
