"""The client-side checks and preparation every factory shares (`tff_gma.aggregators.client_values`)."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import client_values
from tests.tff_gma.aggregators import aggregator_test_utils as utils


def test_drop_invalid_clients():
  value = collections.OrderedDict(a=tf.constant([1.0, np.nan]), b=[tf.constant([[2.0]])])
  clean, weight, keep = client_values.drop_invalid_clients(value, tf.constant(3.0))
  assert int(keep) == 0 and float(weight) == 0.0
  assert all(np.all(np.asarray(x) == 0) for x in tf.nest.flatten(clean))
  finite = collections.OrderedDict(a=tf.constant([1.0, -2.0]), b=[tf.constant([[2.0]])])
  for bad_weight in (np.inf, np.nan, -0.5):
    _, weight, keep = client_values.drop_invalid_clients(finite, tf.constant(bad_weight, tf.float32))
    assert int(keep) == 0 and float(weight) == 0.0
  clean, weight, keep = client_values.drop_invalid_clients(finite, tf.constant(0.0))
  assert int(keep) == 1 and float(weight) == 0.0  # Zero weight is valid (it just contributes nothing).
  np.testing.assert_array_equal(clean['a'], [1.0, -2.0])


def test_drop_invalid_clients_casts_the_weight_and_drops_an_overflowing_norm():
  finite = collections.OrderedDict(a=tf.constant([1.0, -2.0]), b=[tf.constant([[2.0]])])
  _, weight, keep = client_values.drop_invalid_clients(finite, tf.constant(5, tf.int32))
  assert weight.dtype == tf.float32 and float(weight) == 5.0 and int(keep) == 1
  # Every coordinate finite, but the squared norm overflows float32 (3e19^2 > 3.4e38).
  huge = collections.OrderedDict(a=tf.constant([3e19, 0.0]), b=[tf.constant([[0.0]])])
  _, weight, keep = client_values.drop_invalid_clients(huge, tf.constant(1.0))
  assert int(keep) == 0 and float(weight) == 0.0


def test_clip_to_bounds_flags_what_it_changes():
  value = collections.OrderedDict(a=tf.constant([0.5, -3.0]), b=[tf.constant([[2.0]])])
  clipped, weight, value_flag, weight_flag = client_values.clip_to_bounds(value, tf.constant(7.0), 2.0, 5.0)
  np.testing.assert_array_equal(clipped['a'], [0.5, -2.0])
  np.testing.assert_array_equal(clipped['b'][0], [[2.0]])  # On the bound: unchanged.
  assert float(weight) == 5.0 and int(value_flag) == 1 and int(weight_flag) == 1
  _, _, value_flag, weight_flag = client_values.clip_to_bounds(value, tf.constant(1.0), 3.0, 5.0)
  assert int(value_flag) == 0 and int(weight_flag) == 0


@pytest.mark.parametrize('weight_dtype', utils.WEIGHT_DTYPES + (np.uint8, np.int16, np.float16))
def test_weight_type_accepts_real_scalars_computed_in_float(weight_dtype):
  client_values.check_weight_type(tff.TensorType(weight_dtype))
  expected = np.float64 if weight_dtype == np.float64 else np.float32
  assert client_values.float_weight_dtype(weight_dtype) == expected
  assert client_values.float_weight_type(tff.TensorType(weight_dtype)) == tff.TensorType(expected)


@pytest.mark.parametrize('weight_type', [
    tff.TensorType(np.bool_), tff.TensorType(np.complex64), tff.TensorType(np.float32, [2]),
    tff.TensorType(np.str_), tff.FederatedType(np.float32, tff.CLIENTS)])
def test_weight_type_refuses_the_rest(weight_type):
  with pytest.raises(TypeError, match='weight_type'):
    client_values.check_weight_type(weight_type)


@pytest.mark.parametrize('value_type', [
    tff.TensorType(np.int32, [2]), tff.TensorType(np.float32, [None]), tff.to_type(()),
    tff.FederatedType(np.float32, tff.CLIENTS)])
def test_float_structure_refuses_non_float_partial_empty_or_placed_types(value_type):
  with pytest.raises(TypeError, match='update'):
    client_values.check_float_structure(value_type, 'update')


def test_float_structures_and_their_sizes():
  for value_type in (utils.FLOAT_TYPE, utils.STRUCT_TYPE, utils.NESTED_TYPE):
    client_values.check_float_structure(value_type)
  assert [client_values.num_elements(t) for t in (utils.FLOAT_TYPE, utils.STRUCT_TYPE, utils.NESTED_TYPE)] == [1, 3, 7]
  assert client_values.tensor_types(utils.STRUCT_TYPE) == [tff.TensorType(np.float32, [2]), tff.TensorType(np.float64)]
