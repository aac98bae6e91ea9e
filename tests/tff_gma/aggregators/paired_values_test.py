"""`split_paired_value_type`: the value type check Elastic and FedGMA share."""

import collections

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma.aggregators import paired_values

F32 = tff.TensorType(np.float32, [3])
F64 = tff.TensorType(np.float64, [3])


def pair(first, second, names=('update', 'gradient')):
  return tff.to_type(collections.OrderedDict([(names[0], first), (names[1], second)]))


def test_returns_the_two_parts():
  part = tff.to_type([F32, tff.TensorType(np.float32, [2, 2])])
  first, second = paired_values.split_paired_value_type(pair(part, part), 'update', 'gradient', same_dtypes=True)
  assert first.is_equivalent_to(part) and second.is_equivalent_to(part)
  # Without same_dtypes only structure and shapes must agree (Elastic: a float64 sensitivity is fine).
  first, second = paired_values.split_paired_value_type(pair(F32, F64, ('update', 'sensitivity')), 'update',
                                                        'sensitivity')
  assert first.is_equivalent_to(F32) and second.is_equivalent_to(F64)


@pytest.mark.parametrize('value_type,match', [
    (tff.to_type([F32, F32]), 'exactly the fields'),
    (pair(F32, F32, ('gradient', 'update')), 'in this order'),
    (tff.to_type(collections.OrderedDict(update=F32, gradient=F32, extra=F32)), 'exactly the fields'),
    (F32, 'must be a struct'),
    (tff.FederatedType(pair(F32, F32), tff.CLIENTS), 'must be a struct'),
    (pair(F32, tff.TensorType(np.int32, [3])), 'float dtype'),
    (pair(F32, tff.TensorType(np.float32, [4])), 'same structure and shapes'),
    (pair(tff.to_type([F32]), tff.to_type([F32, F32])), 'same structure and shapes'),
    (pair(tff.to_type(collections.OrderedDict(a=F32)), tff.to_type(collections.OrderedDict(b=F32))),
     'same structure and shapes'),
    (pair(F32, F64), 'same dtypes'),
])
def test_bad_value_types_raise_type_error(value_type, match):
  with pytest.raises(TypeError, match=match):
    paired_values.split_paired_value_type(value_type, 'update', 'gradient', same_dtypes=True)
