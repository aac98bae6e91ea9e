"""End-to-end FedAvg on the embedded digits through tff_gma.simulation, plus its building blocks."""

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.data import digits
from training import config as config_lib
from training.engine import evaluation
from training.engine import fedavg_family
from training.runner import round_loop


def _train(algorithm: str, rounds: int, seed: int = 0, aggregator=None):
  split = digits.load_split()
  data = digits.federated_data('iid', num_clients=4, seed=seed)
  train = data.train
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  algorithm_config = config_lib.AlgorithmConfig(
      name=algorithm, client_lr=0.05, server_lr=0.05 if algorithm in ('fedadam', 'fedyogi') else 1.0)
  process = fedavg_family.build_learning_process(model_fn, algorithm_config, aggregator)
  state = round_loop.seeded_initial_state(process, build_keras, seed)
  evaluator = evaluation.CentralEvaluator(build_keras, split.x_test, split.y_test)
  history = [evaluator(process.get_model_weights(state))['accuracy']]
  for r in range(1, rounds + 1):
    data = [round_loop.client_dataset(train, c, local_epochs=1, batch_size=16, seed=seed, round_num=r)
            for c in train.client_ids]
    state = process.next(state, data).state
    history.append(evaluator(process.get_model_weights(state))['accuracy'])
  return process.get_model_weights(state), history


def test_fedavg_learns_digits_and_is_repeatable():
  weights, history = _train('fedavg', rounds=3)
  assert history[0] < 0.3  # Untrained: about chance (10 classes).
  assert history[-1] > 0.75, history
  weights_again, _ = _train('fedavg', rounds=3)
  for a, b in zip(weights.trainable, weights_again.trainable):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('algorithm', ['fedprox', 'fedadam', 'fedyogi'])
def test_other_algorithms_learn(algorithm):
  _, history = _train(algorithm, rounds=2)
  assert history[-1] > history[0] + 0.2, history


def test_evaluator_matches_numpy_logistic_regression():
  split = digits.load_split()
  build_keras = models.keras_builder('logistic', digits.IMAGE_SHAPE, digits.NUM_CLASSES)
  rng = np.random.default_rng(1)
  kernel = rng.normal(size=(64, 10)).astype(np.float32)
  bias = rng.normal(size=10).astype(np.float32)
  weights = tff.learning.models.ModelWeights(trainable=[kernel, bias], non_trainable=[])
  metrics = evaluation.CentralEvaluator(build_keras, split.x_test, split.y_test)(weights)
  logits = split.x_test.reshape(len(split.x_test), -1) @ kernel + bias
  expected_acc = np.mean(np.argmax(logits, 1) == split.y_test)
  shifted = logits - logits.max(1, keepdims=True)
  expected_loss = np.mean(np.log(np.exp(shifted).sum(1)) - shifted[np.arange(len(logits)), split.y_test])
  assert metrics['accuracy'] == pytest.approx(expected_acc)
  assert metrics['loss'] == pytest.approx(expected_loss, rel=1e-5)


def test_evaluator_reports_a_diverged_model_without_warnings():
  split = digits.load_split()
  build_keras = models.keras_builder('logistic', digits.IMAGE_SHAPE, digits.NUM_CLASSES)
  kernel = np.full((64, 10), np.nan, np.float32)
  weights = tff.learning.models.ModelWeights(trainable=[kernel, np.zeros(10, np.float32)], non_trainable=[])
  with np.errstate(all='raise'):  # A numpy warning would raise here.
    metrics = evaluation.CentralEvaluator(build_keras, split.x_test, split.y_test)(weights)
  assert np.isnan(metrics['loss'])
  assert metrics['accuracy'] == pytest.approx(np.mean(split.y_test == 0))  # argmax of a NaN row is 0.


def test_sample_clients_is_a_function_of_seed_and_round():
  ids = [f'c{i}' for i in range(20)]
  a = round_loop.sample_clients(ids, 5, seed=3, round_num=7)
  assert a == round_loop.sample_clients(ids, 5, seed=3, round_num=7)
  assert len(set(a)) == 5 and set(a) <= set(ids)
  assert a != round_loop.sample_clients(ids, 5, seed=3, round_num=8)
  assert round_loop.sample_clients(ids, 20, seed=3, round_num=1) == ids
  with pytest.raises(ValueError, match='clients_per_round'):
    round_loop.sample_clients(ids, 21, seed=0, round_num=1)


@pytest.mark.parametrize('kwargs, name', [
    ({'name': 'sgd'}, 'algorithm'), ({'client_lr': 0.0}, 'client_lr'), ({'server_lr': -1.0}, 'server_lr'),
    ({'client_momentum': 1.0}, 'client_momentum'), ({'proximal_strength': -0.1}, 'proximal_strength'),
])
def test_algorithm_config_rejects_bad_values(kwargs, name):
  with pytest.raises(ValueError, match=name):
    config_lib.AlgorithmConfig(**kwargs)


def test_flatten_metrics():
  nested = {'a': {'b': np.float32(1.5), 'c': np.array([1, 2])}, 'd': 3}
  assert round_loop.flatten_metrics(nested) == {'a/b': 1.5, 'd': 3.0}
