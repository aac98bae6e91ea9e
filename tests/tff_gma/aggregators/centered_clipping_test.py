"""`CenteredClippingFactory` against a NumPy reference of Centered Clipping (Karimireddy et al., 2021); its audit."""

import collections

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import audit
from tff_gma.aggregators import centered_clipping
from tff_gma.audit import policy as audit_policy
from tests import tiers
from tests.tff_gma.aggregators import aggregator_test_utils as utils

VALUE_TYPE = tff.to_type(collections.OrderedDict(
    kernel=tff.TensorType(np.float32, [3, 2]), bias=tff.TensorType(np.float32, [4])))
WEIGHT_TYPE = tff.TensorType(np.float32)


def _structure(flat):
  return collections.OrderedDict(kernel=flat[:6].reshape(3, 2).astype(np.float32), bias=flat[6:].astype(np.float32))


def _flat(value):
  return np.concatenate([np.asarray(value['kernel'], np.float64).ravel(), np.asarray(value['bias'], np.float64)])


def cc_reference(points, weights, tau, iterations, v0=None):
  """The paper's rule in NumPy (float64): v <- v + sum_i a_i clip_tau(w_i - v) / sum_i a_i, L times, from v0 (zero).

  Clients with a non-finite update or a non-finite or negative weight are left out. Returns (v_L, clipped counts).
  """
  points, a = np.asarray(points, np.float64), np.asarray(weights, np.float64)
  keep = np.all(np.isfinite(points), axis=1) & np.isfinite(a) & (a >= 0)
  points, a = points[keep], a[keep]
  v = np.zeros(points.shape[1]) if v0 is None else np.asarray(v0, np.float64)
  counts = []
  for _ in range(iterations):
    steps, clipped = [], 0
    for w in points:
      z = w - v
      norm = np.linalg.norm(z)
      steps.append(z * min(1.0, tau / norm) if norm > 0 else z)
      clipped += int(norm > tau)
    counts.append(clipped)
    if a.sum() > 0:
      v = v + sum(ai * s for ai, s in zip(a, steps)) / a.sum()
  return v, counts


_PROCESSES = {}


def _process(tau=1.0, iterations=3, **kwargs):
  key = (tau, iterations, tuple(sorted(kwargs.items())))
  if key not in _PROCESSES:
    factory = centered_clipping.CenteredClippingFactory(clip_radius=tau, num_iterations=iterations, **kwargs)
    _PROCESSES[key] = factory.create(VALUE_TYPE, WEIGHT_TYPE)
  return _PROCESSES[key]


def _run(process, points, weights, state=None):
  state = process.initialize() if state is None else state
  output = process.next(state, [_structure(p) for p in points], [np.float32(w) for w in weights])
  return _flat(output.result), output.measurements, output.state


_CASES = tiers.cover_once([(3, False, 6), (1, False, 5), (3, True, 6), (2, False, 1), (1, True, 3)],
                          keys=[lambda c: c[0], lambda c: c[1]])


@pytest.mark.parametrize('iterations, secure, n', _CASES)
def test_matches_numpy_reference(iterations, secure, n):
  rng = np.random.default_rng(n + 10 * iterations)
  points = rng.normal(0, 1, size=(n, 10))
  points[0] += 5  # Far from the others: clipped in every iteration.
  weights = rng.uniform(0.5, 3, size=n)
  result, measurements, _ = _run(_process(1.0, iterations, secure=secure), points, weights)
  want, counts = cc_reference(points.astype(np.float32), weights.astype(np.float32), 1.0, iterations)
  # Secure: the quantization error is about n tau / 2**32 per coordinate, far below float32 rounding here.
  np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-5)
  assert list(measurements['clipped_clients']) == counts
  assert measurements['participating_clients'] == n and measurements['dropped_clients'] == 0
  assert measurements['nonfinite_iterations'] == 0 and measurements['nonfinite_result'] == 0


def test_invalid_clients_are_dropped_and_zero_weight_does_not_count():
  rng = np.random.default_rng(1)
  points = rng.normal(size=(6, 10))
  weights = np.array([1, 2, 0, 3, 1, 2], np.float64)
  points[4, 3] = np.nan
  weights[1] = np.inf
  result, measurements, _ = _run(_process(), points, weights)
  keep = [0, 3, 5]
  want, counts = cc_reference(points[keep], weights[keep], 1.0, 3)
  np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-6)
  assert list(measurements['clipped_clients']) == counts
  assert (measurements['participating_clients'], measurements['dropped_clients']) == (3, 2)


def test_no_clients_gives_the_reference_point():
  result, measurements, _ = _run(_process(), np.ones([2, 10]), [0.0, 0.0])
  np.testing.assert_array_equal(result, np.zeros(10))
  assert measurements['participating_clients'] == 0 and measurements['zero_result'] == 0


def test_previous_reference_starts_from_the_last_result():
  rng = np.random.default_rng(2)
  first, second = rng.normal(size=(5, 10)) + 3, rng.normal(size=(5, 10)) - 3
  weights = rng.uniform(1, 2, size=5)
  process = _process(1.0, 2, reference='previous')
  result_1, _, state = _run(process, first, weights)
  result_2, _, state = _run(process, second, weights, state)
  want_1, _ = cc_reference(first, weights, 1.0, 2)
  want_2, _ = cc_reference(second, weights, 1.0, 2, v0=want_1)
  np.testing.assert_allclose(result_1, want_1, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(result_2, want_2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_flat(state['reference']), want_2, rtol=1e-5, atol=1e-5)


def test_an_outlier_moves_the_result_at_most_its_share_of_tau_per_iteration():
  rng = np.random.default_rng(3)
  honest = rng.normal(0, 0.1, size=(7, 10))
  points = np.concatenate([honest, np.full((1, 10), 1e4)])
  result, _, _ = _run(_process(1.0, 3), points, np.ones(8))
  honest_result, _ = cc_reference(honest, np.ones(7), 1.0, 3)
  # Each iteration the outlier's clipped difference (norm <= tau) enters with weight 1/8.
  assert np.linalg.norm(result - honest_result) <= 3 * 1.0 / 8 * 2 + 1e-6
  assert np.linalg.norm(points.mean(axis=0)) > 1e3


@pytest.mark.slow
def test_unweighted_factory_is_weight_one():
  rng = np.random.default_rng(4)
  points = rng.normal(size=(4, 10)) * 2
  process = aggregators.UnweightedCenteredClippingFactory(clip_radius=1.0, num_iterations=2).create(VALUE_TYPE)
  output = process.next(process.initialize(), [_structure(p) for p in points])
  want, _ = cc_reference(points, np.ones(4), 1.0, 2)
  np.testing.assert_allclose(_flat(output.result), want, rtol=1e-5, atol=1e-5)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(n=st.integers(1, 8), tau=st.floats(0.1, 10), iterations=st.integers(1, 4), seed=st.integers(0, 99))
def test_stacked_rule_matches_numpy_reference(n, tau, iterations, seed):
  # The rule on stacked clients (what bucketing applies to bucket means), in plain TF: cheap.
  rng = np.random.default_rng(seed)
  points = rng.normal(0, 3, size=(n, 5)).astype(np.float32)
  weights = rng.uniform(0.1, 4, size=n).astype(np.float32)
  got, counts = centered_clipping.centered_clipping(tf.constant(points), tf.constant(weights), tau, iterations)
  want, want_counts = cc_reference(points, weights, tau, iterations)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
  # A norm within float32 rounding of tau may count either way.
  assert np.abs(counts.numpy() - want_counts).max() <= 1 or list(counts.numpy()) == want_counts


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties(value_type, weight_dtype):
  factory = centered_clipping.CenteredClippingFactory(num_iterations=2)
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  measurements = collections.OrderedDict(
      clipped_clients=tff.TensorType(np.int32, [2]), participating_clients=np.int32, dropped_clients=np.int32,
      nonfinite_iterations=np.int32, nonfinite_result=np.int32, zero_result=np.int32, iterations=((), ()))
  utils.assert_process_types(factory.create(value_type, weight_type), state_type=collections.OrderedDict(
      iterations=((), ())), value_type=value_type, weight_type=weight_type, measurements_type=measurements)


@pytest.mark.parametrize('kwargs, match', [
    (dict(clip_radius=0.0), 'clip_radius'), (dict(num_iterations=0), 'num_iterations'),
    (dict(reference='mean'), 'reference'), (dict(secure=1), 'secure'),
])
def test_invalid_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    centered_clipping.CenteredClippingFactory(**kwargs)


@pytest.mark.parametrize('secure', [False, True])
def test_audit_passes_with_one_mean_per_iteration(secure):
  factory = aggregators.CenteredClippingFactory(num_iterations=2, secure=secure)
  report = audit.audit_computation(factory, value_type=VALUE_TYPE)
  assert report.verdict == 'PASS', [str(v) for v in report.violations]
  assert report.aggregation_passes == 2
  if secure:
    assert {f.intrinsic for f in report.flows} <= audit_policy.SECURE_SUM_INTRINSICS


def test_staged_process_is_one_stage_per_iteration_and_computes_the_same():
  factory = centered_clipping.CenteredClippingFactory(clip_radius=1.0, num_iterations=2, reference='previous')
  staged = aggregators.create_staged(factory, VALUE_TYPE, WEIGHT_TYPE)
  assert len(staged.stages) == 2
  rng = np.random.default_rng(6)
  points, weights = rng.normal(size=(4, 10)) * 2, rng.uniform(1, 2, size=4)
  want, _, _ = _run(_process(1.0, 2, reference='previous'), points, weights)
  output = staged.next(staged.initialize(), [_structure(p) for p in points], [np.float32(w) for w in weights])
  np.testing.assert_array_equal(_flat(output.result), want)
  np.testing.assert_array_equal(_flat(output.state['reference']), want)
