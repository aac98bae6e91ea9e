"""GMA and RFA with TFF's differential privacy and sum slots: refused with one line, never a silent wrong result.

TFF's `DifferentiallyPrivateFactory` treats its `record_aggregation_factory` as a sum of clipped records (and
`MeanFactory` its `value_sum_factory` / `weight_sum_factory`); this library's unweighted factories return means,
so there they would compute a wrong result (before the refusal: `UnweightedGradientMaskedFactory(tau=0)` gave a
third of the mean over 3 clients). Each such use must fail at `create` with a one-line `TypeError` that says what
to use instead; a `mean_factory` that ignores weights must fail at construction. The compositions that are right
keep working, checked against NumPy: TFF's DP aggregator on its own (the supported route to DP) and a clipping
factory around GMA.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import models
from tff_gma.aggregators import composition

VALUE_TYPE = tff.TensorType(np.float32, [3])
CLIENT_VALUES = [
    np.array([1.0, 2.0, -1.0], np.float32),
    np.array([3.0, -2.0, -1.0], np.float32),
    np.array([2.0, 1.0, -4.0], np.float32),
]

INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 8, 8, 1], tf.float32), y=tf.TensorSpec([None], tf.int32))
# Test id -> (the name the refusal gives, the factory).
_UNWEIGHTED = {
    'gma': ('UnweightedGradientMaskedFactory', lambda: aggregators.UnweightedGradientMaskedFactory(tau=0.0)),
    'rfa': ('UnweightedGeometricMedianFactory', aggregators.UnweightedGeometricMedianFactory),
    'one_step_rfa': ('UnweightedGeometricMedianFactory',
                     lambda: aggregators.UnweightedGeometricMedianFactory(one_step=True)),
    'as_unweighted_mean': ('as_unweighted(FederatedMeanFactory)',
                           lambda: aggregators.as_unweighted(aggregators.FederatedMeanFactory())),
}


def _dp_query(clip: float = 100.0):
  """TFF's Gaussian DP-FedAvg query (noise multiplier 0, so that results are exact), 3 expected clients."""
  # pylint: disable-next=protected-access
  return tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=0.0, clients_per_round=3.0, clip=clip)._query


def _assert_one_line_refusal(error: Exception, factory: str, slot: str) -> str:
  message = str(error)
  assert '\n' not in message
  assert message.startswith(f'{factory} cannot be {slot}'), message
  assert 'silently wrong' in message and composition.DOCS in message
  return message


@pytest.mark.parametrize('name', sorted(_UNWEIGHTED))
def test_as_dp_record_aggregation_it_refuses_at_create(name):
  factory_name, make = _UNWEIGHTED[name]
  dp = tff.aggregators.DifferentiallyPrivateFactory(_dp_query(), record_aggregation_factory=make())
  with pytest.raises(TypeError) as error:
    dp.create(VALUE_TYPE)
  message = _assert_one_line_refusal(error.value, factory_name,
                                     "DifferentiallyPrivateFactory's record_aggregation_factory")
  assert 'use tff.aggregators.DifferentiallyPrivateFactory (e.g. gaussian_fixed) itself as the model aggregator' in (
      message)
  assert 'GMA and RFA have no DP variant' in message


def test_behind_a_clipping_factory_inside_dp_it_still_refuses():
  # The clipping factory hands its inner factory's result to DP, which still takes it for a sum.
  inner = tff.aggregators.clipping_factory(1.0, aggregators.UnweightedGradientMaskedFactory())
  dp = tff.aggregators.DifferentiallyPrivateFactory(_dp_query(), record_aggregation_factory=inner)
  with pytest.raises(TypeError) as error:
    dp.create(VALUE_TYPE)
  _assert_one_line_refusal(error.value, 'UnweightedGradientMaskedFactory',
                           "DifferentiallyPrivateFactory's record_aggregation_factory")


def test_a_learning_builder_with_that_dp_aggregator_refuses_when_it_builds():
  model_fn = models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), INPUT_SPEC)
  dp = tff.aggregators.DifferentiallyPrivateFactory(
      _dp_query(), record_aggregation_factory=aggregators.UnweightedGeometricMedianFactory())
  with pytest.raises(TypeError, match="UnweightedGeometricMedianFactory cannot be DifferentiallyPrivateFactory's"):
    tff.learning.algorithms.build_unweighted_fed_avg(
        model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1), model_aggregator=dp)


@pytest.mark.parametrize('mean_factory_class', [tff.aggregators.MeanFactory, tff.aggregators.UnweightedMeanFactory])
def test_as_a_mean_factorys_sum_it_refuses_at_create(mean_factory_class):
  factory = mean_factory_class(value_sum_factory=aggregators.UnweightedGradientMaskedFactory())
  if mean_factory_class is tff.aggregators.MeanFactory:
    create = lambda: factory.create(VALUE_TYPE, tff.TensorType(np.float32))
  else:
    create = lambda: factory.create(VALUE_TYPE)
  with pytest.raises(TypeError) as error:
    create()
  message = _assert_one_line_refusal(error.value, 'UnweightedGradientMaskedFactory',
                                     f"{mean_factory_class.__name__}'s value_sum_factory")
  assert 'use UnweightedGradientMaskedFactory itself as the aggregator' in message


@pytest.mark.parametrize('factory_class', [aggregators.GradientMaskedFactory, aggregators.GeometricMedianFactory,
                                           aggregators.UnweightedGradientMaskedFactory,
                                           aggregators.UnweightedGeometricMedianFactory, aggregators.FedGMAFactory])
def test_a_mean_factory_that_ignores_the_weights_is_refused(factory_class):
  # The route to put TFF's (unweighted) DP mean inside GMA or RFA: it would drop RFA's Weiszfeld weights.
  dp_mean = tff.aggregators.as_weighted_aggregator(tff.aggregators.DifferentiallyPrivateFactory(_dp_query()))
  with pytest.raises(ValueError) as error:
    factory_class(mean_factory=dp_mean)
  message = str(error.value)
  assert '\n' not in message
  assert 'mean_factory ignores the weights it is given' in message and 'FederatedMeanFactory()' in message


def test_outside_a_sum_slot_nothing_is_refused():
  assert composition.sum_slot_above() is None
  # Created directly, and as TFF's builders create them, the factories build as before.
  for _, make in _UNWEIGHTED.values():
    assert isinstance(make().create(VALUE_TYPE), tff.templates.AggregationProcess)
  # A weighted mean factory of this library inside TFF's MeanFactory is the caller's mean, not in a sum slot:
  # only a factory *created by* the sum slot is refused.
  gma = aggregators.GradientMaskedFactory(tau=0.0, mean_factory=tff.aggregators.MeanFactory(no_nan_division=True))
  assert isinstance(gma.create(VALUE_TYPE, tff.TensorType(np.float32)), tff.templates.AggregationProcess)


def test_the_supported_routes_compute_what_numpy_does():
  values = np.stack(CLIENT_VALUES)
  clip = 3.0
  norms = np.linalg.norm(values, axis=1, keepdims=True)
  clipped = values * np.minimum(1.0, clip / norms)
  # DP-FedAvg (TFF's DP aggregator on its own): each update clipped to L2 norm `clip`, summed, noised (here with
  # noise multiplier 0) and divided by the expected number of clients.
  dp = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=0.0, clients_per_round=3.0, clip=clip).create(VALUE_TYPE)
  output = dp.next(dp.initialize(), CLIENT_VALUES)
  np.testing.assert_allclose(output.result, clipped.sum(axis=0) / 3.0, rtol=1e-6)
  # Clipping before GMA (robustness, not privacy) composes: GMA (tau = 0: the mean) of the clipped updates.
  gma = tff.aggregators.clipping_factory(clip, aggregators.UnweightedGradientMaskedFactory(tau=0.0)).create(
      VALUE_TYPE)
  output = gma.next(gma.initialize(), CLIENT_VALUES)
  np.testing.assert_allclose(output.result, clipped.mean(axis=0), rtol=1e-6)
