"""The plain weighted mean, the choice of mean, and the unweighted use of a weighted factory (`mean`)."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import mean
from tff_gma.aggregators import secure_mean
from tests.tff_gma.aggregators import aggregator_test_utils as utils


def test_federated_mean_factory():
  proc = mean.FederatedMeanFactory().create(utils.NESTED_TYPE, tff.TensorType(np.float32))
  rng = np.random.default_rng(0)
  for n in (1, 4):
    values, weights = utils.random_nested_values(rng, n), [np.float32(w) for w in rng.uniform(0.1, 5, n)]
    result = proc.next(proc.initialize(), values, weights).result
    np.testing.assert_allclose(utils.flat(result), utils.weighted_mean(values, weights), rtol=1e-5, atol=1e-6)
  result = proc.next(proc.initialize(), utils.random_nested_values(rng, 3), [np.float32(0)] * 3).result
  np.testing.assert_array_equal(utils.flat(result), 0.0)  # Zero total weight: zeros, not NaN.


def test_as_unweighted():
  factory = mean.as_unweighted(mean.FederatedMeanFactory())
  assert isinstance(factory, tff.aggregators.UnweightedAggregationFactory)
  proc = factory.create(utils.NESTED_TYPE)
  values = utils.random_nested_values(np.random.default_rng(3), 3)
  result = proc.next(proc.initialize(), values).result
  np.testing.assert_allclose(utils.flat(result), utils.weighted_mean(values, [1, 1, 1]), rtol=1e-6, atol=1e-7)
  with pytest.raises(TypeError):
    mean.as_unweighted(tff.aggregators.UnweightedMeanFactory())


def test_weighted_mean_factory_chooses_by_secure():
  assert type(mean.weighted_mean_factory(False, None, 1e4)) is mean.FederatedMeanFactory
  secure = mean.weighted_mean_factory(True, 2.0, 50.0)
  assert type(secure) is secure_mean.SecureWeightedMeanFactory
  assert (secure.value_bound, secure.weight_bound) == (2.0, 50.0)
  with pytest.raises(ValueError, match='value_bound'):
    mean.weighted_mean_factory(True, None, 1e4)


# ----------------------------------------------------------------------------------------------------------------
# Contract (as TFF's mean_test.py): process types, an inner factory's state and measurements.


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES)
@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_federated_mean_type_properties(value_type, weight_dtype):
  factory = mean.FederatedMeanFactory()
  assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  process = factory.create(value_type, tff.TensorType(weight_dtype))
  utils.assert_process_types(process, state_type=(), value_type=value_type, weight_type=tff.TensorType(weight_dtype),
                             measurements_type=())


@pytest.mark.parametrize('value_type', [utils.FLOAT_TYPE, utils.STRUCT_TYPE], ids=['float', 'struct'])
def test_as_unweighted_type_properties(value_type):
  factory = mean.as_unweighted(mean.FederatedMeanFactory())
  utils.assert_process_types(factory.create(value_type), state_type=(), value_type=value_type, weight_type=None,
                             measurements_type=())


def test_as_unweighted_passes_the_inner_state_and_measurements_through():
  process = mean.as_unweighted(utils.WeightedMeanPlusOneFactory()).create(utils.STRUCT_TYPE)
  utils.assert_process_types(process, state_type=np.int32, value_type=utils.STRUCT_TYPE, weight_type=None,
                             measurements_type=np.int32)
  state = process.initialize()
  assert state == 0
  values = [(np.array([1.0, 2.0], np.float32), 3.0), (np.array([3.0, -2.0], np.float32), 5.0)]
  output = process.next(state, values)
  assert output.state == 1 and output.measurements == utils.MEASUREMENT_CONSTANT
  np.testing.assert_allclose(output.result[0], [3.0, 1.0])  # Unit weights: the mean, plus one.
  assert output.result[1] == pytest.approx(5.0)
  assert process.next(output.state, values).state == 2


def test_process_types_helper_rejects_wrong_signatures():
  """The contract helper can fail: a wrong placement, dtype, measurement or weight is caught."""
  process = mean.FederatedMeanFactory().create(utils.FLOAT_TYPE, tff.TensorType(np.float32))
  utils.assert_process_types(process, (), utils.FLOAT_TYPE, tff.TensorType(np.float32), ())
  wrong = [
      dict(state_type=np.int32, value_type=utils.FLOAT_TYPE, weight_type=tff.TensorType(np.float32),
           measurements_type=()),
      dict(state_type=(), value_type=tff.TensorType(np.float64), weight_type=tff.TensorType(np.float32),
           measurements_type=()),
      dict(state_type=(), value_type=utils.FLOAT_TYPE, weight_type=tff.TensorType(np.int32), measurements_type=()),
      dict(state_type=(), value_type=utils.FLOAT_TYPE, weight_type=None, measurements_type=()),
      dict(state_type=(), value_type=utils.FLOAT_TYPE, weight_type=tff.TensorType(np.float32),
           measurements_type=collections.OrderedDict(mean_value=())),
  ]
  for kwargs in wrong:
    with pytest.raises(AssertionError):
      utils.assert_process_types(process, **kwargs)
  _, next_type = utils.process_types((), utils.FLOAT_TYPE, tff.TensorType(np.float32), ())
  clients_result = tff.FunctionType(next_type.parameter, tff.templates.MeasuredProcessOutput(
      tff.FederatedType((), tff.SERVER), tff.FederatedType(utils.FLOAT_TYPE, tff.CLIENTS),
      tff.FederatedType((), tff.SERVER)))
  assert not process.next.type_signature.is_equivalent_to(clients_result)  # Placements count.


@pytest.mark.parametrize('dtype', [np.float16, tf.bfloat16.as_numpy_dtype], ids=['float16', 'bfloat16'])
@pytest.mark.parametrize('secure', [False, True], ids=['plain', 'secure'])
def test_narrow_floats_are_weighted_in_float32(dtype, secure):
  """Weights of 1e6 times a float16 overflow it (max 65504): the means weight and sum in float32, cast back."""
  factory = secure_mean.SecureWeightedMeanFactory(10.0, 1e6) if secure else mean.FederatedMeanFactory()
  proc = factory.create(tff.TensorType(dtype, [2]), tff.TensorType(np.float32))
  values, weights = [np.array([1, 2], dtype), np.array([3, -4], dtype)], [1e6, 3e5]
  result = proc.next(proc.initialize(), values, weights).result
  assert np.asarray(result).dtype == np.dtype(dtype)
  expected = (1e6 * np.array([1., 2.]) + 3e5 * np.array([3., -4.])) / 1.3e6
  half_ulp = 2.0**-11 if dtype == np.float16 else 2.0**-8  # 10 and 7 stored significand bits.
  np.testing.assert_allclose(np.asarray(result, np.float64), expected, rtol=half_ulp * 1.01, atol=1e-6)
