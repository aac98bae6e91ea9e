"""`GeometricMedianFactory` against a NumPy reference of RFA (smoothed Weiszfeld, one-step RFA), in every mode."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma.aggregators import geometric_median
from tff_gma.aggregators import secure_mean
from tff_gma.aggregators import weiszfeld
from tests import tiers
from tests.tff_gma.aggregators import aggregator_test_utils as utils

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


class Reference(collections.namedtuple(
    'Reference', ['estimate', 'objectives', 'smoothings', 'pass_weights', 'client_weights', 'estimates',
                  'points'])):
  """NumPy RFA: flat estimate, objectives D(v_0), D(v_1), ..., smoothing c of each reweighting pass, the
  weights b'_i = a_i * c / max(c, d_i) each pass sends (a_i for the plain first pass), the a_i of the kept
  (in secure mode: clipped) clients, the iterates v_0 = 0, v_1, ..., v_R and the kept (clipped) points."""


def rfa_reference(values, weights, num_passes, one_step=False, secure=False, final_objective=False,
                  init=geometric_median.DEFAULT_INIT) -> Reference:
  """RFA in NumPy (float64), as the RFA paper's Algorithms 2 and 3 with the secure smoothing rule documented.

  Weiszfeld: v_1 = weighted mean; v_{k+1} = sum b_i w_i / sum b_i with b_i = a_i / max(c, ||v_k - w_i||).
  One-step: a single pass from v_0 = 0, b_i = a_i / max(c, ||w_i||). `init='zero'`: Weiszfeld whose first pass is
  that reweighting from v_0 = 0 instead of the weighted mean (one-step RFA = init 'zero' with one pass). c = nu; in
  secure mode the smoothing is known before its round: c = max(nu, D(v_{k-1}) / K) for the pass broadcasting v_k (the
  objective measured one round earlier; D(v_0) with v_0 = 0 for pass 2), and c = max(nu, B sqrt(n) / K) for one-step
  RFA; values and weights are clipped to their bounds first. Objectives: D(v) = sum a_i ||v - w_i|| / sum a_i at
  v_0 = 0 and at every broadcast estimate, plus at the result with `final_objective`. Clients with a non-finite value
  or a non-finite/negative weight are left out.
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

  def reweight(v, c):
    b = a * c / np.maximum(c, np.linalg.norm(points - v, axis=1))
    pass_weights.append(b)
    smoothings.append(c)
    return weighted_mean(points, b)

  zero = np.zeros(DIM)
  objectives, smoothings, pass_weights = [objective(zero)], [], []
  if one_step or init == 'zero':
    estimate = reweight(zero, max(NU, VALUE_BOUND * np.sqrt(DIM) / RATIO) if secure else NU)
  else:
    pass_weights.append(a)
    estimate = weighted_mean(points, a)
  estimates = [zero, estimate]
  for _ in range(num_passes - 1):
    c = max(NU, objectives[-1] / RATIO) if secure else NU
    objectives.append(objective(estimate))
    estimate = reweight(estimate, c)
    estimates.append(estimate)
  if final_objective:
    objectives.append(objective(estimate))
  return Reference(estimate, objectives, smoothings, pass_weights, a, estimates, points)


def secure_error_bounds(values, weights, num_passes, one_step=False, final_objective=False,
                        init=geometric_median.DEFAULT_INIT):
  """(estimate, objectives, smoothings) error bounds in secure mode: the propagation derived in the research record.

  Composed along the NumPy reference, step by step as docs/research/results.md#rfas-error-in-secure-mode derives
  it: the estimate's error e_k (a bound on the Euclidean norm of the error of v_k), each measured objective's and
  each smoothing's. Every secure mean's own error is `secure_mean.error_bound` with all the round's
  clients counted in N.
  """
  eps = weiszfeld.FLOAT32_ROUNDOFF
  reference = rfa_reference(values, weights, num_passes, one_step, secure=True, final_objective=final_objective,
                            init=init)
  points, a, estimates = reference.points, reference.client_weights, reference.estimates
  num_clients, max_abs = len(values), np.max(np.abs(reference.points), axis=0)
  distance_bound = weiszfeld.distance_bound(VALUE_BOUND, DIM)

  def objective_error(estimate, estimate_error):
    distances = np.linalg.norm(points - estimate, axis=1)
    distance_errors = weiszfeld.distance_error_bound(distances, estimate_error, DIM)
    moved = float(np.max(distance_errors))
    secure_error = secure_mean.error_bound(
        num_clients, a.sum(), distance_bound, WEIGHT_BOUND, a @ distances / a.sum() + moved,
        np.max(distances + distance_errors))
    return moved + float(secure_error), distance_errors

  def reweighted_pass(k, estimate_error, distance_errors, smoothing, smoothing_error):
    shift, least_total = weiszfeld.reweighting_error_bound(
        points, a, estimates[k - 1], estimates[k], smoothing, distance_errors, smoothing_error)
    secure_error = secure_mean.error_bound(num_clients, least_total, VALUE_BOUND, WEIGHT_BOUND,
                                           np.abs(estimates[k]) + shift, max_abs)
    return shift + float(np.linalg.norm(secure_error))

  objective_errors, smoothing_errors = [], []
  # Round 1: distances to v_0 = 0 (exact), D(v_0), and pass 1.
  error, distance_errors = objective_error(estimates[0], 0.0)
  objective_errors.append(error)
  if one_step or init == 'zero':  # A constant smoothing, rounded to float32.
    smoothing = reference.smoothings[0]
    smoothing_errors.append(eps * smoothing)
    estimate_error = reweighted_pass(1, 0.0, distance_errors, smoothing, smoothing_errors[-1])
  else:  # The weighted mean with the weights a_i.
    estimate_error = float(np.linalg.norm(secure_mean.error_bound(
        num_clients, a.sum(), VALUE_BOUND, WEIGHT_BOUND, np.abs(estimates[1]), max_abs)))
  # Rounds 2..R: distances to v_{k-1}, D(v_{k-1}), smoothing from D(v_{k-2}), pass k.
  for k in range(2, num_passes + 1):
    previous_objective, previous_error = reference.objectives[k - 2], objective_errors[k - 2]
    error, distance_errors = objective_error(estimates[k - 1], estimate_error)
    objective_errors.append(error)
    smoothing = reference.smoothings[len(smoothing_errors)]
    smoothing_errors.append(max(eps * NU, (previous_error + eps * (previous_objective + previous_error)) / RATIO))
    estimate_error = reweighted_pass(k, estimate_error, distance_errors, smoothing, smoothing_errors[-1])
  if final_objective:
    objective_errors.append(objective_error(estimates[num_passes], estimate_error)[0])
  return estimate_error, np.array(objective_errors), np.array(smoothing_errors)


# ----------------------------------------------------------------------------------------------------------------
# Processes, built once per configuration.


def process(num_passes=3, one_step=False, secure=False, final_objective=False, init=None):
  # One cache key per configuration, however it is spelled.
  return _process(num_passes, one_step, secure, final_objective, init)


@functools.lru_cache(maxsize=None)
def _process(num_passes, one_step, secure, final_objective, init):
  # The paper's smoothed Weiszfeld: with near_fraction 0 the smoothing is nu (or the secure floor) alone, no client
  # of these random federations lies within it, and Vardi-Zhang's step is Weiszfeld's (vardi_zhang_test.py tests
  # the near rule at the defaults).
  factory = aggregators.GeometricMedianFactory(
      num_passes=num_passes, smoothing=NU, one_step=one_step, secure=secure,
      value_bound=VALUE_BOUND if secure else None, weight_bound=WEIGHT_BOUND, max_weight_ratio=RATIO,
      report_final_objective=final_objective, init=init, near_fraction=0.0)
  return factory.create(VALUE_TYPE, WEIGHT_TYPE)


def run(proc, values, weights):
  output = proc.next(proc.initialize(), values, weights)
  return output.result, output.measurements


def assert_within_secure_bounds(result, measurements, values, weights, num_passes, one_step=False,
                                final_objective=False, init=geometric_median.DEFAULT_INIT):
  """Secure mode: estimate, objectives and smoothings within `secure_error_bounds` (nothing added to them)."""
  reference = rfa_reference(values, weights, num_passes, one_step, True, final_objective, init)
  estimate_bound, objective_bounds, smoothing_bounds = secure_error_bounds(
      values, weights, num_passes, one_step, final_objective, init)
  error = np.linalg.norm(to_flat(result) - reference.estimate)
  assert error <= estimate_bound, f'estimate error {error} above the propagated bound {estimate_bound}'
  objective_error = np.abs(np.asarray(measurements['objective'], np.float64) - reference.objectives)
  assert np.all(objective_error <= objective_bounds), (objective_error, objective_bounds)
  smoothing_error = np.abs(np.asarray(measurements['smoothing'], np.float64) - reference.smoothings)
  assert np.all(smoothing_error <= smoothing_bounds), (smoothing_error, smoothing_bounds)
  return estimate_bound


def check_against_reference(proc, values, weights, num_passes, one_step, secure, final_objective=False,
                            init=geometric_median.DEFAULT_INIT):
  result, measurements = run(proc, values, weights)
  reference = rfa_reference(values, weights, num_passes, one_step, secure, final_objective, init)
  assert isinstance(result, collections.OrderedDict) and list(result) == ['a', 'b']
  for got, want in zip(tf.nest.flatten(result), unflatten(reference.estimate)):
    assert np.shape(got) == want.shape
  if secure:
    assert_within_secure_bounds(result, measurements, values, weights, num_passes, one_step, final_objective, init)
  else:  # federated_mean in float32 against a float64 reference (no documented bound: a plain tolerance).
    np.testing.assert_allclose(to_flat(result), reference.estimate, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(measurements['objective'], reference.objectives, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(measurements['smoothing'], reference.smoothings, rtol=1e-4)
  return result, measurements


@pytest.mark.parametrize('one_step', [False, True])
@pytest.mark.parametrize('secure', [False, True])
def test_matches_numpy_reference(secure, one_step):
  # The paper's start (pass 1 the weighted mean; the zero start has its own test below). Secure Weiszfeld with 2
  # passes: the same code paths as 3 (objective, smoothing, reweighting) for a third less compilation; 3 passes
  # are checked without secure sums.
  num_passes = 1 if one_step else (2 if secure else 3)
  init = 'zero' if one_step else 'mean'
  proc = process(num_passes, one_step, secure, init=None if one_step else init)
  rng = np.random.default_rng(31 + secure + 2 * one_step)
  for num_clients in (1, 3, 7):
    values, weights = random_values(rng, num_clients, center=0.5), random_weights(rng, num_clients)
    _, measurements = check_against_reference(proc, values, weights, num_passes, one_step, secure, init=init)
    assert measurements['participating_clients'] == num_clients
    assert measurements['dropped_clients'] == 0
    assert measurements['value_clipped_clients'] == 0
    # One round per pass; the objectives are those of v_0 = 0, ..., v_{R-1}, measured along the way.
    assert measurements['aggregation_calls'] == num_passes
    assert len(measurements['objective']) == num_passes


# The fast tier: each pass count once and secure sums once (2 passes); the full suite adds secure with 3.
@pytest.mark.parametrize('secure,num_passes', tiers.cover_once(
    [(False, 2), (False, 3), (False, 5), (True, 2), (True, 3)], keys=[lambda c: c[0], lambda c: c[1]]))
def test_zero_start_matches_numpy_reference(secure, num_passes):
  """init='zero': pass 1 reweights from v_0 = 0 (one-step RFA), then Weiszfeld from there; R rounds for R passes."""
  proc = process(num_passes, False, secure, init='zero')
  rng = np.random.default_rng(83 + num_passes + 10 * secure)
  for num_clients in (1, 4, 7):
    values, weights = random_values(rng, num_clients, center=0.5), random_weights(rng, num_clients)
    if num_clients == 7:
      values[6] = random_values(rng, 1, scale=6.0)[0]
    _, measurements = check_against_reference(proc, values, weights, num_passes, False, secure, init='zero')
    assert measurements['aggregation_calls'] == num_passes
    assert len(measurements['objective']) == num_passes and len(measurements['smoothing']) == num_passes
    assert measurements['participating_clients'] == num_clients


@pytest.mark.parametrize('secure', [False, True])
def test_zero_start_with_one_pass_is_one_step_rfa(secure):
  rng = np.random.default_rng(89 + secure)
  values, weights = random_values(rng, 6, center=0.5), random_weights(rng, 6)
  result, measurements = run(process(1, False, secure, init='zero'), values, weights)
  one_step_result, one_step_measurements = run(process(1, True, secure), values, weights)
  for got, want in zip(tf.nest.flatten(result), tf.nest.flatten(one_step_result)):
    np.testing.assert_array_equal(got, want)
  for key in ('objective', 'smoothing', 'aggregation_calls', 'participating_clients'):
    np.testing.assert_array_equal(measurements[key], one_step_measurements[key])
  assert aggregators.GeometricMedianFactory(one_step=True).init == 'zero'


@pytest.mark.parametrize('secure', [False, True])
def test_final_objective_costs_one_round_and_leaves_the_estimate_unchanged(secure):
  num_passes = 2
  rng = np.random.default_rng(37 + secure)
  values, weights = random_values(rng, 5, center=0.5), random_weights(rng, 5)
  values[4] = random_values(rng, 1, scale=5.0)[0]
  with_final = process(num_passes, False, secure, final_objective=True)
  result, measurements = check_against_reference(
      with_final, values, weights, num_passes, False, secure, final_objective=True)
  assert measurements['aggregation_calls'] == num_passes + 1
  assert len(measurements['objective']) == num_passes + 1
  assert len(measurements['objectives']) == num_passes + 1
  if not secure:  # Same federated_mean calls in the same order: bit-identical estimates.
    plain_result, plain_measurements = run(process(num_passes, False, secure), values, weights)
    for got, want in zip(tf.nest.flatten(result), tf.nest.flatten(plain_result)):
      np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(measurements['objective'][:num_passes], plain_measurements['objective'])


def test_secure_smoothing_comes_from_the_previous_round():
  """Secure pass k >= 2 uses c = max(nu, D(v_{k-2}) / K): pass 2 the zero update's objective, pass 3 D(v_1).

  Pass 1 from the zero update reweights with the constant B sqrt(n) / K (as one-step RFA); from the mean it is
  the plain weighted mean, with no smoothing.
  """
  rng = np.random.default_rng(71)
  values, weights = random_values(rng, 6, center=2.0), random_weights(rng, 6)
  for init in ('mean', 'zero'):
    _, measurements = check_against_reference(process(3, False, True, init=init), values, weights, 3, False, True,
                                              init=init)
    objective, smoothing = measurements['objective'], measurements['smoothing']
    if init == 'zero':
      np.testing.assert_allclose(smoothing[0], VALUE_BOUND * np.sqrt(DIM) / RATIO, rtol=1e-6)
      smoothing = smoothing[1:]
    np.testing.assert_allclose(smoothing, np.maximum(NU, objective[:2] / RATIO), rtol=1e-6)
    assert smoothing[0] > smoothing[1]  # D(0) > D(v_1): the updates share a common part (center 2).
  # One-step RFA: a constant known before its round, B sqrt(n) / K.
  _, measurements = run(process(1, True, True), values, weights)
  np.testing.assert_allclose(measurements['smoothing'], [VALUE_BOUND * np.sqrt(DIM) / RATIO], rtol=1e-6)


def test_weiszfeld_decreases_the_objective_and_differs_from_the_mean():
  rng = np.random.default_rng(41)
  values, weights = random_values(rng, 7), random_weights(rng, 7)
  values[6] = random_values(rng, 1, scale=20.0)[0]
  result, measurements = run(process(final_objective=True), values, weights)
  # D(v_1), D(v_2), D(v_3): each Weiszfeld pass decreases the objective, from whichever start.
  objective = measurements['objective'][1:]
  assert np.all(np.diff(objective) <= 1e-6) and objective[-1] < objective[0]
  mean = np.asarray(weights, np.float64) @ np.stack([to_flat(v) for v in values]) / np.sum(weights)
  assert np.linalg.norm(to_flat(result) - mean) > 0.5


def test_breakdown_forty_percent_far_outliers_zero_start():
  """The same 40% far outliers: from the zero update, the default 3 passes already land inside the honest cluster.

  From the mean (the test above) 3 passes leave the estimate 14.6 from the honest mean (it starts 193 away); from
  v_0 = 0 the outliers, far from it, get weights ~1/1000 from pass 1 on.
  """
  rng = np.random.default_rng(43)
  honest = random_values(rng, 6, scale=0.1, center=1.0)
  outliers = random_values(rng, 4, scale=1e3 / np.sqrt(DIM))
  values, weights = honest + outliers, [np.float32(1.0)] * 10
  honest_mean = np.mean([to_flat(v) for v in honest], axis=0)
  honest_spread = np.mean([np.linalg.norm(to_flat(v) - honest_mean) for v in honest])
  errors = {}
  for init in ('mean', 'zero'):
    result, _ = check_against_reference(process(3, init=init), values, weights, 3, False, False, init=init)
    errors[init] = np.linalg.norm(to_flat(result) - honest_mean)
  assert errors['zero'] < honest_spread < errors['mean']
  secure_result, _ = check_against_reference(process(3, secure=True, init='zero'), values, weights, 3, False, True,
                                             init='zero')
  assert np.linalg.norm(to_flat(secure_result) - honest_mean) < honest_spread  # Outliers clipped at 10 there.


def test_breakdown_forty_percent_far_outliers():
  """40% of clients send far-away updates (random directions, norm 1e3): the mean moves far, RFA barely moves.

  Here from the default start; the test above compares both starts at the default 3 passes.
  """
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
  expected = rfa_reference(values, weights, passes).estimate
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-4, atol=1e-3)
  assert np.linalg.norm(to_flat(result) - honest_mean) < honest_spread
  assert np.all(np.diff(measurements['objective'][1:]) <= 1e-3)  # D(v_1) >= D(v_2) >= ... >= D(v_7).
  assert measurements['aggregation_calls'] == passes
  # The default budget of 3 passes already removes most of the outliers' pull.
  result, _ = run(process(), values, weights)
  assert np.linalg.norm(to_flat(result) - honest_mean) < np.linalg.norm(mean - honest_mean) / 5


def test_unweighted_factory_uses_unit_weights():
  proc = aggregators.UnweightedGeometricMedianFactory().create(VALUE_TYPE)
  values = random_values(np.random.default_rng(47), 5)
  output = proc.next(proc.initialize(), values)
  reference = rfa_reference(values, [1.0] * 5, 3)
  np.testing.assert_allclose(to_flat(output.result), reference.estimate, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(output.measurements['objective'], reference.objectives, rtol=1e-5)
  assert isinstance(aggregators.UnweightedGeometricMedianFactory(), tff.aggregators.UnweightedAggregationFactory)


def test_single_pass_with_a_tff_mean_factory_is_the_weighted_mean():
  """num_passes=1 from the mean is the weighted mean; an inner TFF factory composes (TFF's plain MeanFactory)."""
  factory = aggregators.GeometricMedianFactory(
      num_passes=1, init='mean', mean_factory=tff.aggregators.MeanFactory(no_nan_division=True))
  proc = factory.create(VALUE_TYPE, WEIGHT_TYPE)
  rng = np.random.default_rng(67)
  values, weights = random_values(rng, 4), random_weights(rng, 4)
  result, measurements = run(proc, values, weights)
  expected = np.asarray(weights, np.float64) @ np.stack([to_flat(v) for v in values]) / np.sum(weights)
  np.testing.assert_allclose(to_flat(result), expected, rtol=1e-5, atol=1e-6)
  assert measurements['smoothing'].shape == (0,)
  assert measurements['aggregation_calls'] == 1
  np.testing.assert_allclose(  # D(v_0): the zero update's objective, the weighted mean norm.
      measurements['objective'], [np.average([np.linalg.norm(to_flat(v)) for v in values], weights=weights)],
      rtol=1e-5)
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
  reference = rfa_reference(values, weights, num_passes, secure=secure)
  clean = [v for i, v in enumerate(values) if i not in (0, 3, 5)]
  clean_weights = [w for i, w in enumerate(weights) if i not in (0, 3, 5)]
  np.testing.assert_allclose(reference.estimate, rfa_reference(clean, clean_weights, num_passes, secure=secure)[0])
  if secure:
    assert_within_secure_bounds(result, measurements, values, weights, num_passes)
  else:
    np.testing.assert_allclose(to_flat(result), reference.estimate, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(measurements['objective'], reference.objectives, rtol=1e-5, atol=2e-6)
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
  assert_within_secure_bounds(result, measurements, values, weights, 2)
  assert measurements['value_clipped_clients'] == 1
  assert measurements['weight_clipped_clients'] == 1


@pytest.mark.parametrize('kwargs,name', [
    (dict(num_passes=0), 'num_passes'), (dict(num_passes=2.5), 'num_passes'), (dict(num_passes=True), 'num_passes'),
    (dict(num_passes=3, one_step=True), 'num_passes'), (dict(smoothing=0.0), 'smoothing'),
    (dict(smoothing=float('nan')), 'smoothing'), (dict(one_step='no'), 'one_step'), (dict(secure=1), 'secure'),
    (dict(secure=True), 'value_bound'), (dict(value_bound=0.0), 'value_bound'),
    (dict(weight_bound=-1.0), 'weight_bound'), (dict(max_weight_ratio=1.0), 'max_weight_ratio'),
    (dict(mean_factory='mean'), 'mean_factory'), (dict(report_final_objective=1), 'report_final_objective'),
    (dict(init='median'), 'init'), (dict(one_step=True, init='mean'), 'init'),
])
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
  with pytest.raises(ValueError, match=name):
    aggregators.GeometricMedianFactory(**kwargs)


def test_defaults():
  factory = aggregators.GeometricMedianFactory()
  assert factory.num_passes == 3 and not factory.one_step and not factory.secure
  assert not factory.report_final_objective and factory.num_rounds == 3
  assert aggregators.GeometricMedianFactory(num_passes=2, report_final_objective=True).num_rounds == 3
  assert aggregators.GeometricMedianFactory(one_step=True).num_passes == 1
  assert factory.init == 'zero'  # Measured: see geometric_median.DEFAULT_INIT.


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types, an inner factory's state and measurements, weight dtypes.

CLIP_COUNTS = collections.OrderedDict(value_clipped_clients=np.int32, weight_clipped_clients=np.int32)


def rfa_types(num_passes, num_rounds, num_smoothings, pass_type, objective_type):
  """(state, measurements) types: per pass the inner process's state/measurements and the spread mean's (typed as the
  objective's: the same kind of mean), per round the objective's, and the median distance kept in the state."""
  state = collections.OrderedDict(passes=(pass_type[0],) * num_passes,
                                  objectives=(objective_type[0],) * num_rounds,
                                  spreads=(objective_type[0],) * num_passes, scale=np.float32)
  measurements = collections.OrderedDict(
      objective=tff.TensorType(np.float32, [num_rounds]), smoothing=tff.TensorType(np.float32, [num_smoothings]),
      aggregation_calls=np.int32, participating_clients=np.int32, dropped_clients=np.int32,
      value_clipped_clients=np.int32, weight_clipped_clients=np.int32,
      nonfinite_passes=np.int32, near_weight=tff.TensorType(np.float32, [num_smoothings]), stalled_passes=np.int32,
      nonfinite_result=np.int32, zero_result=np.int32,
      passes=(pass_type[1],) * num_passes, objectives=(objective_type[1],) * num_rounds,
      spreads=(objective_type[1],) * num_passes)
  return state, measurements


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties(value_type, weight_dtype):
  factory = aggregators.GeometricMedianFactory()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  state, measurements = rfa_types(3, 3, 3, ((), ()), ((), ()))  # From the zero start every pass reweights.
  utils.assert_process_types(factory.create(value_type, weight_type), state_type=state, value_type=value_type,
                             weight_type=weight_type, measurements_type=measurements)


@pytest.mark.parametrize('kwargs,num_passes,num_rounds,num_smoothings', [
    (dict(one_step=True), 1, 1, 1),
    (dict(num_passes=2, report_final_objective=True), 2, 3, 2),
    (dict(num_passes=2, init='mean'), 2, 2, 1),  # Pass 1 is the plain weighted mean: no smoothing.
])
def test_type_properties_of_other_budgets(kwargs, num_passes, num_rounds, num_smoothings):
  weight_type = tff.TensorType(np.int32)
  state, measurements = rfa_types(num_passes, num_rounds, num_smoothings, ((), ()), ((), ()))
  utils.assert_process_types(aggregators.GeometricMedianFactory(**kwargs).create(utils.STRUCT_TYPE, weight_type),
                             state_type=state, value_type=utils.STRUCT_TYPE, weight_type=weight_type,
                             measurements_type=measurements)


@pytest.mark.parametrize('weight_dtype', [np.float32, np.int32])
def test_type_properties_secure(weight_dtype):
  weight_type = tff.TensorType(weight_dtype)
  process = aggregators.GeometricMedianFactory(num_passes=2, secure=True, value_bound=1.0).create(
      utils.STRUCT_TYPE, weight_type)
  state, measurements = rfa_types(2, 2, 2, ((), CLIP_COUNTS), ((), CLIP_COUNTS))
  utils.assert_process_types(process, state_type=state, value_type=utils.STRUCT_TYPE, weight_type=weight_type,
                             measurements_type=measurements)


@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties_unweighted(value_type):
  factory = aggregators.UnweightedGeometricMedianFactory()
  assert isinstance(factory, tff.aggregators.UnweightedAggregationFactory)
  state, measurements = rfa_types(3, 3, 3, ((), ()), ((), ()))
  utils.assert_process_types(factory.create(value_type), state_type=state, value_type=value_type, weight_type=None,
                             measurements_type=measurements)


@pytest.mark.parametrize('weighted', [True, False])
def test_inner_factory_state_and_measurements_pass_through(weighted):
  """Each pass has its own inner process: its state in state['passes'][k] (incremented by every next), its
  measurements in measurements['passes'][k]."""
  inner = utils.WeightedMeanPlusOneFactory()
  if weighted:
    weight_type = tff.TensorType(np.int64)
    process = aggregators.GeometricMedianFactory(mean_factory=inner).create(utils.STRUCT_TYPE, weight_type)
  else:
    weight_type = None
    process = aggregators.UnweightedGeometricMedianFactory(mean_factory=inner).create(utils.STRUCT_TYPE)
  state_type, measurements_type = rfa_types(3, 3, 3, (np.int32, np.int32), ((), ()))
  utils.assert_process_types(process, state_type=state_type, value_type=utils.STRUCT_TYPE, weight_type=weight_type,
                             measurements_type=measurements_type)
  state = process.initialize()
  assert tuple(state['passes']) == (0, 0, 0)
  values = [(np.array([1.0, 2.0], np.float32), 3.0), (np.array([3.0, -2.0], np.float32), 5.0),
            (np.array([0.5, 0.0], np.float32), -1.0)]
  weights = [[np.int64(w) for w in (1, 3, 2)]] if weighted else []
  output = process.next(state, values, *weights)
  assert tuple(output.state['passes']) == (1, 1, 1)
  assert tuple(output.measurements['passes']) == (utils.MEASUREMENT_CONSTANT,) * 3
  assert tuple(process.next(output.state, values, *weights).state['passes']) == (2, 2, 2)


def test_single_pass_returns_the_inner_result():
  """num_passes=1 from the mean: the result is the inner process's (the weighted mean plus one)."""
  process = aggregators.GeometricMedianFactory(
      num_passes=1, init='mean', mean_factory=utils.WeightedMeanPlusOneFactory()).create(
          utils.STRUCT_TYPE, tff.TensorType(np.int32))
  values = [(np.array([1.0, 2.0], np.float32), 3.0), (np.array([3.0, -2.0], np.float32), 5.0)]
  output = process.next(process.initialize(), values, [np.int32(1), np.int32(3)])
  np.testing.assert_allclose(output.result[0], [3.5, 0.0], rtol=1e-6)
  assert output.result[1] == pytest.approx(5.5)


@functools.lru_cache(maxsize=None)
def _weighted_process(secure, weight_dtype):
  factory = aggregators.GeometricMedianFactory(
      num_passes=2, smoothing=NU, secure=secure, value_bound=VALUE_BOUND if secure else None,
      weight_bound=WEIGHT_BOUND, max_weight_ratio=RATIO)
  return factory.create(VALUE_TYPE, tff.TensorType(weight_dtype))


# The fast tier: each dtype and each mode once; the full suite adds secure sums with int64 weights.
@pytest.mark.parametrize('secure, weight_dtype', tiers.cover_once(
    [(False, np.int32), (False, np.int64), (True, np.int32), (True, np.int64)],
    keys=[lambda c: c[0], lambda c: c[1]], ids=lambda c: f'{c[0]}-{c[1].__name__}'))
def test_int_weights_give_the_float32_result(secure, weight_dtype):
  rng = np.random.default_rng(97)
  values = random_values(rng, 5, center=0.5)
  int_weights = [weight_dtype(w) for w in (2, 1, 7, 0, 3)]  # Weight 7 is above WEIGHT_BOUND: clipped in secure mode.
  got = run(_weighted_process(secure, weight_dtype), values, int_weights)
  want = run(_weighted_process(secure, np.float32), values, [np.float32(w) for w in int_weights])
  for g, w in zip(tf.nest.flatten(got[0]), tf.nest.flatten(want[0])):
    np.testing.assert_array_equal(g, w)
  for key in ('objective', 'smoothing', 'participating_clients', 'weight_clipped_clients'):
    np.testing.assert_array_equal(got[1][key], want[1][key])


@pytest.mark.parametrize('init', ['mean', 'zero'])
def test_empty_cohort_returns_a_zero_update(init):
  result, measurements = run(process(3, init=init), [], [])
  np.testing.assert_array_equal(to_flat(result), 0.0)
  assert measurements['participating_clients'] == 0


def test_updates_whose_norm_overflows_are_dropped_and_counted():
  rng = np.random.default_rng(97)
  values, weights = random_values(rng, 4, center=0.5), random_weights(rng, 4)
  values[1] = tf.nest.map_structure(lambda x: np.full_like(x, 3e38), values[1])  # Finite; norm overflows.
  result, measurements = run(process(3), values, weights)
  assert measurements['dropped_clients'] == 1 and measurements['participating_clients'] == 3
  kept = [v for i, v in enumerate(values) if i != 1]
  kept_weights = [w for i, w in enumerate(weights) if i != 1]
  np.testing.assert_allclose(to_flat(result), rfa_reference(kept, kept_weights, 3).estimate, rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------------------------------------------------------
# Inner means that quantize, and narrow float dtypes: the median, not zeros, infinities or float16's subnormals.

REPRODUCER_VALUES = [np.array([.1, -.2, .3], np.float32), np.array([.2, .1, 0.], np.float32),
                     np.array([.5, .5, .5], np.float32)]
REPRODUCER_WEIGHTS = [16., 20., 5.]


def _numpy_median(values, weights, num_passes=3):
  from tests.methods_reference import numpy_reference  # pylint: disable=g-import-not-at-top
  points = np.stack([np.asarray(v, np.float64) for v in values])
  return numpy_reference.geometric_median(points, np.asarray(weights, np.float64), num_passes, 'zero', NU)


def _quantized_mean_tolerance(points, weights, steps_per_client: float) -> float:
  """Per coordinate, 3 passes: N quantization steps of the inner mean's sums over the least pass weight sum.

  A pass's inner mean adds at most one step per client to the weighted values' sum and to the weights' sum
  (`steps_per_client` = step of the values + |mean| x step of the weights, in units of the weights given); the
  floored smoothing keeps every weight above a_i c / d_i with c = D(0) / 1e3; the Weiszfeld map's slope near
  these well-spread points is below 2, so 3 passes add at most 1 + 2 + 4 pass errors.
  """
  smoothing = np.sum(weights * np.linalg.norm(points, axis=1)) / np.sum(weights) / 1e3
  # Every estimate lies in the points' hull (or is v_0 = 0), so no distance exceeds this.
  farthest = max(np.max(np.linalg.norm(points[:, None] - points[None], axis=2)), np.max(np.linalg.norm(points, axis=1)))
  least_total = np.sum(weights * smoothing / farthest)
  return 7 * len(points) * steps_per_client / least_total


def test_rfa_with_a_secure_inner_mean_is_the_median():
  """`SecureWeightedMeanFactory` as the inner mean: the Weiszfeld weights a_i nu / d_i (about 1e-5 here) times the
  values were below its quantization step, and the median came back as zeros."""
  process = aggregators.GeometricMedianFactory(
      mean_factory=aggregators.SecureWeightedMeanFactory(value_bound=8.0)).create(
          tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))
  output = process.next(process.initialize(), REPRODUCER_VALUES, REPRODUCER_WEIGHTS)
  expected = _numpy_median(REPRODUCER_VALUES, REPRODUCER_WEIGHTS)
  points, weights = np.stack(REPRODUCER_VALUES).astype(np.float64), np.asarray(REPRODUCER_WEIGHTS)
  # The mean's sums quantize u_i w_i in [-8, 8] and u_i = b_i / 1e4 in [0, 1] with 2^32 - 1 levels.
  steps = (16.0 / (2**32 - 1) + 0.5 / (2**32 - 1)) * 1e4
  np.testing.assert_allclose(output.result, expected, atol=_quantized_mean_tolerance(points, weights, steps))
  assert output.measurements['zero_result'] == 0 and output.measurements['nonfinite_passes'] == 0
  assert output.measurements['aggregation_calls'] == 4  # The zero start's D(0) has a round of its own.


def test_rfa_with_tff_secure_aggregator_is_the_median():
  """TFF's `secure_aggregator` as the inner mean: its weight sum quantizes [0, 2^20 - 1] to 32 bits, which lost
  the Weiszfeld weights (0 / 0 = inf came back)."""
  process = aggregators.GeometricMedianFactory(
      mean_factory=tff.learning.secure_aggregator(zeroing=False, clipping=False)).create(
          tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))
  output = process.next(process.initialize(), REPRODUCER_VALUES, REPRODUCER_WEIGHTS)
  expected = _numpy_median(REPRODUCER_VALUES, REPRODUCER_WEIGHTS)
  points, weights = np.stack(REPRODUCER_VALUES).astype(np.float64), np.asarray(REPRODUCER_WEIGHTS)
  # Values sum over [-100, 100] (the first call's bound: the initial estimate 50 times the multiplier 2), weights
  # over [0, 2^20 - 1], 32-bit levels.
  steps = 200.0 / (2**32 - 1) + 0.5 * (2**20 - 1) / (2**32 - 1)
  np.testing.assert_allclose(output.result, expected, atol=_quantized_mean_tolerance(points, weights, steps))
  assert np.all(np.isfinite(output.result))


def test_an_inner_mean_that_returns_inf_never_reaches_the_result():
  """TFF's `MeanFactory` divides by a zero weight sum into inf/NaN: the pass keeps the estimate before it, and the
  result is finite, its measurements saying so."""
  process = aggregators.GeometricMedianFactory(mean_factory=tff.aggregators.MeanFactory()).create(
      tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))
  output = process.next(process.initialize(), REPRODUCER_VALUES, [0., 0., 0.])
  np.testing.assert_array_equal(output.result, np.zeros(3, np.float32))
  assert output.measurements['nonfinite_passes'] == 3
  assert output.measurements['nonfinite_result'] == 0  # Each pass was replaced; the result itself is finite.


@pytest.mark.parametrize('dtype', [np.float16, tf.bfloat16.as_numpy_dtype], ids=['float16', 'bfloat16'])
def test_narrow_floats_are_averaged_in_float32(dtype):
  """One-step RFA on float16 was 2% off: its weights a_i nu / ||w_i|| (1e-6 here) are float16 subnormals."""
  rng = np.random.default_rng(5)
  values = [np.asarray(rng.normal(size=4), dtype) for _ in range(6)]
  weights = [float(w) for w in rng.integers(1, 5, size=6)]
  process = aggregators.GeometricMedianFactory(one_step=True).create(
      tff.TensorType(dtype, [4]), tff.TensorType(np.float32))
  output = process.next(process.initialize(), values, weights)
  assert np.asarray(output.result).dtype == np.dtype(dtype)
  from tests.methods_reference import numpy_reference  # pylint: disable=g-import-not-at-top
  points = np.stack([np.asarray(v, np.float64) for v in values])
  expected = numpy_reference.one_step_rfa(points, np.asarray(weights), NU)
  # The float32 arithmetic is exact to ~1e-6; the cast back rounds once, half a unit in the last place.
  half_ulp = 2.0**-11 if dtype == np.float16 else 2.0**-8  # 10 and 7 stored significand bits.
  np.testing.assert_allclose(np.asarray(output.result, np.float64), expected,
                             atol=1e-5, rtol=half_ulp * 1.01)
