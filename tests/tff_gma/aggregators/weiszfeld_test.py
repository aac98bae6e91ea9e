"""RFA's plain-TF math (flattened distances, Weiszfeld weights, secure smoothing) against NumPy."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tff_gma.aggregators import weiszfeld


def random_structure(rng, scale=1.0):
  return collections.OrderedDict(
      a=np.float32(scale * rng.normal(size=(2, 3))), b=[np.float32(scale * rng.normal(size=4)),
                                                        np.float32(scale * rng.normal())])


def flat(structure):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in tf.nest.flatten(structure)])


def test_flat_norm_and_distance_cover_the_whole_structure():
  rng = np.random.default_rng(0)
  v, w = random_structure(rng), random_structure(rng)
  assert float(weiszfeld.flat_norm(v)) == pytest.approx(np.linalg.norm(flat(v)), rel=1e-6)
  assert float(weiszfeld.flat_distance(v, w)) == pytest.approx(np.linalg.norm(flat(v) - flat(w)), rel=1e-6)
  assert float(weiszfeld.flat_distance(v, v)) == 0.0
  # Mixed dtypes are compared in float32.
  assert float(weiszfeld.flat_norm([tf.constant([3.0], tf.float64), tf.constant([4.0])])) == pytest.approx(5.0)


def test_weiszfeld_weight_is_scaled_inverse_distance_bounded_by_the_weight():
  a = np.array([1.0, 2.0, 3.0, 0.5, 0.0], np.float32)
  d = np.array([0.0, 1e-9, 0.5, 10.0, 4.0], np.float32)
  nu = 1e-3
  got = weiszfeld.weiszfeld_weight(tf.constant(a), tf.constant(d), tf.constant(nu)).numpy()
  np.testing.assert_allclose(got, a * nu / np.maximum(nu, d), rtol=1e-6)
  assert np.all(got <= a) and np.all(got >= 0)
  # Proportional to the textbook weights a / max(nu, d): the common factor nu cancels in the average.
  np.testing.assert_allclose(got / got.sum(), (a / np.maximum(nu, d)) / (a / np.maximum(nu, d)).sum(), rtol=1e-6)
  assert float(weiszfeld.weiszfeld_weight(1.0, np.inf, 1e-6)) == 0.0


def test_secure_smoothing():
  assert float(weiszfeld.secure_smoothing(1e-6, 5.0, 1e3)) == pytest.approx(5e-3)
  assert float(weiszfeld.secure_smoothing(1e-2, 5.0, 1e3)) == pytest.approx(1e-2)
  assert float(weiszfeld.secure_smoothing(1e-6, 0.0, 1e3)) == pytest.approx(1e-6)


def test_one_step_secure_smoothing_keeps_every_weight_above_a_over_k():
  """c = max(nu, B sqrt(n) / K): a constant, and b' = a c / max(c, ||w||) >= a / K for every clipped update."""
  rng = np.random.default_rng(3)
  bound, dim, ratio = 2.0, 11, 50.0
  assert weiszfeld.norm_bound(bound, dim) == pytest.approx(bound * np.sqrt(dim))
  c = weiszfeld.one_step_secure_smoothing(1e-6, bound, dim, ratio)
  assert c == pytest.approx(bound * np.sqrt(dim) / ratio)
  assert weiszfeld.one_step_secure_smoothing(1.0, bound, dim, ratio) == 1.0  # nu wins when larger.
  points = np.clip(rng.normal(scale=5.0, size=(50, dim)), -bound, bound)
  points[0] = bound  # The largest norm a clipped update can have.
  norms = np.linalg.norm(points, axis=1)
  assert np.max(norms) == pytest.approx(weiszfeld.norm_bound(bound, dim))
  a = rng.uniform(0.5, 2.0, size=50).astype(np.float32)
  b = weiszfeld.weiszfeld_weight(tf.constant(a), tf.constant(norms, tf.float32), tf.constant(c)).numpy()
  assert np.all(b >= a / ratio * (1 - 1e-6)) and np.all(b <= a)


def test_distance_bound_holds_for_clipped_points_and_their_averages():
  rng = np.random.default_rng(1)
  bound, dim = 2.0, 11
  bound_distance = weiszfeld.distance_bound(bound, dim)
  points = np.clip(rng.normal(scale=5.0, size=(50, dim)), -bound, bound)
  points[0], points[1] = bound, -bound  # The extreme pair.
  weights = rng.random(50)
  average = weights @ points / weights.sum()
  assert np.max(np.linalg.norm(points - average, axis=1)) <= bound_distance
  assert np.linalg.norm(points[0] - points[1]) <= bound_distance


def test_weiszfeld_iteration_decreases_the_objective_and_reaches_the_geometric_median():
  """Iterating the pieces centrally: monotone objective and the median's first-order condition."""
  rng = np.random.default_rng(2)
  points = [random_structure(rng) for _ in range(9)]
  a = rng.uniform(0.5, 2.0, size=9)
  flat_points = np.stack([flat(p) for p in points])
  nu = 1e-6

  def objective(v):
    return float(a @ np.linalg.norm(flat_points - v, axis=1))

  v = a @ flat_points / a.sum()
  values = [objective(v)]
  for _ in range(100):
    estimate = [tf.constant(x) for x in np.split(v, [6, 10])]
    distances = np.array([float(weiszfeld.flat_distance(
        estimate, [np.ravel(p['a']), p['b'][0], np.reshape(p['b'][1], [1])])) for p in points])
    b = weiszfeld.weiszfeld_weight(tf.constant(a, tf.float32), tf.constant(distances), tf.constant(nu)).numpy()
    v = b.astype(np.float64) @ flat_points / b.sum()
    values.append(objective(v))
  assert all(later <= earlier + 1e-5 for earlier, later in zip(values, values[1:]))
  assert values[-1] < values[0]
  # At the geometric median, the weighted unit vectors towards the points sum to (about) zero.
  diffs = flat_points - v
  gradient = (a[:, None] * diffs / np.linalg.norm(diffs, axis=1)[:, None]).sum(axis=0)
  assert np.linalg.norm(gradient) < 1e-3 * a.sum()


# ----------------------------------------------------------------------------------------------------------------
# Error propagation (the bounds geometric_median_test checks the secure factory against).


def test_distance_error_bound_covers_float32_distances_of_a_perturbed_estimate():
  rng = np.random.default_rng(5)
  dim = 11
  for scale in (1e-6, 1e-3, 1.0):
    for _ in range(10):
      v, w = np.float32(rng.normal(size=dim)), np.float32(rng.normal(size=dim))  # What the clients hold.
      perturbed = np.float32(v + scale * rng.normal(size=dim))  # The estimate the server broadcasts.
      estimate_error = np.linalg.norm(perturbed.astype(np.float64) - v)
      exact = np.linalg.norm(v.astype(np.float64) - w)
      computed = float(weiszfeld.flat_distance([tf.constant(perturbed)], [tf.constant(w)]))
      assert abs(computed - exact) <= weiszfeld.distance_error_bound(exact, estimate_error, dim)
  # e + (n + 4) eps (d + e).
  assert weiszfeld.distance_error_bound(2.0, 0.0, 11) == pytest.approx(2.0 * 15 * 2.0**-24)


def test_reweighting_error_bound_covers_every_perturbation_within_its_assumptions():
  """Distances and smoothing moved anywhere within their bounds: the reweighted mean stays within P of v_{k+1},
  and the clients' total weight above the least total; the bound is not vacuous (a large share of it is used)."""
  rng = np.random.default_rng(6)
  points, a = rng.normal(size=(7, 5)), rng.uniform(0.5, 2.0, size=7)
  estimate, c = points.mean(axis=0) + 0.1, 0.05
  distances = np.linalg.norm(points - estimate, axis=1)
  exact_weights = a * c / np.maximum(c, distances)
  next_estimate = exact_weights @ points / exact_weights.sum()
  distance_errors, smoothing_error = 1e-3 * np.ones(7), 1e-3
  shift, least_total = weiszfeld.reweighting_error_bound(
      points, a, estimate, next_estimate, c, distance_errors, smoothing_error, eps=0.0)
  worst = 0.0
  for _ in range(200):
    c_moved = c + smoothing_error * rng.uniform(-1, 1)
    d_moved = distances + distance_errors * rng.choice([-1.0, 1.0], size=7)
    weights = a * c_moved / np.maximum(c_moved, d_moved)
    moved = np.linalg.norm(weights @ points / weights.sum() - next_estimate)
    assert moved <= shift
    assert weights.sum() >= least_total
    worst = max(worst, moved)
  assert worst > 0.1 * shift
  # A point sitting at v_{k+1} moves nothing whatever its weight; the convex hull caps the shift.
  single, _ = weiszfeld.reweighting_error_bound(points[:1], a[:1], estimate, points[0], c, 1.0, 0.0)
  assert single == 0.0
