"""`GeometricMedianFactory` against a NumPy reference of RFA (smoothed Weiszfeld, one-step RFA), in every mode."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma.aggregators import secure_mean

VALUE_TYPE = tff.to_type(collections.OrderedDict(
    a=tff.TensorType(np.float32, [2, 3]),
    b=[tff.TensorType(np.float32, [4]), tff.TensorType(np.float32, [])],
))
SHAPES = [(2, 3), (4,), ()]
DIM = 11
WEIGHT_TYPE = tff.TensorType(np.float32)
NU = 1e-6
VALUE_BOUND = 10.0
WEIGHT_BOUND = 4.0
RATIO = 1e3


def random_values(rng, num_clients, scale=1.0, center=0.0):
  def leaf(shape):
    return np.asarray(center + scale * rng.normal(size=shape), np.float32)

  return [collections.OrderedDict(a=leaf((2, 3)), b=[leaf((4,)), leaf(())]) for _ in range(num_clients)]


def random_weights(rng, num_clients):
  return [np.float32(w) for w in rng.uniform(0.5, 3.0, size=num_clients)]


def to_flat(value) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in tf.nest.flatten(value)])


def unflatten(vector):
  out, start = [], 0
  for shape in SHAPES:
    size = int(np.prod(shape))
    out.append(vector[start:start + size].reshape(shape))
    start += size
  return out


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference.


def rfa_reference(values, weights, num_passes, one_step=False, secure=False):
  """RFA in NumPy (float64): (flat estimate, objectives after each pass, smoothing of each reweighting pass).

  Weiszfeld: v_1 = weighted mean; v_{k+1} = sum b_i w_i / sum b_i with b_i = a_i / max(c, ||v_k - w_i||).
  One-step: a single pass with b_i = a_i / max(c, ||w_i||). c = nu; in secure mode c = max(nu, D / K) with D the
  weighted mean distance at the broadcast point, and values / weights clipped to their bounds first.
  Clients with a non-finite value or a non-finite/negative weight are left out.
  """
  points = np.stack([to_flat(v) for v in values])
  a = np.asarray(weights, np.float64)
  keep = np.all(np.isfinite(points), axis=1) & np.isfinite(a) & (a >= 0)
  points, a = points[keep], a[keep]
  if secure:
    points, a = np.clip(points, -VALUE_BOUND, VALUE_BOUND), np.minimum(a, WEIGHT_BOUND)

  def weighted_mean(x, w):
    return w @ x / w.sum() if w.sum() > 0 else np.zeros(x.shape[1:])

  def objective(v):
    return float(weighted_mean(np.linalg.norm(points - v, axis=1), a))

  def reweight(v):
    c = max(NU, objective(v) / RATIO) if secure else NU
    b = a / np.maximum(c, np.linalg.norm(points - v, axis=1))
    return weighted_mean(points, b), c

  if one_step:
    estimate, c = reweight(np.zeros(DIM))
    return estimate, [objective(estimate)], [c]
  estimate, objectives, smoothings = weighted_mean(points, a), [], []
  for _ in range(num_passes - 1):
    objectives.append(objective(estimate))
    estimate, c = reweight(estimate)
    smoothings.append(c)
  objectives.append(objective(estimate))
  return estimate, objectives, smoothings


def secure_tolerance(values, weights, num_passes, one_step):
  """Documented per-average discretization bound, summed over the passes, with a safety factor for propagation."""
  points = np.clip(np.stack([to_flat(v) for v in values]), -VALUE_BOUND, VALUE_BOUND)
  a = np.minimum(np.asarray(weights, np.float64), WEIGHT_BOUND)
  bound = secure_mean.discretization_error_bound(len(values), a.sum(), VALUE_BOUND, WEIGHT_BOUND, VALUE_BOUND)
  # A reweighting pass sends b'_i = a_i * c / max(c, d_i): the normalized total weight shrinks by about c / d_i.
  estimate = np.zeros(DIM) if one_step else a @ points / a.sum()
  for _ in range(1 if one_step else num_passes - 1):
    d = np.linalg.norm(points - estimate, axis=1)
    c = max(NU, float(a @ d / a.sum()) / RATIO)
    b = a * c / np.maximum(c, d)
    bound += secure_mean.discretization_error_bound(len(values), b.sum(), VALUE_BOUND, WEIGHT_BOUND, VALUE_BOUND)
    estimate = b @ points / b.sum()
  return 10 * bound + 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Processes, built once per configuration.


def process(num_passes=3, one_step=False, secure=False):
  return _process(num_passes, one_step, secure)  # One cache key per configuration, however it is spelled.


@functools.lru_cache(maxsize=None)
def _process(num_passes, one_step, secure):
  factory = aggregators.GeometricMedianFactory(
      num_passes=num_passes, smoothing=NU, one_step=one_step, secure=secure,
      value_bound=VALUE_BOUND if secure else None, weight_bound=WEIGHT_BOUND, max_weight_ratio=RATIO)
  return factory.create(VALUE_TYPE, WEIGHT_TYPE)


def run(proc, values, weights):
  output = proc.next(proc.initialize(), values, weights)
  return output.result, output.measurements


def check_against_reference(proc, values, weights, num_passes, one_step, secure):
  result, measurements = run(proc, values, weights)
  expected, objectives, smoothings = rfa_reference(values, weights, num_passes, one_step, secure)
  atol = secure_tolerance(values, weights, num_passes, one_step) if secure else 2e-6
  assert isinstance(result, collections.OrderedDict) and list(result) == ['a', 'b']
  for got, want in zip(tf.nest.flatten(result), unflatten(expected)):
    assert np.shape(got) == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=atol)
  np.testing.assert_allclose(measurements['objective'], objectives, rtol=1e-4, atol=atol)
  np.testing.assert_allclose(measurements['smoothing'], smoothings, rtol=1e-4)
  return result, measurements


@pytest.mark.parametrize('one_step', [False, True])
@pytest.mark.parametrize('secure', [False, True])
def test_matches_numpy_reference(secure, one_step):
  # Secure Weiszfeld with 2 passes: the same code paths as 3 (objective, smoothing, reweighting) for a third
  # less compilation; the default 3 passes are checked without secure sums.
  num_passes = 1 if one_step else (2 if secure else 3)
  proc = process(num_passes, one_step, secure)
  rng = np.random.default_rng(31 + secure + 2 * one_step)
  for num_clients in (1, 3, 7):
    values, weights = random_values(rng, num_clients, center=0.5), random_weights(rng, num_clients)
    _, measurements = check_against_reference(proc, values, weights, num_passes, one_step, secure)
    assert measurements['participating_clients'] == num_clients
    assert measurements['dropped_clients'] == 0
    assert measurements['value_clipped_clients'] == 0
    expected_calls = 2 * num_passes + (1 if one_step and secure else 0)
    assert measurements['aggregation_calls'] == expected_calls
    assert len(measurements['objective']) == num_passes


def test_weiszfeld_decreases_the_objective_and_differs_from_the_mean():
  rng = np.random.default_rng(41)
  values, weights = random_values(rng, 7), random_weights(rng, 7)
  values[6] = random_values(rng, 1, scale=20.0)[0]
  result, measurements = run(process(), values, weights)
  objective = measurements['objective']
  assert np.all(np.diff(objective) <= 1e-6) and objective[-1] < objective[0]
  mean = np.asarray(weights, np.float64) @ np.stack([to_flat(v) for v in values]) / np.sum(weights)
  assert np.linalg.norm(to_flat(result) - mean) > 0.5


def test_breakdown_forty_percent_far_outliers():
  """40% of clients send far-away updates (random directions, norm 1e3): the mean moves far, RFA barely moves."""
  rng = np.random.default_rng(43)
  honest = random_values(rng, 6, scale=0.1, center=1.0)
  outliers = random_values(rng, 4, scale=1e3 / np.sqrt(DIM))  # Norm about 1e3, random directions.
  values, weights = honest + outliers, [np.float32(1.0)] * 10
  honest_mean = np.mean([to_flat(v) for v in honest], axis=0)
  honest_spread = np.mean([np.linalg.norm(to_flat(v) - honest_mean) for v in honest])
  mean = np.mean([to_flat(v) for v in values], axis=0)

  assert np.linalg.norm(mean - honest_mean) > 100
  # With enough passes the estimate is inside the honest cluster (closer than a typical honest client).
  passes = 8
  proc = aggregators.GeometricMedianFactory(num_passes=passes).create(VALUE_TYPE, WEIGHT_TYPE)
  result, measurements = run(proc, values, weights)
  expected, _, _ = rfa_reference(values, weights, passes)
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-4, atol=1e-3)
  assert np.linalg.norm(to_flat(result) - honest_mean) < honest_spread
  assert np.all(np.diff(measurements['objective']) <= 1e-3)
  # The default budget of 3 passes already removes most of the outliers' pull.
  result, _ = run(process(), values, weights)
  assert np.linalg.norm(to_flat(result) - honest_mean) < np.linalg.norm(mean - honest_mean) / 5


def test_unweighted_factory_uses_unit_weights():
  proc = aggregators.UnweightedGeometricMedianFactory().create(VALUE_TYPE)
  values = random_values(np.random.default_rng(47), 5)
  output = proc.next(proc.initialize(), values)
  expected, objectives, _ = rfa_reference(values, [1.0] * 5, 3)
  np.testing.assert_allclose(to_flat(output.result), expected, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(output.measurements['objective'], objectives, rtol=1e-5)
  assert isinstance(aggregators.UnweightedGeometricMedianFactory(), tff.aggregators.UnweightedAggregationFactory)


def test_single_pass_with_a_tff_mean_factory_is_the_weighted_mean():
  """num_passes=1 is the weighted mean; an inner TFF factory composes (here TFF's plain MeanFactory)."""
  factory = aggregators.GeometricMedianFactory(
      num_passes=1, mean_factory=tff.aggregators.MeanFactory(no_nan_division=True))
  proc = factory.create(VALUE_TYPE, WEIGHT_TYPE)
  rng = np.random.default_rng(67)
  values, weights = random_values(rng, 4), random_weights(rng, 4)
  result, measurements = run(proc, values, weights)
  expected = np.asarray(weights, np.float64) @ np.stack([to_flat(v) for v in values]) / np.sum(weights)
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-5, atol=1e-6)
  assert measurements['smoothing'].shape == (0,)
  assert measurements['aggregation_calls'] == 2
  assert 'mean_value' in measurements['passes'][0]  # The inner factory's own measurements.


# ----------------------------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize('secure', [False, True])
def test_non_finite_clients_are_dropped_and_counted(secure):
  rng = np.random.default_rng(53)
  values, weights = random_values(rng, 6), random_weights(rng, 6)
  values[0]['b'][0][2] = np.float32(np.nan)
  values[3]['a'][1, 1] = np.float32(-np.inf)
  weights[5] = np.float32(-2.0)
  num_passes = 2 if secure else 3
  result, measurements = run(process(num_passes, False, secure), values, weights)
  assert np.all(np.isfinite(to_flat(result)))
  expected, objectives, _ = rfa_reference(values, weights, num_passes, secure=secure)
  clean = [v for i, v in enumerate(values) if i not in (0, 3, 5)]
  clean_weights = [w for i, w in enumerate(weights) if i not in (0, 3, 5)]
  atol = secure_tolerance(clean, clean_weights, num_passes, False) if secure else 2e-6
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-5, atol=atol)
  np.testing.assert_allclose(measurements['objective'], objectives, rtol=1e-4, atol=atol)
  assert measurements['dropped_clients'] == 3
  assert measurements['participating_clients'] == 3


@pytest.mark.parametrize('one_step', [False, True])
def test_round_without_weight_returns_zeros(one_step):
  rng = np.random.default_rng(59)
  proc = process(1 if one_step else 3, one_step, False)
  values = random_values(rng, 3)
  for v in values:
    v['b'][1] = np.float32(np.nan)
  result, measurements = run(proc, values, random_weights(rng, 3))
  np.testing.assert_array_equal(to_flat(result), 0.0)
  assert measurements['dropped_clients'] == 3
  assert np.all(np.isfinite(measurements['objective']))
  result, measurements = run(proc, random_values(rng, 3), [np.float32(0.0)] * 3)
  np.testing.assert_array_equal(to_flat(result), 0.0)
  assert measurements['participating_clients'] == 0


def test_secure_bounds_clip_and_count():
  rng = np.random.default_rng(61)
  values, weights = random_values(rng, 5), random_weights(rng, 5)
  values[1]['a'][0, 0] = np.float32(1e4)
  weights[2] = np.float32(50.0)
  result, measurements = run(process(2, False, True), values, weights)
  expected, _, _ = rfa_reference(values, weights, 2, secure=True)
  clipped = [tf.nest.map_structure(lambda x: np.clip(x, -VALUE_BOUND, VALUE_BOUND), v) for v in values]
  atol = secure_tolerance(clipped, weights, 2, False)
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-5, atol=atol)
  assert measurements['value_clipped_clients'] == 1
  assert measurements['weight_clipped_clients'] == 1


@pytest.mark.parametrize('kwargs,name', [
    (dict(num_passes=0), 'num_passes'), (dict(num_passes=2.5), 'num_passes'), (dict(num_passes=True), 'num_passes'),
    (dict(num_passes=3, one_step=True), 'num_passes'), (dict(smoothing=0.0), 'smoothing'),
    (dict(smoothing=float('nan')), 'smoothing'), (dict(one_step='no'), 'one_step'), (dict(secure=1), 'secure'),
    (dict(secure=True), 'value_bound'), (dict(value_bound=0.0), 'value_bound'),
    (dict(weight_bound=-1.0), 'weight_bound'), (dict(max_weight_ratio=1.0), 'max_weight_ratio'),
    (dict(mean_factory='mean'), 'mean_factory'),
])
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
  with pytest.raises(ValueError, match=name):
    aggregators.GeometricMedianFactory(**kwargs)


def test_defaults():
  factory = aggregators.GeometricMedianFactory()
  assert factory.num_passes == 3 and not factory.one_step and not factory.secure
  assert aggregators.GeometricMedianFactory(one_step=True).num_passes == 1
