"""Elastic aggregation's client work (sensitivity, split, local training) and `build_elastic_fed_avg` on digits."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import audit
from tff_gma.learning import build_elastic_fed_avg
from tff_gma.learning import elastic
from tests.tff_gma import fixtures

INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))


def tiny_keras():
  return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(3,)),
                              tf.keras.layers.Dense(4, activation='tanh'), tf.keras.layers.Dense(2)])


def tiny_model_fn():
  return tff.learning.models.from_keras_model(
      tiny_keras(), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec=INPUT_SPEC)


def tiny_batches(sizes=(4, 4, 4, 4, 3), seed=0):
  rng = np.random.default_rng(seed)
  return [collections.OrderedDict(x=rng.normal(size=(n, 3)).astype(np.float32),
                                  y=rng.integers(0, 2, size=n).astype(np.int32)) for n in sizes]


def direct_output_gradient(keras_model, x):
  """grad of mean_j ||F(x_j)||^2 by a tape on the Keras model itself."""
  with tf.GradientTape() as tape:
    out = keras_model(x, training=False)
    objective = tf.reduce_sum(tf.square(out)) / x.shape[0]
  return [g.numpy() for g in tape.gradient(objective, keras_model.trainable_variables)]


def test_sensitivity_matches_direct_tf_gradient():
  model = tiny_model_fn()
  keras_model = tiny_keras()
  keras_model.set_weights([v.numpy() for v in model.trainable_variables])
  mu = 0.9
  omega = tuple(tf.zeros_like(v) for v in model.trainable_variables)
  expected = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
  for batch in tiny_batches():
    gradient = elastic.output_norm_gradient(model, model.trainable_variables, batch)
    omega = elastic.accumulate_sensitivity(omega, gradient, mu)
    direct = direct_output_gradient(keras_model, batch['x'])
    for g, d in zip(gradient, direct):
      np.testing.assert_allclose(g.numpy(), d, rtol=1e-5, atol=1e-7)
    expected = [mu * e + (1 - mu) * np.abs(d) for e, d in zip(expected, direct)]
  for got, want in zip(omega, expected):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-8)
    assert np.all(want >= 0) and np.any(want > 0)


@pytest.mark.parametrize('num_batches,fraction,expected', [
    (10, 0.1, 1), (10, 0.25, 3), (5, 0.3, 2), (1, 0.5, 0), (0, 0.5, 0), (3, 0.99, 2), (4, 0.0, 0)])
def test_sensitivity_batch_count(num_batches, fraction, expected):
  assert int(elastic.sensitivity_batch_count(tf.constant(num_batches), fraction)) == expected


def test_client_update_splits_sensitivity_and_training_batches():
  """k = ceil(0.3 * 5) = 2 batches for Omega at the initial model, SGD on the other 3."""
  batches = tiny_batches()
  data = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.concatenate([b['x'] for b in batches]), y=np.concatenate([b['y'] for b in batches]))).batch(4)
  update_fn = elastic.build_elastic_client_update(tiny_model_fn, mu=0.95, sensitivity_fraction=0.3)
  initial = tiny_model_fn()
  initial_weights = tff.learning.models.ModelWeights.from_model(initial)
  lr = 0.1
  result, metrics = update_fn(tff.learning.optimizers.build_sgdm(lr), None, initial_weights, data)

  keras_model = tiny_keras()
  keras_model.set_weights([v.numpy() for v in initial.trainable_variables])
  expected_omega = [np.zeros(v.shape, np.float32) for v in keras_model.trainable_variables]
  for batch in batches[:2]:
    direct = direct_output_gradient(keras_model, batch['x'])
    expected_omega = [0.95 * e + 0.05 * np.abs(d) for e, d in zip(expected_omega, direct)]
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for batch in batches[2:]:
    with tf.GradientTape() as tape:
      loss = loss_fn(batch['y'], keras_model(batch['x'], training=True))
    for v, g in zip(keras_model.trainable_variables, tape.gradient(loss, keras_model.trainable_variables)):
      v.assign_sub(lr * g)
  expected_update = [a.numpy() - b.numpy() for a, b in zip(initial.trainable_variables,
                                                           keras_model.trainable_variables)]

  for got, want in zip(result.update['sensitivity'], expected_omega):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-8)
  for got, want in zip(result.update['update'], expected_update):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
  assert float(result.update_weight) == 4 + 4 + 3  # |D_k|: the examples trained on.
  assert int(metrics['num_examples'][0]) == 11  # Training metrics exclude the sensitivity batches.


@pytest.fixture(scope='module')
def digits_setup():
  return fixtures.digits_logistic(4)


def test_elastic_fed_avg_learns_on_digits(digits_setup):
  data, build_keras, model_fn = digits_setup
  process = build_elastic_fed_avg(
      model_fn, tff.learning.optimizers.build_sgdm(0.1), tau=0.5, mu=0.95, sensitivity_fraction=0.1,
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)
  assert isinstance(process, tff.learning.templates.LearningProcess)
  # Only means and secure sums carry client data to the server (metrics included, with the secure aggregator).
  report = audit.audit_computation(process.next)
  assert report.ok, report.to_markdown()

  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  state = process.initialize()
  initial_accuracy = evaluate(process.get_model_weights(state))['accuracy']
  for round_num in range(3):
    output = process.next(state, fixtures.round_datasets(data.train, round_num))
    state = output.state
    aggregator = output.metrics['aggregator']
    assert 0.5 - 1e-6 <= aggregator['zeta_min'] <= aggregator['zeta_mean'] <= aggregator['zeta_max'] <= 1.5 + 1e-6
    assert aggregator['dropped_clients'] == 0
    assert output.metrics['client_work']['train']['num_examples'] > 0
  accuracy = evaluate(process.get_model_weights(state))['accuracy']
  assert accuracy > 0.6 > initial_accuracy + 0.3

  # set_model_weights / get_model_weights round-trip, as for TFF's own processes.
  zeros = tff.learning.models.ModelWeights(
      [np.zeros_like(w) for w in process.get_model_weights(state).trainable], [])
  reset = process.set_model_weights(state, zeros)
  for w in process.get_model_weights(reset).trainable:
    assert not np.any(w)
  assert process.get_hparams(state)['client_work']['learning_rate'] == pytest.approx(0.1)


def test_invalid_builder_arguments(digits_setup):
  _, _, model_fn = digits_setup
  sgd = tff.learning.optimizers.build_sgdm(0.1)
  with pytest.raises(ValueError, match='mu'):
    build_elastic_fed_avg(model_fn, sgd, mu=1.0)
  with pytest.raises(ValueError, match='sensitivity_fraction'):
    build_elastic_fed_avg(model_fn, sgd, sensitivity_fraction=1.0)
  with pytest.raises(ValueError, match='tau'):
    build_elastic_fed_avg(model_fn, sgd, tau=-1)
  with pytest.raises(ValueError, match='client_optimizer_fn'):
    build_elastic_fed_avg(model_fn, lambda: tf.keras.optimizers.SGD(0.1))
