"""`FedGMAFactory`, FedGMA's server step, against a NumPy reference (moved here from tests/tff_gma/learning/)."""

import collections
import functools

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma.aggregators import fedgma
from tests.tff_gma.aggregators import aggregator_test_utils as utils

F32 = np.float32


def reference_server_update(updates, gradients, weights, p, step):
  """Delta + eta_s * (mask * weighted mean gradient); mask: at least a fraction p of clients share the sign."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  out = []
  for leaf in range(len(updates[0])):
    delta = sum(wk * u[leaf] for wk, u in zip(w, updates))
    grads = np.stack([g[leaf] for g in gradients])
    mean_grad = np.tensordot(w, grads, axes=1)
    positive = (grads > 0).mean(axis=0)
    negative = (grads < 0).mean(axis=0)
    mask = np.maximum(positive, negative) >= p
    out.append(delta + step * mask * mean_grad)
  return out


def value_type(shapes):
  leaves = [tff.TensorType(F32, s) for s in shapes]
  return tff.to_type(collections.OrderedDict(update=leaves, gradient=list(leaves)))


@pytest.mark.parametrize('p,step', [(0.8, 0.5), (0.6, 2.0), (1.0, 1.0)])
def test_server_step_matches_numpy_reference(p, step):
  rng = np.random.default_rng(0)
  shapes = [(6,), (2, 3)]
  weights = [1.0, 4.0, 2.0, 3.0, 5.0]
  n = len(weights)
  updates = [[rng.normal(size=s).astype(F32) for s in shapes] for _ in range(n)]
  # Gradients with exactly 5, 4 and 3 of 5 clients on the majority sign, so the threshold is exercised.
  gradients = []
  for k in range(n):
    leaves = []
    for s in shapes:
      magnitude = rng.uniform(0.1, 1.0, size=s)
      agree = np.arange(int(np.prod(s))).reshape(s) % 3  # 0: 5/5 agree, 1: 4/5, 2: 3/5.
      sign = np.where((agree == 1) & (k == 0), -1.0, 1.0)
      sign = np.where((agree == 2) & (k < 2), -1.0, sign)
      leaves.append((sign * magnitude).astype(F32))
    gradients.append(leaves)
  process = fedgma.FedGMAFactory(server_step_size=step, mask_threshold=p).create(
      value_type(shapes), tff.TensorType(F32))
  values = [collections.OrderedDict(update=u, gradient=g) for u, g in zip(updates, gradients)]
  output = process.next(process.initialize(), values, [F32(w) for w in weights])
  for got, want in zip(output.result, reference_server_update(updates, gradients, weights, p, step)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  kept = {0.8: 2 / 3, 0.6: 1.0, 1.0: 1 / 3}[p]  # Fraction of coordinates whose agreement passes.
  assert output.measurements['gradient']['masked_fraction'] == pytest.approx(1 - kept, abs=1e-6)
  assert output.measurements['gradient']['participating_clients'] == n


def test_zero_step_is_the_weighted_mean():
  shapes = [(3,)]
  updates = [[np.array([1.0, 2.0, 3.0], F32)], [np.array([3.0, 2.0, 1.0], F32)]]
  gradients = [[np.array([1.0, 1.0, 1.0], F32)], [np.array([1.0, 1.0, 1.0], F32)]]
  process = fedgma.FedGMAFactory(server_step_size=0.0).create(value_type(shapes), tff.TensorType(F32))
  values = [collections.OrderedDict(update=u, gradient=g) for u, g in zip(updates, gradients)]
  output = process.next(process.initialize(), values, [F32(1.0), F32(3.0)])
  np.testing.assert_allclose(output.result[0], [2.5, 2.0, 1.5])


def test_agreement_threshold_mapping():
  assert fedgma.agreement_threshold(0.8) == pytest.approx(0.6, abs=1e-5)
  assert fedgma.agreement_threshold(0.8) < 0.6  # Exactly 80% of clients agreeing is kept despite rounding.
  assert fedgma.agreement_threshold(0.3) == 0.0
  assert fedgma.agreement_threshold(1.0) == pytest.approx(1.0, abs=1e-5)


def test_invalid_arguments():
  with pytest.raises(ValueError, match='mask_threshold'):
    fedgma.FedGMAFactory(mask_threshold=1.5)
  with pytest.raises(ValueError, match='server_step_size'):
    fedgma.FedGMAFactory(server_step_size=-1.0)
  with pytest.raises(ValueError, match='value_bound'):
    fedgma.FedGMAFactory(secure=True)
  with pytest.raises(ValueError, match='mean_factory'):
    fedgma.FedGMAFactory(mean_factory=tff.aggregators.UnweightedMeanFactory())


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types, the mean factory's state and measurements, weight dtypes.

GMA_MEASUREMENTS = collections.OrderedDict(masked_fraction=np.float32, mean_agreement=np.float32,
                                           participating_clients=np.int32, dropped_clients=np.int32,
                                           nonfinite_result=np.int32, zero_result=np.int32, mean=())


RESULT_FLAGS = collections.OrderedDict(nonfinite_result=np.int32, zero_result=np.int32)


def paired(part_type):
  return tff.to_type(collections.OrderedDict(update=part_type, gradient=part_type))


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('part_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_type_properties(part_type, weight_dtype):
  factory = fedgma.FedGMAFactory()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  weight_type = tff.TensorType(weight_dtype)
  utils.assert_process_types(
      factory.create(paired(part_type), weight_type), state_type=collections.OrderedDict(update=(), gradient=()),
      value_type=paired(part_type), weight_type=weight_type,
      measurements_type=collections.OrderedDict(update=(), gradient=GMA_MEASUREMENTS, **RESULT_FLAGS),
      result_type=part_type)


def test_type_properties_secure():
  weight_type = tff.TensorType(np.int32)
  clip_counts = collections.OrderedDict(value_clipped_clients=np.int32, weight_clipped_clients=np.int32)
  gradient_measurements = collections.OrderedDict(GMA_MEASUREMENTS, mean=clip_counts)
  process = fedgma.FedGMAFactory(secure=True, value_bound=1.0).create(paired(utils.STRUCT_TYPE), weight_type)
  utils.assert_process_types(
      process, state_type=collections.OrderedDict(update=(), gradient=()), value_type=paired(utils.STRUCT_TYPE),
      weight_type=weight_type,
      measurements_type=collections.OrderedDict(update=clip_counts, gradient=gradient_measurements, **RESULT_FLAGS),
      result_type=utils.STRUCT_TYPE)


def test_mean_factory_state_and_measurements_pass_through():
  """state['update'] is the mean factory's state, measurements['update'] its measurements; with
  server_step_size=0 the result is its result (here the weighted mean plus one)."""
  weight_type = tff.TensorType(np.int32)
  process = fedgma.FedGMAFactory(server_step_size=0.0, mean_factory=utils.WeightedMeanPlusOneFactory()).create(
      paired(utils.STRUCT_TYPE), weight_type)
  utils.assert_process_types(
      process, state_type=collections.OrderedDict(update=np.int32, gradient=()),
      value_type=paired(utils.STRUCT_TYPE), weight_type=weight_type,
      measurements_type=collections.OrderedDict(update=np.int32, gradient=GMA_MEASUREMENTS, **RESULT_FLAGS),
      result_type=utils.STRUCT_TYPE)
  state = process.initialize()
  assert state['update'] == 0
  parts = [(np.array([1.0, 2.0], F32), 3.0), (np.array([3.0, -2.0], F32), 5.0)]
  values = [collections.OrderedDict(update=p, gradient=p) for p in parts]
  weights = [np.int32(1), np.int32(3)]
  output = process.next(state, values, weights)
  assert output.state['update'] == 1
  assert output.measurements['update'] == utils.MEASUREMENT_CONSTANT
  np.testing.assert_allclose(output.result[0], [3.5, 0.0], rtol=1e-6)
  assert output.result[1] == pytest.approx(5.5)
  assert process.next(output.state, values, weights).state['update'] == 2


@functools.lru_cache(maxsize=None)
def _process(weight_dtype):
  return fedgma.FedGMAFactory(server_step_size=0.5, mask_threshold=0.6).create(
      value_type([(6,), (2, 3)]), tff.TensorType(weight_dtype))


@pytest.mark.parametrize('weight_dtype', [np.int32, np.int64])
def test_int_weights_give_the_float32_result(weight_dtype):
  rng = np.random.default_rng(3)
  values = [collections.OrderedDict(update=[rng.normal(size=s).astype(F32) for s in [(6,), (2, 3)]],
                                    gradient=[rng.normal(size=s).astype(F32) for s in [(6,), (2, 3)]])
            for _ in range(5)]
  int_weights = [weight_dtype(w) for w in (1, 4, 2, 3, 5)]
  got = _process(weight_dtype).next(_process(weight_dtype).initialize(), values, int_weights)
  want = _process(np.float32).next(_process(np.float32).initialize(), values, [F32(w) for w in int_weights])
  for g, w in zip(got.result, want.result):
    np.testing.assert_array_equal(g, w)
  assert got.measurements == want.measurements
