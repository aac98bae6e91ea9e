"""FedGMA's client gradient and `build_fedgma` on digits (the server step: tests/tff_gma/aggregators/fedgma_test.py)."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.learning import build_fedgma
from tff_gma.learning import fedgma
from tests.tff_gma import fixtures

F32 = np.float32


def test_mean_loss_gradient_matches_direct_gradient():
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))
  keras_model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(3,)), tf.keras.layers.Dense(2)])
  model = tff.learning.models.from_keras_model(
      keras_model, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec=spec)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(10, 3)).astype(F32)
  y = rng.integers(0, 2, size=10).astype(np.int32)
  data = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(4)  # 4 + 4 + 2.
  gradient = fedgma.mean_loss_gradient(model, model.trainable_variables, data)
  with tf.GradientTape() as tape:  # The full-data mean loss in one batch.
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, keras_model(x))
  for got, want in zip(gradient, tape.gradient(loss, keras_model.trainable_variables)):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope='module')
def digits_setup():
  return fixtures.digits_logistic(4)


def test_fedgma_learns_and_reduces_to_fedavg(digits_setup):
  data, build_keras, model_fn = digits_setup
  process = build_fedgma(model_fn, tff.learning.optimizers.build_sgdm(0.1), server_step_size=0.5,
                         mask_threshold=0.8)
  assert isinstance(process, tff.learning.templates.LearningProcess)
  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  state = process.initialize()
  for round_num in range(3):
    output = process.next(state, fixtures.round_datasets(data.train, round_num))
    state = output.state
    gradient_metrics = output.metrics['aggregator']['gradient']
    assert 0 <= gradient_metrics['masked_fraction'] <= 1
    assert gradient_metrics['participating_clients'] == 4
  assert evaluate(process.get_model_weights(state))['accuracy'] > 0.6

  # With eta_s = 0 FedGMA is FedAvg: same start, same (unshuffled) data -> TFF's FedAvg's model.
  fedavg = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0))
  zero_step = build_fedgma(model_fn, tff.learning.optimizers.build_sgdm(0.1), server_step_size=0.0)
  datasets = [data.train.create_tf_dataset_for_client(cid).batch(16) for cid in data.train.client_ids]
  start = process.get_model_weights(state)
  fedavg_state = fedavg.next(fedavg.set_model_weights(fedavg.initialize(), start), datasets).state
  zero_state = zero_step.next(zero_step.set_model_weights(zero_step.initialize(), start), datasets).state
  for a, b in zip(fedavg.get_model_weights(fedavg_state).trainable, zero_step.get_model_weights(zero_state).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_invalid_arguments(digits_setup):
  _, _, model_fn = digits_setup
  with pytest.raises(ValueError, match='gradient_batches'):
    build_fedgma(model_fn, tff.learning.optimizers.build_sgdm(0.1), gradient_batches=0)
