"""Clients split over two TFF workers (TFF's mergeable-computation runtime) give the one-worker result."""

import numpy as np
import pytest

from tff_gma import aggregators
from tff_gma import models
from tff_gma import runtime
from tff_gma import simulation
from tff_gma.data import loaders


@pytest.fixture(scope='module')
def two_workers():
  workers = runtime.start_local_workers(2)
  yield [w.target for w in workers]
  for w in workers:
    w.stop()
  runtime.set_simulation_context()  # Back to the suite's context.


def _one_round(aggregator, set_context):
  data = loaders.load_federated_data('digits', 'iid', 4, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  process = simulation.build_learning_process(
      models.model_fn(build_keras, data.input_spec), simulation.AlgorithmConfig(), aggregator)
  set_context()
  state = simulation.seeded_initial_state(process, build_keras, 0)
  datasets = [simulation.client_dataset(data.train, c, local_epochs=1, batch_size=16, seed=0, round_num=1)
              for c in data.train.client_ids]
  output = process.next(state, datasets)
  return process.get_model_weights(output.state), output.metrics


@pytest.mark.parametrize('aggregator', [
    None, aggregators.GradientMaskedFactory(tau=0.4),
    aggregators.GradientMaskedFactory(tau=0.4, secure=True, value_bound=1.0),
], ids=['tff_mean', 'gma', 'gma_secure'])
def test_two_workers_match_one(aggregator, two_workers):
  one, metrics_one = _one_round(aggregator, runtime.set_simulation_context)
  two, metrics_two = _one_round(aggregator, lambda: runtime.set_multi_worker_context(two_workers))
  runtime.set_simulation_context()
  for a, b in zip(one.trainable, two.trainable):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert not np.allclose(one.trainable[0], 0)
  assert (metrics_one['client_work']['train']['num_examples']
          == metrics_two['client_work']['train']['num_examples'])


def test_multi_stage_aggregator_is_refused_before_running():
  data = loaders.load_federated_data('digits', 'iid', 2, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  rfa = simulation.build_learning_process(model_fn, simulation.AlgorithmConfig(),
                                          aggregators.GeometricMedianFactory(num_passes=3))
  with pytest.raises(ValueError, match='3 sequential'):
    runtime.check_single_aggregation_stage(rfa)
  gma = simulation.build_learning_process(model_fn, simulation.AlgorithmConfig(), aggregators.GradientMaskedFactory())
  assert runtime.check_single_aggregation_stage(gma) == 1


def test_bad_targets_are_rejected():
  with pytest.raises(ValueError, match='host:port'):
    runtime.set_multi_worker_context(['localhost'])
  with pytest.raises(ValueError, match='at least one'):
    runtime.set_multi_worker_context([])
