"""`BucketingFactory` (Karimireddy et al., 2022) against NumPy references of rules on bucket means, and its audit."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import audit
from tff_gma.aggregators import bucketing
from tff_gma.aggregators import centered_clipping
from tff_gma.aggregators import robust_baselines
from tests import tiers
from tests.tff_gma.aggregators import aggregator_test_utils as utils

VALUE_TYPE = tff.TensorType(np.float32, [6])
SEED = 7


def _np_buckets(points, weights, order, size):
  """Bucket means and weights of the clients in `order`, `size` consecutive ones a bucket (the paper's Algorithm 1,
  with each bucket's mean weighted by the client weights)."""
  points, weights = np.asarray(points, np.float64)[order], np.asarray(weights, np.float64)[order]
  means, totals = [], []
  for start in range(0, len(order), size):
    w = weights[start:start + size]
    means.append(w @ points[start:start + size] / w.sum())
    totals.append(w.sum())
  return np.array(means).reshape(-1, points.shape[1]), np.array(totals)


def _np_trimmed(points, beta):
  n = len(points)
  k = min(int(np.floor(beta * n + 0.5)), (n - 1) // 2)
  return np.sort(points, axis=0)[k:n - k].mean(axis=0)


def _np_krum(points, weights, beta):
  n = len(points)
  f = int(np.floor(beta * n + 0.5))
  neighbours = min(max(n - f - 2, 1), max(n - 1, 1))
  scores = [sum(sorted(float(np.sum((points[i] - points[j]) ** 2)) for j in range(n) if j != i)[:neighbours])
            for i in range(n)]
  chosen = np.argsort(scores, kind='stable')[:max(n - f, 1)]
  return weights[chosen] @ points[chosen] / weights[chosen].sum()


def _np_cc(points, weights, tau, iterations):
  v = np.zeros(points.shape[1])
  for _ in range(iterations):
    steps = [(w - v) * min(1.0, tau / max(np.linalg.norm(w - v), 1e-300)) for w in points]
    v = v + sum(a * s for a, s in zip(weights, steps)) / weights.sum()
  return v


_INNER = {
    'median': (robust_baselines.CoordinateMedianFactory, lambda p, w: np.median(p, axis=0)),
    'trimmed_mean': (lambda: robust_baselines.TrimmedMeanFactory(0.2), lambda p, w: _np_trimmed(p, 0.2)),
    'krum': (lambda: robust_baselines.MultiKrumFactory(0.2), lambda p, w: _np_krum(p, w, 0.2)),
    'centered_clip': (lambda: centered_clipping.CenteredClippingFactory(1.0, 2), lambda p, w: _np_cc(p, w, 1.0, 2)),
}


def _order(n, round_num):
  """The permutation the factory uses (its one arbitrary choice); the rules are checked independently of it."""
  return bucketing.permutation(tf.constant(n), SEED, tf.constant(round_num, tf.int32)).numpy()


@pytest.mark.parametrize('name, size', tiers.cover_once(
    [('median', 2), ('trimmed_mean', 3), ('krum', 2), ('centered_clip', 2), ('median', 1), ('krum', 20)],
    keys=[lambda c: c[0], lambda c: c[1]]))
def test_matches_numpy_reference_over_two_rounds(name, size):
  build, reference = _INNER[name]
  rng = np.random.default_rng(size)
  points = rng.normal(size=(9, 6)).astype(np.float32)
  weights = rng.uniform(0.5, 3, size=9).astype(np.float32)
  process = bucketing.BucketingFactory(build(), size, SEED).create(VALUE_TYPE, tff.TensorType(np.float32))
  state = process.initialize()
  for round_num in range(2):
    output = process.next(state, list(points), list(weights))
    means, totals = _np_buckets(points, weights, _order(9, round_num), size)
    np.testing.assert_allclose(output.result, reference(means, totals), rtol=1e-5, atol=1e-5)
    assert output.measurements['buckets'] == -(-9 // size)
    assert output.state == round_num + 1
    state = output.state


def test_permutation_is_seeded_per_round_and_a_permutation():
  orders = [_order(20, r) for r in range(3)]
  for order in orders:
    assert sorted(order) == list(range(20))
  assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
  np.testing.assert_array_equal(orders[0], _order(20, 0))  # Reproducible.
  other = bucketing.permutation(tf.constant(20), SEED + 1, tf.constant(0)).numpy()
  assert not np.array_equal(other, orders[0])


def test_invalid_clients_are_dropped_before_bucketing():
  points = np.arange(30, dtype=np.float32).reshape(5, 6)
  points[1, 2] = np.nan
  weights = np.array([1, 1, 0, 1, 1], np.float32)
  process = bucketing.BucketingFactory(robust_baselines.CoordinateMedianFactory(), 10, SEED).create(
      VALUE_TYPE, tff.TensorType(np.float32))
  output = process.next(process.initialize(), list(points), list(weights))
  np.testing.assert_allclose(output.result, points[[0, 3, 4]].mean(axis=0), rtol=1e-6)  # One bucket: the mean.
  assert (output.measurements['participating_clients'], output.measurements['dropped_clients']) == (3, 2)


def test_type_properties():
  factory = bucketing.BucketingFactory(robust_baselines.TrimmedMeanFactory(0.1), 2)
  weight_type = tff.TensorType(np.int32)
  measurements = collections.OrderedDict(participating_clients=np.int32, dropped_clients=np.int32, buckets=np.int32,
                                         trimmed_per_side=np.int32)
  utils.assert_process_types(factory.create(utils.STRUCT_TYPE, weight_type), state_type=np.int32,
                             value_type=utils.STRUCT_TYPE, weight_type=weight_type, measurements_type=measurements)


@pytest.mark.parametrize('build, error', [
    (lambda: bucketing.BucketingFactory(tff.aggregators.MeanFactory(), 2), TypeError),
    (lambda: bucketing.BucketingFactory(robust_baselines.CoordinateMedianFactory(), 0), ValueError),
    (lambda: bucketing.BucketingFactory(robust_baselines.CoordinateMedianFactory(), 2, seed=2**40), ValueError),
    (lambda: bucketing.BucketingFactory(centered_clipping.CenteredClippingFactory(reference='previous'), 2),
     ValueError),
])
def test_invalid_arguments_raise(build, error):
  with pytest.raises(error):
    build()


@pytest.mark.parametrize('name', ['median', 'centered_clip'])
def test_audit_fails_it_even_around_a_private_rule(name):
  report = audit.audit_computation(bucketing.BucketingFactory(_INNER[name][0](), 2), value_type=VALUE_TYPE)
  assert report.verdict == 'FAIL'
  assert {v.intrinsic for v in report.violations} == {'federated_aggregate'}
