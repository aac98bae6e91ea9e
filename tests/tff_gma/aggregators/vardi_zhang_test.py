"""RFA that no client can pin: Vardi and Zhang's modified Weiszfeld step, against NumPy and the RFA authors' code.

A client at (or within the smoothing of) the iterate used to get the weight a_i / nu and hold the iterate there: one
client sending a zero update froze the default RFA. The references here are written from Vardi and Zhang (2000),
the RFA paper, and PyPI `geom-median` (the RFA authors' smoothed Weiszfeld), never from the library's code.
"""

import numpy as np
import pytest
import tensorflow_federated as tff
from geom_median.numpy import compute_geometric_median
from sklearn import datasets

from tests.methods_reference import numpy_reference as ref
from tff_gma import aggregators

NU = 1e-6
NEAR_FRACTION = 1 / 30
GRID = 10.0 ** (np.arange(-40, 25) / 4)  # The clients' distance thresholds, four a decade (the documented grid).
NUM_CLIENTS = 20


def median_distance(distances, weights):
  """The smallest grid threshold at which the weighted share of distances at or below it reaches one half."""
  shares = np.array([weights[distances <= t].sum() for t in GRID]) / weights.sum()
  return GRID[min(int(np.sum(shares < 0.5)), len(GRID) - 1)]


def vardi_zhang_rfa(points, weights, num_passes=3, init='zero', scale=0.0):
  """(estimate, stalled passes, median norm): RFA with Vardi and Zhang's step (their eq. 2.5).

  Clients within c of the iterate y count as at y: T is the Weiszfeld mean of the others (weights a_i / d_i),
  eta their weight, r = ||sum_far a_i (w_i - y) / d_i||, and y' = (1 - min(1, eta / r)) T + min(1, eta / r) y.
  c = max(nu, NEAR_FRACTION * S), S the weighted median distance the previous round measured (the first pass: the
  `scale` the previous call measured, its norms' median).
  """
  points, weights = np.asarray(points, np.float64), np.asarray(weights, np.float64)
  y = np.zeros(points.shape[1])
  distances = np.linalg.norm(points, axis=1)
  first_median = median_distance(distances, weights)
  passes = num_passes
  if init == 'mean':
    y, scale, passes = weights @ points / weights.sum(), first_median, num_passes - 1
  stalled = 0
  for _ in range(passes):
    distances = np.linalg.norm(points - y, axis=1)
    c = max(NU, NEAR_FRACTION * scale)
    near = distances <= c
    b = np.where(near, 0.0, weights / np.maximum(distances, c))
    eta = weights[near].sum()
    if b.sum() > 0:
      t = b @ points / b.sum()
      r = np.linalg.norm(b @ (points - y))
      g = 0.0 if eta == 0 else (min(1.0, eta / r) if r > 0 else 1.0)
      y = (1 - g) * t + g * y
    else:
      g = 1.0
    stalled += g >= 1
    scale = median_distance(distances, weights)
  return y, stalled, first_median


def converged_median(points, weights):
  return compute_geometric_median(np.asarray(points, np.float64), np.asarray(weights, np.float64),
                                  eps=1e-9, maxiter=2000, ftol=1e-14).median


def process(dim, **kwargs):
  return aggregators.GeometricMedianFactory(**kwargs).create(tff.TensorType(np.float32, [dim]),
                                                             tff.TensorType(np.float32))


def two_calls(proc, points, weights):
  """The second call's output: the first measures the norms' median that the second's first pass uses."""
  values, weights = [np.float32(p) for p in points], [np.float32(w) for w in weights]
  state = proc.next(proc.initialize(), values, weights).state
  return proc.next(state, values, weights)


def gaussian_updates(rng, dim=100, noise=1.0):
  mean = rng.normal(size=dim)
  mean /= np.linalg.norm(mean)
  return mean + noise * rng.normal(size=(NUM_CLIENTS, dim)) / np.sqrt(dim), np.ones(NUM_CLIENTS)


def digits_updates():
  """Real client updates: one local epoch of FedAvg's logistic regression on scikit-learn's digits, 20 clients
  with label-skewed shards (sorted by label), weights their example counts."""
  digits = datasets.load_digits()
  order = np.argsort(digits.target, kind='stable')
  x, y = digits.data[order] / 16.0, digits.target[order].astype(np.int32)
  model = ref.Logistic(features=64, classes=10)
  theta = np.zeros(model.size, np.float32)
  updates, weights = [], []
  for xs, ys in zip(np.array_split(x, NUM_CLIENTS), np.array_split(y, NUM_CLIENTS)):
    trained = ref.local_training(model, theta, ref.batches(xs.astype(np.float32), ys, 16),
                                 ref.ClientConfig(lr=0.05, momentum=0.9))
    updates.append(trained - theta)
    weights.append(len(ys))
  return np.array(updates, np.float64), np.array(weights, np.float64)


def attacked(points, weights, attack, num_attackers):
  """The points with the first `num_attackers` replaced: zero, tiny (every coordinate 1e-6) or -0.01 x the honest
  mean; and the honest weighted mean the error is measured from."""
  honest_mean = weights[num_attackers:] @ points[num_attackers:] / weights[num_attackers:].sum()
  points = points.copy()
  points[:num_attackers] = {'zero': 0.0 * honest_mean, 'tiny': np.full_like(honest_mean, 1e-6),
                            'negated': -0.01 * honest_mean}[attack]
  return points, honest_mean


def relative_error(estimate, honest_mean):
  return np.linalg.norm(estimate - honest_mean) / np.linalg.norm(honest_mean)


@pytest.fixture(scope='module')
def default_process():
  return process(100)


@pytest.mark.parametrize('attack', ['zero', 'tiny', 'negated'])
@pytest.mark.parametrize('num_attackers', [1, 2, 4])
def test_no_few_clients_pin_default_rfa_on_gaussian_updates(default_process, attack, num_attackers):
  errors = []
  for seed in range(3):
    points, honest_mean = attacked(*gaussian_updates(np.random.default_rng(seed)), attack, num_attackers)
    output = two_calls(default_process, points, np.ones(NUM_CLIENTS))
    errors.append((relative_error(output.result, honest_mean),
                   relative_error(converged_median(points, np.ones(NUM_CLIENTS)), honest_mean)))
  got, converged = np.mean(errors, axis=0)
  assert got <= 1.5 * converged, (got, converged)


@pytest.fixture(scope='module')
def digits():
  return digits_updates()


@pytest.mark.parametrize('attack', ['zero', 'tiny', 'negated'])
@pytest.mark.parametrize('num_attackers', [1, 2, 4])
def test_no_few_clients_pin_default_rfa_on_real_client_updates(digits, attack, num_attackers):
  points, weights = digits
  points, honest_mean = attacked(points, weights, attack, num_attackers)
  output = two_calls(process(points.shape[1]), points, weights)
  converged = relative_error(converged_median(points, weights), honest_mean)
  assert relative_error(output.result, honest_mean) <= 1.5 * converged


@pytest.mark.parametrize('kwargs,init,passes', [
    (dict(), 'zero', 3), (dict(init='mean'), 'mean', 3), (dict(one_step=True), 'zero', 1),
    (dict(num_passes=5), 'zero', 5)], ids=['default', 'mean', 'one_step', 'five'])
def test_matches_the_vardi_zhang_reference_over_two_calls(kwargs, init, passes):
  rng = np.random.default_rng(7)
  points, weights = gaussian_updates(rng, dim=30)
  points[:3] = 1e-6  # Near the zero start: the modified step's case.
  points[3] = -0.01 * points[5:].mean(axis=0)
  weights = rng.uniform(0.5, 2.0, NUM_CLIENTS)
  _, _, scale = vardi_zhang_rfa(points, weights, passes, init)  # The first call's median norm.
  want, stalled, _ = vardi_zhang_rfa(points, weights, passes, init, scale)
  output = two_calls(process(30, **kwargs), points, weights)
  np.testing.assert_allclose(output.result, want, rtol=2e-5, atol=2e-6)
  assert output.measurements['stalled_passes'] == stalled


def test_one_step_rfa_is_not_pinned_by_clients_at_the_start():
  points, honest_mean = attacked(*gaussian_updates(np.random.default_rng(3)), 'tiny', 4)
  output = two_calls(process(100, one_step=True), points, np.ones(NUM_CLIENTS))
  assert output.measurements['near_weight'][0] == pytest.approx(4 / NUM_CLIENTS)
  assert relative_error(output.result, honest_mean) < 0.5  # Pinned, it was 1.0 (the result at the start).


def test_a_median_at_the_start_stalls_every_pass_and_says_so():
  """When most of the weight sits at the iterate, the geometric median is there: Vardi-Zhang's step stays, which
  the measurements report, where Weiszfeld's would say nothing."""
  points, weights = gaussian_updates(np.random.default_rng(4), dim=10)
  points[:12] = 0.0
  output = process(10).next(process(10).initialize(), [np.float32(p) for p in points], [np.float32(1)] * 20)
  np.testing.assert_array_equal(output.result, np.zeros(10))
  assert output.measurements['stalled_passes'] == 3
  np.testing.assert_allclose(output.measurements['near_weight'], [0.6] * 3, rtol=1e-6)


@pytest.mark.parametrize('iterations', [0, 1, 4])
def test_equals_the_rfa_authors_code_at_matched_settings(iterations):
  """`geom-median`'s maxiter=k from the weighted mean, full budget (ftol < 0), is init='mean' with k + 1 passes."""
  rng = np.random.default_rng(iterations)
  points = rng.normal(size=(NUM_CLIENTS, 40)) + np.where(rng.random((NUM_CLIENTS, 1)) < 0.2, 20.0, 0.0)
  weights = rng.uniform(0.5, 3.0, NUM_CLIENTS)
  want = compute_geometric_median(points, weights, eps=NU, maxiter=iterations, ftol=-1.0).median
  proc = process(40, init='mean', num_passes=iterations + 1)
  got = proc.next(proc.initialize(), [np.float32(p) for p in points], [np.float32(w) for w in weights]).result
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
