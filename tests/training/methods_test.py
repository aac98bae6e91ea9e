"""training.engine.methods: algorithm x aggregator combinations, and SCAFFOLD's client state across a save/load."""

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma import models
from tff_gma.data import loaders
from training import config as config_lib
from training.engine import corruption
from training.engine import fedavg_family
from training.engine import methods
from training.engine import registry
from training.runner import round_loop


@pytest.mark.parametrize('algorithm, aggregator, flag', [
    ('fedsgd', 'mean', 'algorithm'), ('fedavg', 'median_of_means', 'aggregator'),
    ('fedprox', 'elastic', 'aggregator'), ('scaffold', 'elastic', 'aggregator'),
    ('personalized', 'elastic', 'aggregator'),
])
def test_impossible_combinations_name_the_flag(algorithm, aggregator, flag):
  with pytest.raises(ValueError, match=flag):
    registry.check(algorithm, aggregator)


def test_scaffold_client_state_survives_checkpoint_and_restore(tmp_path):
  data = loaders.load_federated_data('digits', 'iid', 3, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  method = methods.build(model_fn, 'scaffold', 'mean', algorithm_config=config_lib.AlgorithmConfig(client_lr=0.05),
                         num_clients=3)
  state = round_loop.seeded_initial_state(method.process, build_keras, 0)
  ids = data.train.client_ids[:2]
  datasets = [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=32, seed=0, round_num=1)
              for c in ids]
  state, _ = method.run_round(state, ids, datasets, 1)
  saved = {c: [np.array(v) for v in method.client_state.get(c)] for c in ids}
  assert any(np.any(v != 0) for v in saved[ids[0]])  # A client that trained has a non-zero control variate.
  method.checkpoint_client_state(str(tmp_path), 1)

  fresh = methods.build(model_fn, 'scaffold', 'mean', algorithm_config=config_lib.AlgorithmConfig(client_lr=0.05),
                        num_clients=3)
  fresh.restore_client_state(str(tmp_path), 1)
  for c in ids:
    for a, b in zip(saved[c], fresh.client_state.get(c)):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError, match='round 2'):
    fresh.restore_client_state(str(tmp_path), 2)


@pytest.mark.parametrize('name, expected', [
    ('gma', ('fedavg', 'gma')), ('fedgma', ('fedgma', 'mean')), ('personalized', ('personalized', 'rfa')),
    ('scaffold/rfa', ('scaffold', 'rfa')), ('fedadam/elastic', ('fedadam', 'elastic')),
])
def test_method_names_resolve(name, expected):
  assert registry.resolve(name) == expected


@pytest.mark.parametrize('name', ['nope', 'fedprox/elastic', 'personalized/elastic', 'fedavg/'])
def test_unknown_method_names_are_refused(name):
  with pytest.raises(ValueError):
    registry.resolve(name)


def test_update_corruption_needs_the_fedavg_family():
  with pytest.raises(ValueError, match='corruption'):
    registry.check('scaffold', 'mean', 'omniscient')
  with pytest.raises(ValueError, match='corruption'):
    registry.check('fedavg', 'elastic', 'gaussian')
  registry.check('fedprox', 'rfa', 'omniscient')
  registry.check('scaffold', 'mean', 'data_negate')  # Data poisoning needs no cooperation of the client work.


def test_fedadam_with_gma_is_algorithm_2():
  """The runner's fedadam + gma is `build_gma_fed_avg` (mask on Adam's step), not the drop-in factory."""
  data = loaders.load_federated_data('digits', 'iid', 3, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  algorithm_config = config_lib.AlgorithmConfig(name='fedadam', client_lr=0.05, server_lr=0.05)
  datasets = [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=32, seed=0, round_num=1)
              for c in data.train.client_ids]

  def one_round(process):
    state = process.next(round_loop.seeded_initial_state(process, build_keras, 0), datasets).state
    return process.get_model_weights(state).trainable

  runner = one_round(methods.build(model_fn, 'fedadam', 'gma', algorithm_config=algorithm_config).process)
  # The corrupted runs compose the same server: with no client corrupted, the same round.
  ids = tuple(data.train.client_ids)
  corruptible = methods.build(model_fn, 'fedadam', 'gma', algorithm_config=algorithm_config,
                              update_corruption=corruption.UpdateCorruption('gaussian', (), ids, 0))
  corrupted_state, _ = corruptible.run_round(
      round_loop.seeded_initial_state(corruptible.process, build_keras, 0), ids, datasets, 1)
  algorithm_2 = one_round(learning.build_gma_fed_avg(
      model_fn, fedavg_family.client_optimizer(algorithm_config), fedavg_family.server_optimizer(algorithm_config),
      loop_implementation=tff.learning.LoopImplementation.DATASET_ITERATOR))  # The runner's client loop.
  drop_in = one_round(fedavg_family.build_learning_process(model_fn, algorithm_config,
                                                          aggregators.GradientMaskedFactory()))
  for a, b, c in zip(runner, algorithm_2, corruptible.process.get_model_weights(corrupted_state).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # The same computation: float noise only.
    np.testing.assert_allclose(c, b, rtol=1e-6, atol=1e-7)
  assert max(np.max(np.abs(a - b)) for a, b in zip(runner, drop_in)) > 1e-3


@pytest.mark.parametrize('name', [a.name for a in registry.AGGREGATOR_RECORDS.values()
                                  if a.kind == registry.MODEL_AGGREGATOR and not a.private
                                  and a.name in ('median', 'trimmed_mean', 'krum')])
def test_registry_refuses_secure_for_baselines_that_collect_every_update(name):
  settings = registry.settings_of(config_lib.AggregatorParams(secure=True, secure_bound=1.0))
  with pytest.raises(ValueError, match=f'secure: aggregator {name!r} needs every client update'):
    registry.check_settings('fedavg', name, settings)


def test_gma_dropin_is_the_factory_inside_tffs_builder_and_gma_is_algorithm_2():
  data = loaders.load_federated_data('digits', 'label_skew', 4, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  algorithm_config = config_lib.AlgorithmConfig(name='fedadam', client_lr=0.05, server_lr=0.05)
  stock = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, fedavg_family.client_optimizer(algorithm_config), fedavg_family.server_optimizer(algorithm_config),
      model_aggregator=aggregators.GradientMaskedFactory(), loop_implementation=fedavg_family.LOOP_IMPLEMENTATION)
  ids = data.train.client_ids
  datasets = [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=16, seed=0, round_num=1)
              for c in ids]

  def one_round(process):
    state = round_loop.seeded_initial_state(process, build_keras, 0)
    for round_num in (1, 2):
      state = process.next(state, datasets).state
    return [np.asarray(w) for w in process.get_model_weights(state).trainable]

  expected = one_round(stock)
  dropin = one_round(methods.build(model_fn, 'fedadam', 'gma_dropin', algorithm_config=algorithm_config).process)
  step = one_round(methods.build(model_fn, 'fedadam', 'gma', algorithm_config=algorithm_config).process)
  for got, want in zip(dropin, expected):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert max(np.max(np.abs(a - b)) for a, b in zip(step, expected)) > 1e-4  # Algorithm 2 is another step.
