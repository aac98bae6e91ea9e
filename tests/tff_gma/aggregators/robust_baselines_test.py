"""Non-private robust baselines (coordinate-wise median, trimmed mean, multi-Krum) against NumPy references."""

import collections
import math

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import audit
from tff_gma.aggregators import robust_baselines
from tests import tiers
from tests.tff_gma.aggregators import aggregator_test_utils as utils

_VALUE_TYPE = tff.to_type(collections.OrderedDict(
    kernel=tff.TensorType(np.float32, [3, 2]), bias=tff.TensorType(np.float32, [4])))


# ----------------------------------------------------------------------------------------- NumPy references


def _np_median(points):
  return np.median(points, axis=0)


def _np_trimmed_mean(points, beta):
  n = len(points)
  k = min(int(np.floor(beta * n + 0.5)), (n - 1) // 2)
  ordered = np.sort(points, axis=0)
  return ordered[k:n - k].mean(axis=0)


def _np_multi_krum(points, weights, beta, num_selected=None):
  n = len(points)
  f = int(np.floor(beta * n + 0.5))
  neighbours = min(max(n - f - 2, 1), max(n - 1, 1))
  scores = []
  for i in range(n):
    others = sorted(float(np.sum((points[i] - points[j]) ** 2)) for j in range(n) if j != i)
    scores.append(sum(others[:neighbours]))
  m = min(max(n - f, 1) if num_selected is None else num_selected, n)
  chosen = np.argsort(scores, kind='stable')[:m]
  w = np.asarray(weights, np.float64)[chosen]
  return (points[chosen] * w[:, None]).sum(axis=0) / w.sum()


def _structure(flat):
  return collections.OrderedDict(kernel=flat[:6].reshape(3, 2).astype(np.float32), bias=flat[6:].astype(np.float32))


def _flat(value):
  return np.concatenate([np.asarray(value['kernel']).ravel(), np.asarray(value['bias']).ravel()])


def _run(factory, points, weights):
  process = factory.create(_VALUE_TYPE, tff.TensorType(np.float32))
  output = process.next(process.initialize(), [_structure(p) for p in points], list(np.asarray(weights, np.float32)))
  return _flat(output.result), output.measurements


_FACTORIES = {
    'median': (lambda: robust_baselines.CoordinateMedianFactory(), lambda p, w: _np_median(p)),
    'trimmed_mean': (lambda: robust_baselines.TrimmedMeanFactory(0.25), lambda p, w: _np_trimmed_mean(p, 0.25)),
    'krum': (lambda: robust_baselines.MultiKrumFactory(0.25), lambda p, w: _np_multi_krum(p, w, 0.25)),
    'krum_single': (lambda: robust_baselines.MultiKrumFactory(0.2, num_selected=1),
                    lambda p, w: _np_multi_krum(p, w, 0.2, 1)),
}


@pytest.mark.parametrize('name', list(_FACTORIES))
@pytest.mark.parametrize('n', [1, 2, 5, 8])
def test_matches_numpy_reference(name, n):
  rng = np.random.default_rng(n)
  points = rng.normal(size=(n, 10)).astype(np.float32)
  weights = rng.uniform(1, 5, size=n).astype(np.float32)
  build, reference = _FACTORIES[name]
  result, measurements = _run(build(), points, weights)
  np.testing.assert_allclose(result, reference(points.astype(np.float64), weights), rtol=1e-5, atol=1e-6)
  assert measurements['participating_clients'] == n and measurements['dropped_clients'] == 0


@pytest.mark.parametrize('name', list(_FACTORIES))
def test_clients_with_zero_weight_or_non_finite_update_are_dropped(name):
  rng = np.random.default_rng(0)
  points = rng.normal(size=(6, 10)).astype(np.float32)
  weights = np.array([1, 2, 0, 3, 1, 2], np.float32)
  points[4, 3] = np.nan
  build, reference = _FACTORIES[name]
  result, measurements = _run(build(), points, weights)
  keep = [0, 1, 3, 5]
  np.testing.assert_allclose(result, reference(points[keep].astype(np.float64), weights[keep]), rtol=1e-5,
                             atol=1e-6)
  assert measurements['participating_clients'] == 4 and measurements['dropped_clients'] == 2


@pytest.mark.parametrize('name', list(_FACTORIES))
def test_no_clients_gives_zeros(name):
  result, measurements = _run(_FACTORIES[name][0](), np.zeros([2, 10], np.float32), [0.0, 0.0])
  np.testing.assert_array_equal(result, np.zeros(10))
  assert measurements['participating_clients'] == 0


@pytest.mark.parametrize('name', ['median', 'trimmed_mean', 'krum'])
def test_robust_to_a_minority_of_outliers_where_the_mean_is_not(name):
  rng = np.random.default_rng(3)
  honest = rng.normal(0, 0.1, size=(6, 10)).astype(np.float32)
  outliers = np.full((2, 10), 100.0, np.float32)
  points, weights = np.concatenate([honest, outliers]), np.ones(8, np.float32)
  result, _ = _run(_FACTORIES[name][0](), points, weights)
  assert np.abs(result).max() < 0.5
  assert np.abs(points.mean(axis=0)).min() > 20  # The mean is dragged away.


def test_trimmed_mean_and_krum_measurements():
  points = np.arange(50, dtype=np.float32).reshape(5, 10)
  _, trimmed = _run(robust_baselines.TrimmedMeanFactory(0.25), points, np.ones(5))
  assert trimmed['trimmed_per_side'] == 1  # round(1.25) = 1
  _, krum = _run(robust_baselines.MultiKrumFactory(0.25), points, np.ones(5))
  assert krum['selected_clients'] == 4  # n - f, f = round(1.25) = 1


@pytest.mark.parametrize('build, match', [
    (lambda: robust_baselines.TrimmedMeanFactory(0.5), 'trim_fraction'),
    (lambda: robust_baselines.TrimmedMeanFactory(-0.1), 'trim_fraction'),
    (lambda: robust_baselines.MultiKrumFactory(0.6), 'byzantine_fraction'),
    (lambda: robust_baselines.MultiKrumFactory(0.1, num_selected=0), 'num_selected'),
])
def test_invalid_arguments_raise(build, match):
  with pytest.raises(ValueError, match=match):
    build()


@pytest.mark.parametrize('factory', [robust_baselines.CoordinateMedianFactory(),
                                     robust_baselines.TrimmedMeanFactory(0.1),
                                     robust_baselines.MultiKrumFactory(0.1)], ids=type)
def test_audit_flags_them_as_not_private(factory):
  report = audit.audit_computation(factory, value_type=_VALUE_TYPE)
  assert not report.ok
  assert {v.intrinsic for v in report.violations} == {'federated_aggregate'}


# TFF's adaptive norm bounds in front of TFF's weighted mean, as the harness's `clip_mean` and `zeroing_mean`:
# clipping at an estimate of the median update norm, zeroing above an estimate of its 0.98 quantile.
_TFF_NORM_FACTORIES = {
    'clip_mean': lambda: tff.aggregators.clipping_factory(
        tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
            initial_estimate=1.0, target_quantile=0.5, learning_rate=0.2),
        tff.aggregators.MeanFactory()),
    'zeroing_mean': lambda: tff.aggregators.zeroing_factory(
        tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
            initial_estimate=10.0, target_quantile=0.98, learning_rate=math.log(10.0), multiplier=2.0,
            increment=1.0),
        tff.aggregators.MeanFactory()),
}


@pytest.mark.parametrize('name', list(_TFF_NORM_FACTORIES))
def test_tff_norm_factories_bound_an_outlier(name):
  # Adaptive bounds start at 1 (clipping) and 10 * 2 + 1 (zeroing): a norm-1000 outlier cannot move the mean far.
  rng = np.random.default_rng(4)
  points = np.concatenate([rng.normal(0, 0.05, size=(5, 10)), np.full((1, 10), 1000 / np.sqrt(10))]).astype(
      np.float32)
  result, _ = _run(_TFF_NORM_FACTORIES[name](), points, np.ones(6))
  assert np.linalg.norm(result) < 1.0 < np.linalg.norm(points.mean(axis=0))


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types and weight dtypes (these factories take no inner factory).

_CONTRACT = {
    'median': (robust_baselines.CoordinateMedianFactory, {}),
    'trimmed_mean': (lambda: robust_baselines.TrimmedMeanFactory(0.25), {'trimmed_per_side': np.int32}),
    'krum': (lambda: robust_baselines.MultiKrumFactory(0.25), {'selected_clients': np.int32}),
}


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
@pytest.mark.parametrize('name', list(_CONTRACT))
def test_type_properties(name, value_type, weight_dtype):
  build, extra = _CONTRACT[name]
  factory = build()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  measurements = collections.OrderedDict(participating_clients=np.int32, dropped_clients=np.int32, **extra)
  utils.assert_process_types(factory.create(value_type, weight_type), state_type=(), value_type=value_type,
                             weight_type=weight_type, measurements_type=measurements)


@pytest.mark.parametrize('weight_dtype', [np.int32, np.int64])
@pytest.mark.parametrize('name', list(_CONTRACT))
def test_int_weights_give_the_float32_result(name, weight_dtype):
  rng = np.random.default_rng(8)
  points = rng.normal(size=(6, 10)).astype(np.float32)
  int_weights = [weight_dtype(w) for w in (2, 1, 0, 5, 3, 1)]  # The weight-0 client is dropped.
  factory = _CONTRACT[name][0]()
  values = [_structure(p) for p in points]
  got_process = factory.create(_VALUE_TYPE, tff.TensorType(weight_dtype))
  got = got_process.next(got_process.initialize(), values, int_weights)
  want_process = factory.create(_VALUE_TYPE, tff.TensorType(np.float32))
  want = want_process.next(want_process.initialize(), values, [np.float32(w) for w in int_weights])
  np.testing.assert_array_equal(_flat(got.result), _flat(want.result))
  assert got.measurements == want.measurements
  assert got.measurements['dropped_clients'] == 1


# ----------------------------------------------------------------------------------------------------------------
# Weighted median and trimmed mean (`weighted=True`), against per-coordinate NumPy references.


def _np_weighted_median(points, weights):
  """Per coordinate: the smallest value whose cumulative weight reaches half the total, the midpoint of it and the
  next value when that cumulative weight is exactly half."""
  out = []
  for column in np.asarray(points, np.float64).T:
    order = np.argsort(column, kind='stable')
    values, cumulative = column[order], np.cumsum(np.asarray(weights, np.float64)[order])
    half = cumulative[-1] / 2
    j = int(np.argmax(cumulative >= half))
    out.append((values[j] + values[j + 1]) / 2 if cumulative[j] == half else values[j])
  return np.array(out)


def _np_weighted_trimmed_mean(points, weights, beta):
  """Per coordinate: the weight beta * A of the smallest values and of the largest removed (a value across the cut
  keeps part of its weight), the weighted mean of what is left."""
  out = []
  for column in np.asarray(points, np.float64).T:
    order = np.argsort(column, kind='stable')
    values, w = column[order], np.asarray(weights, np.float64)[order]
    total = w.sum()
    low, high, start, kept = beta * total, (1 - beta) * total, 0.0, []
    for weight in w:
      kept.append(max(0.0, min(start + weight, high) - max(start, low)))
      start += weight
    out.append(np.dot(kept, values) / np.sum(kept))
  return np.array(out)


_WEIGHTED = {
    'median': (lambda: robust_baselines.CoordinateMedianFactory(weighted=True), _np_weighted_median),
    'trimmed_mean': (lambda: robust_baselines.TrimmedMeanFactory(0.2, weighted=True),
                     lambda p, w: _np_weighted_trimmed_mean(p, w, 0.2)),
}


@pytest.mark.parametrize('name, n', tiers.cover_once([('median', 5), ('trimmed_mean', 6), ('median', 1),
                                                      ('trimmed_mean', 2)], keys=[lambda c: c[0]]))
def test_weighted_rules_match_numpy_reference(name, n):
  rng = np.random.default_rng(n)
  points = rng.normal(size=(n, 10)).astype(np.float32)
  weights = rng.uniform(0.5, 5, size=n).astype(np.float32)
  build, reference = _WEIGHTED[name]
  result, measurements = _run(build(), points, weights)
  np.testing.assert_allclose(result, reference(points, weights), rtol=1e-5, atol=1e-6)
  assert measurements['participating_clients'] == n


def test_weighted_median_uses_the_midpoint_at_exactly_half_and_follows_a_heavy_client():
  points = np.array([[0.0] * 10, [1.0] * 10, [2.0] * 10, [10.0] * 10], np.float32)
  result, _ = _run(robust_baselines.CoordinateMedianFactory(weighted=True), points, [1, 2, 1, 2])  # A/2 = 3 at 1.
  np.testing.assert_allclose(result, np.full(10, 1.5))
  result, _ = _run(robust_baselines.CoordinateMedianFactory(weighted=True), points, [1, 1, 1, 4])
  np.testing.assert_allclose(result, np.full(10, 10.0))  # Why the default ignores the weights.


@pytest.mark.slow
def test_weighted_rules_with_equal_weights_are_the_unweighted_ones():
  rng = np.random.default_rng(5)
  points = rng.normal(size=(10, 10)).astype(np.float32)
  for weighted, unweighted in [(robust_baselines.CoordinateMedianFactory(weighted=True),
                                robust_baselines.CoordinateMedianFactory()),
                               (robust_baselines.TrimmedMeanFactory(0.2, weighted=True),  # beta * n = 2 exactly.
                                robust_baselines.TrimmedMeanFactory(0.2))]:
    np.testing.assert_allclose(_run(weighted, points, np.full(10, 3.0))[0], _run(unweighted, points, np.ones(10))[0],
                               rtol=1e-5, atol=1e-6)


def test_weighted_trimmed_mean_measures_the_trimmed_weight():
  _, measurements = _run(robust_baselines.TrimmedMeanFactory(0.25, weighted=True), np.ones([4, 10]), [1, 2, 3, 2])
  np.testing.assert_allclose(measurements['trimmed_weight_per_side'], 2.0)
  assert set(measurements) == {'participating_clients', 'dropped_clients', 'trimmed_weight_per_side'}
