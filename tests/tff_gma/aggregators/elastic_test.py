"""ElasticFactory and its plain-TF math against NumPy references (Elastic Aggregation paper, Algorithm 1)."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import elastic
from tff_gma.aggregators import secure_mean
from tests.tff_gma.aggregators import aggregator_test_utils as utils

F32 = np.float32


def reference_zeta(omega: np.ndarray, tau: float) -> np.ndarray:
  top = omega.max()
  if top <= 0:
    return np.ones_like(omega)
  return 1.0 + tau - omega / top


def reference_elastic(updates, sensitivities, weights, tau):
  """updates/sensitivities: [client][leaf] arrays; weights: [client]. Paper's w_k, Omega, zeta, Delta."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  out = []
  for leaf in range(len(updates[0])):
    omega = sum(wk * s[leaf].astype(np.float64) for wk, s in zip(w, sensitivities))
    delta = sum(wk * u[leaf].astype(np.float64) for wk, u in zip(w, updates))
    out.append(reference_zeta(omega, tau) * delta)
  return out


def value_type(shapes):
  leaves = [tff.TensorType(F32, s) for s in shapes]
  return tff.to_type(collections.OrderedDict(update=leaves, sensitivity=list(leaves)))


def test_elastic_scale_matches_reference():
  rng = np.random.default_rng(0)
  omega = np.abs(rng.normal(size=(4, 3))).astype(F32)
  for tau in (0.0, 0.5, 2.0):
    np.testing.assert_allclose(elastic.elastic_scale(tf.constant(omega), tau).numpy(), reference_zeta(omega, tau),
                               rtol=1e-6)
  scale = elastic.elastic_scale(tf.constant(omega), 0.5).numpy()
  assert np.isclose(scale.min(), 0.5) and scale.max() <= 1.5  # The most sensitive parameter moves by tau.


def test_zero_sensitivity_gives_scale_one():
  np.testing.assert_array_equal(elastic.elastic_scale(tf.zeros([5]), 0.5).numpy(), np.ones(5, F32))
  # Per tensor: a zero tensor next to a non-zero one keeps its plain mean.
  scales = elastic.elastic_scales([tf.zeros([2]), tf.constant([1.0, 3.0])], 0.5)
  np.testing.assert_allclose(scales[0].numpy(), [1.0, 1.0])
  np.testing.assert_allclose(scales[1].numpy(), [1.5 - 1.0 / 3.0, 0.5], rtol=1e-6)


@pytest.mark.parametrize('shapes,tau,weights', [
    ([(3,), (2, 2)], 0.5, [1.0, 2.0, 5.0]),
    ([(4,)], 0.2, [3.0, 3.0]),
    ([(2, 3), (1,), (3,)], 1.0, [10.0, 1.0, 4.0, 7.0]),
])
def test_factory_matches_numpy_reference(shapes, tau, weights):
  rng = np.random.default_rng(len(shapes))
  n = len(weights)
  updates = [[rng.normal(size=s).astype(F32) for s in shapes] for _ in range(n)]
  sensitivities = [[np.abs(rng.normal(size=s)).astype(F32) for s in shapes] for _ in range(n)]
  for client in sensitivities:  # The first tensor has zero sensitivity at every client.
    client[0][...] = 0.0
  process = elastic.ElasticFactory(tau=tau).create(value_type(shapes), tff.TensorType(F32))
  values = [collections.OrderedDict(update=u, sensitivity=s) for u, s in zip(updates, sensitivities)]
  output = process.next(process.initialize(), values, [F32(w) for w in weights])
  expected = reference_elastic(updates, sensitivities, weights, tau)
  assert len(output.result) == len(shapes)
  for got, want in zip(output.result, expected):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  # The zero-sensitivity tensor is the plain weighted mean.
  plain = sum(w * u[0] for w, u in zip(weights, updates)) / sum(weights)
  np.testing.assert_allclose(output.result[0], plain, rtol=2e-5, atol=1e-6)
  zetas = np.concatenate([reference_zeta(
      sum(w * s[i] for w, s in zip(np.asarray(weights) / sum(weights), sensitivities)), tau).ravel()
      for i in range(len(shapes))])
  assert output.measurements['zeta_min'] == pytest.approx(zetas.min(), abs=1e-5)
  assert output.measurements['zeta_max'] == pytest.approx(zetas.max(), abs=1e-5)
  assert output.measurements['zeta_mean'] == pytest.approx(zetas.mean(), abs=1e-5)
  assert output.measurements['dropped_clients'] == 0


def test_non_finite_client_is_dropped():
  shapes = [(3,)]
  process = elastic.ElasticFactory().create(value_type(shapes), tff.TensorType(F32))
  good = collections.OrderedDict(update=[np.array([1.0, -2.0, 3.0], F32)], sensitivity=[np.array([1, 2, 4], F32)])
  bad = collections.OrderedDict(update=[np.array([np.nan, 0, 0], F32)], sensitivity=[np.array([1, 1, 1], F32)])
  output = process.next(process.initialize(), [good, bad], [F32(2.0), F32(3.0)])
  np.testing.assert_allclose(output.result[0], reference_elastic([good['update']], [good['sensitivity']], [1], 0.5)[0],
                             rtol=1e-6)
  assert output.measurements['dropped_clients'] == 1


def test_secure_mode_matches_reference_within_quantization():
  shapes = [(4,), (2,)]
  rng = np.random.default_rng(3)
  updates = [[rng.uniform(-0.5, 0.5, size=s).astype(F32) for s in shapes] for _ in range(3)]
  sensitivities = [[rng.uniform(0, 0.9, size=s).astype(F32) for s in shapes] for _ in range(3)]
  weights = [5.0, 20.0, 10.0]
  factory = elastic.ElasticFactory(tau=0.5, secure=True, value_bound=1.0, weight_bound=50.0)
  process = factory.create(value_type(shapes), tff.TensorType(F32))
  values = [collections.OrderedDict(update=u, sensitivity=s) for u, s in zip(updates, sensitivities)]
  output = process.next(process.initialize(), values, [F32(w) for w in weights])
  # The documented propagation (`elastic.scaled_update_error_bound`) of the two secure means' documented errors.
  w = np.asarray(weights, np.float64)
  for leaf, (got, want) in enumerate(zip(output.result, reference_elastic(updates, sensitivities, weights, 0.5))):
    leaf_updates = np.stack([u[leaf] for u in updates]).astype(np.float64)
    leaf_sensitivities = np.stack([s[leaf] for s in sensitivities]).astype(np.float64)
    omega, delta = w @ leaf_sensitivities / w.sum(), w @ leaf_updates / w.sum()
    omega_error = secure_mean.error_bound(3, w.sum(), 1.0, 50.0, np.abs(omega), np.abs(leaf_sensitivities).max(0))
    delta_error = secure_mean.error_bound(3, w.sum(), 1.0, 50.0, np.abs(delta), np.abs(leaf_updates).max(0))
    bound = elastic.scaled_update_error_bound(omega, delta, omega_error, delta_error, 0.5)
    assert np.max(bound) < 1e-6  # Far below the values' scale (0.5): a wrong scale would fail the check below.
    error = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(error <= bound), (error, bound)
  assert output.measurements['update']['value_clipped_clients'] == 0


def test_invalid_arguments():
  with pytest.raises(ValueError, match='tau'):
    elastic.ElasticFactory(tau=-0.1)
  with pytest.raises(ValueError, match='tau'):
    elastic.ElasticFactory(tau=float('nan'))
  with pytest.raises(ValueError, match='value_bound'):
    elastic.ElasticFactory(secure=True)
  with pytest.raises(ValueError, match='sensitivity_bound'):
    elastic.ElasticFactory(secure=True, value_bound=1.0, sensitivity_bound=0.0)
  with pytest.raises(ValueError, match='secure'):
    elastic.ElasticFactory(secure='yes')
  factory = elastic.ElasticFactory()
  with pytest.raises(TypeError, match='update'):
    factory.create(tff.to_type([tff.TensorType(F32, [3])]), tff.TensorType(F32))
  mismatched = tff.to_type(collections.OrderedDict(
      update=[tff.TensorType(F32, [3])], sensitivity=[tff.TensorType(F32, [4])]))
  with pytest.raises(TypeError, match='same structure'):
    factory.create(mismatched, tff.TensorType(F32))


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types and weight dtypes (Elastic takes no inner factory).

CLIP_COUNTS = collections.OrderedDict(value_clipped_clients=np.int32, weight_clipped_clients=np.int32)


def elastic_measurements(mean_measurements):
  return collections.OrderedDict(zeta_min=np.float32, zeta_max=np.float32, zeta_mean=np.float32,
                                 dropped_clients=np.int32, nonfinite_result=np.int32, zero_result=np.int32,
                                 update=mean_measurements, sensitivity=mean_measurements)


def paired(part_type):
  return tff.to_type(collections.OrderedDict(update=part_type, sensitivity=part_type))


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('part_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties(part_type, weight_dtype):
  factory = elastic.ElasticFactory()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  utils.assert_process_types(
      factory.create(paired(part_type), weight_type), state_type=collections.OrderedDict(update=(), sensitivity=()),
      value_type=paired(part_type), weight_type=weight_type, measurements_type=elastic_measurements(()),
      result_type=part_type)


@pytest.mark.parametrize('weight_dtype', [np.float32, np.int32])
def test_type_properties_secure(weight_dtype):
  weight_type = tff.TensorType(weight_dtype)
  process = elastic.ElasticFactory(secure=True, value_bound=1.0).create(paired(utils.STRUCT_TYPE), weight_type)
  utils.assert_process_types(
      process, state_type=collections.OrderedDict(update=(), sensitivity=()), value_type=paired(utils.STRUCT_TYPE),
      weight_type=weight_type, measurements_type=elastic_measurements(CLIP_COUNTS), result_type=utils.STRUCT_TYPE)


@functools.lru_cache(maxsize=None)
def _process(secure, weight_dtype):
  factory = elastic.ElasticFactory(tau=0.5, secure=secure, value_bound=1.0 if secure else None, weight_bound=8.0)
  return factory.create(value_type([(3,), (2, 2)]), tff.TensorType(weight_dtype))


@pytest.mark.parametrize('weight_dtype', [np.int32, np.int64])
@pytest.mark.parametrize('secure', [False, True])
def test_int_weights_give_the_float32_result(secure, weight_dtype):
  rng = np.random.default_rng(13)
  values = [collections.OrderedDict(update=[rng.uniform(-0.5, 0.5, size=s).astype(F32) for s in [(3,), (2, 2)]],
                                    sensitivity=[rng.uniform(0, 0.9, size=s).astype(F32) for s in [(3,), (2, 2)]])
            for _ in range(4)]
  int_weights = [weight_dtype(w) for w in (5, 1, 12, 0)]  # 12 is above weight_bound: clipped in secure mode.
  got = _process(secure, weight_dtype).next(_process(secure, weight_dtype).initialize(), values, int_weights)
  want = _process(secure, np.float32).next(_process(secure, np.float32).initialize(), values,
                                           [F32(w) for w in int_weights])
  for g, w in zip(got.result, want.result):
    np.testing.assert_array_equal(g, w)
  assert got.measurements == want.measurements
