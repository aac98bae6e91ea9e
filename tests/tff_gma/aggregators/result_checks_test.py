"""No factory hands the server a non-finite update, or a zero one, without a measurement that says so."""

import collections

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import aggregators
from tests import tiers

VECTOR = tff.TensorType(np.float32, [3])
WEIGHT = tff.TensorType(np.float32)
OPPOSITE = [np.array([1., -2., 3.], np.float32), np.array([-1., 2., -3.], np.float32)]


def _paired(part, second_name):
  return tff.to_type(collections.OrderedDict([('update', part), (second_name, part)]))


# name -> (factory with TFF's MeanFactory inside, which divides a zero weight sum into inf/NaN; value type;
# values built from plain vectors).
FACTORIES = {
    'gma': (lambda inner: aggregators.GradientMaskedFactory(tau=0.0, mean_factory=inner), VECTOR, lambda v: v),
    'rfa': (lambda inner: aggregators.GeometricMedianFactory(mean_factory=inner), VECTOR, lambda v: v),
    'fedgma': (lambda inner: aggregators.FedGMAFactory(server_step_size=0.0, mean_factory=inner),
               _paired(VECTOR, 'gradient'), lambda v: collections.OrderedDict(update=v, gradient=v)),
}


def _flags(measurements):
  return measurements['nonfinite_result'], measurements['zero_result']


@pytest.mark.parametrize('name', tiers.first_only(sorted(FACTORIES)))
def test_an_inner_mean_that_returns_nan_gives_a_flagged_zero_update(name):
  make, value_type, to_value = FACTORIES[name]
  process = make(tff.aggregators.MeanFactory()).create(value_type, WEIGHT)
  output = process.next(process.initialize(), [to_value(v) for v in OPPOSITE], [0.0, 0.0])
  result = output.result
  np.testing.assert_array_equal(result, np.zeros(3, np.float32))
  if name == 'rfa':  # Each pass keeps the estimate before it (v_0 = 0): the result itself is finite.
    assert output.measurements['nonfinite_passes'] == 3
  else:
    assert output.measurements['nonfinite_result'] == 1
  # Weight 0: no client participates, so a zero update is what the round should give, not a silent loss.
  assert output.measurements['zero_result'] == 0


CANCELLING = {
    'gma': lambda: (aggregators.GradientMaskedFactory(tau=0.0).create(VECTOR, WEIGHT), OPPOSITE),
    'rfa': lambda: (aggregators.GeometricMedianFactory().create(VECTOR, WEIGHT), OPPOSITE),
    'elastic': lambda: (aggregators.ElasticFactory().create(_paired(VECTOR, 'sensitivity'), WEIGHT),
                        [collections.OrderedDict(update=v, sensitivity=np.abs(v)) for v in OPPOSITE]),
    'fedgma': lambda: (aggregators.FedGMAFactory(server_step_size=0.0).create(_paired(VECTOR, 'gradient'), WEIGHT),
                       [collections.OrderedDict(update=v, gradient=v) for v in OPPOSITE]),
}


@pytest.mark.parametrize('name', tiers.first_only(sorted(CANCELLING)))
def test_a_zero_update_from_non_zero_clients_is_flagged(name):
  process, values = CANCELLING[name]()
  output = process.next(process.initialize(), values, [2.0, 2.0])
  assert _flags(output.measurements) == (0, 1)
  output = process.next(process.initialize(), values, [2.0, 1.0])
  assert _flags(output.measurements) == (0, 0)
