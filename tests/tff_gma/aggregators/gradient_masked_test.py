"""`GradientMaskedFactory` against a NumPy reference of GMA (eq. 3 / Algorithm 1), in every mode."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma.aggregators import secure_mean
from tests.tff_gma.aggregators import aggregator_test_utils as utils

VALUE_TYPE = tff.to_type(collections.OrderedDict(
    a=tff.TensorType(np.float32, [2, 3]),
    b=[tff.TensorType(np.float32, [4]), tff.TensorType(np.float32, [])],
))
WEIGHT_TYPE = tff.TensorType(np.float32)
VALUE_BOUND = 10.0
WEIGHT_BOUND = 4.0
TAU = 0.4


def random_values(rng, num_clients, zero_fraction=0.25):
  """Client values of VALUE_TYPE's structure; some exact zeros so that sign 0 occurs."""

  def leaf(shape):
    x = rng.normal(size=shape)
    x = np.where(rng.random(shape) < zero_fraction, 0.0, x)
    return np.asarray(x, np.float32)

  return [collections.OrderedDict(a=leaf((2, 3)), b=[leaf((4,)), leaf(())]) for _ in range(num_clients)]


def random_weights(rng, num_clients):
  return [np.float32(w) for w in rng.uniform(0.5, 3.0, size=num_clients)]


def flat(structure):
  return [np.asarray(x, np.float64) for x in tf.nest.flatten(structure)]


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference.


def gma_reference(values, weights, tau, mask, value_bound=None, weight_bound=None):
  """GMA in NumPy: (per-leaf results, masked fraction, mean agreement).

  Clients with a non-finite value or a non-finite/negative weight are left out; the agreement is over clients
  with a positive weight. With bounds (secure mode), values and weights are clipped first.
  """
  leaves = [flat(v) for v in values]
  weights = np.asarray(weights, np.float64)
  keep = np.array([all(np.all(np.isfinite(x)) for x in v) and np.isfinite(w) and w >= 0
                   for v, w in zip(leaves, weights)], dtype=bool)
  if weight_bound is not None:
    weights = np.minimum(weights, weight_bound)
  votes = keep & (weights > 0)
  num_votes = np.float32(votes.sum())
  results, agreements = [], []
  for j in range(len(leaves[0])):
    points = np.stack([v[j] for v in leaves])
    if value_bound is not None:
      points = np.clip(points, -value_bound, value_bound)
    total = weights[keep].sum()
    mean = (np.tensordot(weights[keep], points[keep], axes=1) / total if total > 0
            else np.zeros(points.shape[1:]))
    sign_sum = np.sign(points[votes]).sum(axis=0)
    # In float32 as the server computes it, so that ties A == tau resolve the same way.
    agreement = (np.abs(sign_sum).astype(np.float32) / num_votes if num_votes > 0
                 else np.zeros(points.shape[1:], np.float32))
    below = agreement if mask == 'soft' else np.zeros_like(agreement)
    m = np.where(agreement >= np.float32(tau), np.float32(1), below)
    results.append(m.astype(np.float64) * mean)
    agreements.append(np.ravel(agreement))
  all_agreement = np.concatenate(agreements)
  return results, float(np.mean(all_agreement < np.float32(tau))), float(np.mean(all_agreement))


def secure_tolerance(values, weights):
  """Per-leaf bounds on |secure result - reference| from `secure_mean.error_bound`, the documented bound.

  The result is `fl(mask * mean)`: the mask is computed from exact integer sign sums, in float32 as the reference
  does, so it is the reference's mask (in [0, 1]); the mean is within the secure mean's `error_bound` E of the
  weighted mean m of the clipped values of the kept clients (every client of the round counted in N); the
  product rounds once more: |result - mask * m| <= mask * E + eps * mask * (|m| + E) <= E + eps (|m| + E).
  """
  eps = 2.0**-24
  weights = np.minimum(np.asarray(weights, np.float64), WEIGHT_BOUND)
  leaves = [flat(v) for v in values]
  keep = np.array([all(np.all(np.isfinite(x)) for x in v) and np.isfinite(w) and w >= 0
                   for v, w in zip(leaves, weights)], dtype=bool)
  tolerances = []
  for j in range(len(leaves[0])):
    points = np.clip(np.stack([v[j] for v in leaves])[keep], -VALUE_BOUND, VALUE_BOUND)
    total = weights[keep].sum()
    mean_abs = np.abs(np.tensordot(weights[keep], points, axes=1) / total)
    bound = secure_mean.error_bound(len(values), total, VALUE_BOUND, WEIGHT_BOUND, mean_abs,
                                    np.max(np.abs(points), axis=0))
    tolerances.append(bound + eps * (mean_abs + bound))
  return tolerances


# ----------------------------------------------------------------------------------------------------------------
# Processes, built once per configuration (compiling is the slow part).


def process(mask='soft', secure=False, tau=TAU):
  return _process(mask, secure, tau)  # One cache key per configuration, however it is spelled.


@functools.lru_cache(maxsize=None)
def _process(mask, secure, tau):
  factory = aggregators.GradientMaskedFactory(
      tau=tau, mask=mask, secure=secure, value_bound=VALUE_BOUND if secure else None, weight_bound=WEIGHT_BOUND)
  return factory.create(VALUE_TYPE, WEIGHT_TYPE)


def run(proc, values, weights):
  output = proc.next(proc.initialize(), values, weights)
  return output.result, output.measurements


def assert_matches(result, expected, atol):
  """Leaf by leaf: `atol` a number (plain mode: float32 against a float64 reference, with rtol=1e-5) or, in
  secure mode, the per-leaf documented bounds of `secure_tolerance` (nothing added to them)."""
  got = flat(result)
  assert len(got) == len(expected)
  per_leaf = isinstance(atol, list)
  for index, (g, e) in enumerate(zip(got, expected)):
    assert g.shape == e.shape
    if per_leaf:
      error = np.abs(g - e)
      assert np.all(error <= atol[index]), f'leaf {index}: error {error} above the documented bound {atol[index]}'
    else:
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol)


@pytest.mark.parametrize('secure', [False, True])
@pytest.mark.parametrize('mask', ['soft', 'binary'])
def test_matches_numpy_reference(mask, secure):
  proc = process(mask, secure)
  rng = np.random.default_rng(7 if secure else 3)
  for num_clients in (1, 3, 5, 7):
    values, weights = random_values(rng, num_clients), random_weights(rng, num_clients)
    result, measurements = run(proc, values, weights)
    expected, masked_fraction, mean_agreement = gma_reference(values, weights, TAU, mask)
    atol = secure_tolerance(values, weights) if secure else 1e-6
    assert_matches(result, expected, atol)
    # Result has the values' structure (containers included).
    assert isinstance(result, collections.OrderedDict) and list(result) == ['a', 'b']
    assert isinstance(result['b'], list) and len(result['b']) == 2
    assert measurements['masked_fraction'] == pytest.approx(masked_fraction, abs=1e-6)
    assert measurements['mean_agreement'] == pytest.approx(mean_agreement, abs=1e-6)
    assert measurements['participating_clients'] == num_clients
    assert measurements['dropped_clients'] == 0
    if num_clients > 1:
      assert 0 < masked_fraction < 1  # The inputs exercise both branches of the mask.


def test_secure_error_bound_is_small_and_respected():
  """The secure result is within the documented bound of the exact reference, a bound far below the values'
  scale (about 1) and tight enough to catch one client's weight off by 1e-4."""
  rng = np.random.default_rng(11)
  values, weights = random_values(rng, 7), random_weights(rng, 7)
  secure, _ = run(process('soft', True), values, weights)
  expected, _, _ = gma_reference(values, weights, TAU, 'soft')
  tolerance = secure_tolerance(values, weights)
  assert max(np.max(t) for t in tolerance) < 2e-6
  assert_matches(secure, expected, tolerance)
  off_weights = list(weights)
  off_weights[0] = np.float32(weights[0] * (1 + 1e-4))
  off, _, _ = gma_reference(values, off_weights, TAU, 'soft')
  assert any(np.any(np.abs(o - e) > t) for o, e, t in zip(off, expected, tolerance))


def test_single_client_has_full_agreement():
  values = random_values(np.random.default_rng(0), 1, zero_fraction=0.0)
  result, measurements = run(process('binary'), values, [np.float32(2.0)])
  assert_matches(result, flat(values[0]), 1e-7)
  assert measurements['mean_agreement'] == pytest.approx(1.0)
  assert measurements['masked_fraction'] == 0.0


def test_opposite_clients_are_masked_out():
  """Two clients with opposite updates: A = 0 everywhere, so both masks zero the result."""
  value = random_values(np.random.default_rng(1), 1, zero_fraction=0.0)[0]
  negated = tf.nest.map_structure(lambda x: np.float32(-x), value)
  for mask in ('soft', 'binary'):
    result, measurements = run(process(mask), [value, negated], [np.float32(1.0), np.float32(3.0)])
    for g in flat(result):
      np.testing.assert_array_equal(g, 0.0)
    assert measurements['masked_fraction'] == 1.0
    assert measurements['mean_agreement'] == 0.0


def test_tau_zero_is_exactly_the_weighted_mean():
  rng = np.random.default_rng(5)
  values, weights = random_values(rng, 5), random_weights(rng, 5)
  gma, measurements = run(process('soft', False, 0.0), values, weights)
  mean_proc = aggregators.FederatedMeanFactory().create(VALUE_TYPE, WEIGHT_TYPE)
  mean = mean_proc.next(mean_proc.initialize(), values, weights).result
  for g, m in zip(flat(gma), flat(mean)):
    np.testing.assert_array_equal(g, m)
  w = np.asarray(weights, np.float64)
  expected = [np.tensordot(w, np.stack([flat(v)[j] for v in values]), axes=1) / w.sum() for j in range(3)]
  assert_matches(gma, expected, 1e-6)
  assert measurements['masked_fraction'] == 0.0


def test_unweighted_factory_uses_unit_weights():
  proc = aggregators.UnweightedGradientMaskedFactory(mask='soft').create(VALUE_TYPE)
  rng = np.random.default_rng(9)
  values = random_values(rng, 4)
  output = proc.next(proc.initialize(), values)
  expected, masked_fraction, _ = gma_reference(values, [1.0] * 4, TAU, 'soft')
  assert_matches(output.result, expected, 1e-6)
  assert output.measurements['masked_fraction'] == pytest.approx(masked_fraction, abs=1e-6)
  assert isinstance(aggregators.UnweightedGradientMaskedFactory(), tff.aggregators.UnweightedAggregationFactory)


def test_plain_tensor_and_float64_values():
  value_type = tff.TensorType(np.float64, [5])
  proc = aggregators.GradientMaskedFactory(mask='binary').create(value_type, WEIGHT_TYPE)
  values = [np.array([1.0, -1.0, 2.0, 0.0, 3.0]), np.array([2.0, 1.0, 1.0, 0.0, -3.0]),
            np.array([3.0, -2.0, 1.0, 1.0, 3.0])]
  weights = [np.float32(1.0), np.float32(1.0), np.float32(2.0)]
  result = proc.next(proc.initialize(), values, weights).result
  expected, _, _ = gma_reference(values, weights, TAU, 'binary')
  assert result.dtype == np.float64
  # Agreement: [1, 1/3, 1, 1/3, 1/3] -> binary mask [1, 0, 1, 0, 0].
  np.testing.assert_allclose(result, expected[0], rtol=1e-12)
  np.testing.assert_allclose(result, [2.25, 0.0, 1.25, 0.0, 0.0], rtol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize('secure', [False, True])
def test_non_finite_clients_are_dropped_and_counted(secure):
  rng = np.random.default_rng(13)
  values, weights = random_values(rng, 6), random_weights(rng, 6)
  values[1]['a'][0, 0] = np.nan
  values[4]['b'][1] = np.float32(np.inf)
  weights[2] = np.float32(np.nan)  # A non-finite weight drops the client too.
  result, measurements = run(process('soft', secure), values, weights)
  assert all(np.all(np.isfinite(g)) for g in flat(result))
  expected, masked_fraction, _ = gma_reference(values, weights, TAU, 'soft')
  assert_matches(result, expected, secure_tolerance(values, weights) if secure else 1e-6)
  assert measurements['dropped_clients'] == 3
  assert measurements['participating_clients'] == 3
  assert measurements['masked_fraction'] == pytest.approx(masked_fraction, abs=1e-6)


@pytest.mark.parametrize('secure', [False, True])
def test_round_without_weight_returns_zeros(secure):
  rng = np.random.default_rng(17)
  values = random_values(rng, 3)
  for v in values:
    v['a'][1, 2] = np.nan
  result, measurements = run(process('soft', secure), values, random_weights(rng, 3))
  for g in flat(result):
    np.testing.assert_array_equal(g, 0.0)
  assert measurements['dropped_clients'] == 3 and measurements['participating_clients'] == 0
  assert measurements['mean_agreement'] == 0.0

  values = random_values(rng, 3)
  result, measurements = run(process('soft', secure), values, [np.float32(0.0)] * 3)
  for g in flat(result):
    np.testing.assert_array_equal(g, 0.0)
  assert measurements['dropped_clients'] == 0 and measurements['participating_clients'] == 0


def test_zero_weight_client_does_not_vote_and_negative_weight_is_dropped():
  rng = np.random.default_rng(19)
  values, weights = random_values(rng, 5), random_weights(rng, 5)
  weights[0] = np.float32(0.0)
  weights[3] = np.float32(-1.0)
  result, measurements = run(process('binary'), values, weights)
  expected, _, _ = gma_reference(values, weights, TAU, 'binary')
  assert_matches(result, expected, 1e-6)
  assert measurements['participating_clients'] == 3
  assert measurements['dropped_clients'] == 1


def test_secure_bounds_clip_and_count():
  rng = np.random.default_rng(23)
  values, weights = random_values(rng, 4), random_weights(rng, 4)
  values[0]['a'][0, 1] = np.float32(50.0)  # Outside +-VALUE_BOUND.
  values[2]['b'][0][3] = np.float32(-1e6)
  weights[1] = np.float32(100.0)  # Above WEIGHT_BOUND.
  result, measurements = run(process('soft', True), values, weights)
  expected, _, _ = gma_reference(values, weights, TAU, 'soft', value_bound=VALUE_BOUND, weight_bound=WEIGHT_BOUND)
  assert_matches(result, expected, secure_tolerance(values, weights))
  assert all(np.all(np.abs(g) <= VALUE_BOUND) for g in flat(result))
  assert measurements['mean']['value_clipped_clients'] == 2
  assert measurements['mean']['weight_clipped_clients'] == 1


@pytest.mark.parametrize('kwargs,name', [
    (dict(tau=-0.1), 'tau'), (dict(tau=1.5), 'tau'), (dict(tau=float('nan')), 'tau'), (dict(tau='high'), 'tau'),
    (dict(mask='hard'), 'mask'), (dict(secure='yes'), 'secure'), (dict(secure=True), 'value_bound'),
    (dict(secure=True, value_bound=-1.0), 'value_bound'), (dict(weight_bound=0.0), 'weight_bound'),
    (dict(weight_bound=float('inf')), 'weight_bound'), (dict(mean_factory=object()), 'mean_factory'),
])
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
  with pytest.raises(ValueError, match=name):
    aggregators.GradientMaskedFactory(**kwargs)


def test_invalid_types_raise_type_error():
  factory = aggregators.GradientMaskedFactory()
  with pytest.raises(TypeError):
    factory.create(tff.TensorType(np.int32, [3]), WEIGHT_TYPE)
  with pytest.raises(TypeError):
    factory.create(tff.TensorType(np.float32, [3]), tff.TensorType(np.float32, [2]))
  with pytest.raises(TypeError):
    factory.create(tff.FederatedType(tff.TensorType(np.float32, [3]), tff.CLIENTS), WEIGHT_TYPE)


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types, an inner factory's state and measurements, weight dtypes.

GMA_MEASUREMENTS = collections.OrderedDict(
    masked_fraction=np.float32, mean_agreement=np.float32, participating_clients=np.int32, dropped_clients=np.int32,
    nonfinite_result=np.int32, zero_result=np.int32)
CLIP_COUNTS = collections.OrderedDict(value_clipped_clients=np.int32, weight_clipped_clients=np.int32)


def gma_measurements(mean_measurements):
  return collections.OrderedDict(**GMA_MEASUREMENTS, mean=mean_measurements)


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties(value_type, weight_dtype):
  factory = aggregators.GradientMaskedFactory()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  utils.assert_process_types(factory.create(value_type, weight_type), state_type=(), value_type=value_type,
                             weight_type=weight_type, measurements_type=gma_measurements(()))


@pytest.mark.parametrize('weight_dtype', [np.float32, np.int32])
def test_type_properties_secure(weight_dtype):
  weight_type = tff.TensorType(weight_dtype)
  process = aggregators.GradientMaskedFactory(secure=True, value_bound=1.0).create(utils.STRUCT_TYPE, weight_type)
  utils.assert_process_types(process, state_type=(), value_type=utils.STRUCT_TYPE, weight_type=weight_type,
                             measurements_type=gma_measurements(CLIP_COUNTS))


@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties_unweighted(value_type):
  factory = aggregators.UnweightedGradientMaskedFactory()
  assert isinstance(factory, tff.aggregators.UnweightedAggregationFactory)
  utils.assert_process_types(factory.create(value_type), state_type=(), value_type=value_type, weight_type=None,
                             measurements_type=gma_measurements(()))


@pytest.mark.parametrize('weighted', [True, False])
def test_inner_factory_state_and_measurements_pass_through(weighted):
  """GMA's state is its inner mean's, and its `mean` measurement the inner's; with tau = 0 (mask 1) the result
  is the inner result (here the weighted mean plus one)."""
  inner = utils.WeightedMeanPlusOneFactory()
  if weighted:
    process = aggregators.GradientMaskedFactory(tau=0.0, mean_factory=inner).create(
        utils.STRUCT_TYPE, tff.TensorType(np.int32))
    weight_type, weights = tff.TensorType(np.int32), [np.int32(1), np.int32(3)]
  else:
    process = aggregators.UnweightedGradientMaskedFactory(tau=0.0, mean_factory=inner).create(utils.STRUCT_TYPE)
    weight_type, weights = None, [1.0, 1.0]
  utils.assert_process_types(process, state_type=np.int32, value_type=utils.STRUCT_TYPE, weight_type=weight_type,
                             measurements_type=gma_measurements(np.int32))
  state = process.initialize()
  assert state == 0
  values = [(np.array([1.0, 2.0], np.float32), 3.0), (np.array([3.0, -2.0], np.float32), 5.0)]
  output = process.next(state, values, *([weights] if weighted else []))
  assert output.state == 1
  assert output.measurements['mean'] == utils.MEASUREMENT_CONSTANT
  w = np.asarray(weights, np.float64) / np.sum(weights)
  np.testing.assert_allclose(output.result[0], w @ np.array([[1.0, 2.0], [3.0, -2.0]]) + 1, rtol=1e-6)
  assert output.result[1] == pytest.approx(w @ [3.0, 5.0] + 1)
  assert process.next(output.state, values, *([weights] if weighted else [])).state == 2


@functools.lru_cache(maxsize=None)
def _weighted_process(secure, weight_dtype):
  factory = aggregators.GradientMaskedFactory(
      tau=TAU, secure=secure, value_bound=VALUE_BOUND if secure else None, weight_bound=WEIGHT_BOUND)
  return factory.create(VALUE_TYPE, tff.TensorType(weight_dtype))


@pytest.mark.parametrize('weight_dtype', [np.int32, np.int64])
@pytest.mark.parametrize('secure', [False, True])
def test_int_weights_give_the_float32_result(secure, weight_dtype):
  rng = np.random.default_rng(29)
  values = random_values(rng, 5)
  int_weights = [weight_dtype(w) for w in (2, 1, 7, 0, 3)]  # Weight 7 is above WEIGHT_BOUND: clipped in secure mode.
  got = run(_weighted_process(secure, weight_dtype), values, int_weights)
  want = run(_weighted_process(secure, np.float32), values, [np.float32(w) for w in int_weights])
  for g, w in zip(flat(got[0]), flat(want[0])):
    np.testing.assert_array_equal(g, w)
  assert got[1] == want[1]
  assert got[1]['participating_clients'] == 4  # The weight-0 client does not vote, as with float weights.


def _leaf(value):
  return collections.OrderedDict(a=np.full((2, 3), value, np.float32),
                                 b=[np.full((4,), value, np.float32), np.float32(value)])


@pytest.mark.parametrize('secure', [False, True])
def test_empty_cohort_returns_a_zero_update(secure):
  result, measurements = run(process(secure=secure), [], [])
  assert all(np.all(np.asarray(x) == 0) for x in tf.nest.flatten(result))
  assert measurements['participating_clients'] == 0


def test_updates_whose_norm_overflows_are_dropped_and_counted():
  # 3e38 and 2e19 per coordinate: finite, but their squared norm overflows float32; the mean would be 1e38.
  values = [_leaf(3e38), _leaf(1.0), _leaf(2e19), _leaf(1e18)]
  result, measurements = run(process(), values, [np.float32(1.0)] * 4)
  assert measurements['dropped_clients'] == 2 and measurements['participating_clients'] == 2
  expected = (1.0 + 1e18) / 2  # The two kept clients agree on every sign: mask 1.
  for x in tf.nest.flatten(result):
    np.testing.assert_allclose(x, expected, rtol=1e-6)
