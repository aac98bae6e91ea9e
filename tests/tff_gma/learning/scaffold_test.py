"""SCAFFOLD: the client's corrected steps and control variates against a direct reference, and rounds on digits."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import GeometricMedianFactory
from tff_gma.aggregators import GradientMaskedFactory
from tff_gma.learning import build_scaffold
from tff_gma.learning import scaffold
from tests.tff_gma import fixtures

F32 = np.float32
INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))


def tiny_keras():
  return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(3,)), tf.keras.layers.Dense(2)])


def tiny_model_fn():
  return tff.learning.models.from_keras_model(
      tiny_keras(), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec=INPUT_SPEC)


def test_client_update_matches_reference():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(11, 3)).astype(F32)
  y = rng.integers(0, 2, size=11).astype(np.int32)
  batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(4)  # K = 3 steps.
  initial = tiny_model_fn()
  shapes = [v.shape for v in initial.trainable_variables]
  server_c = tuple(rng.normal(scale=0.1, size=s).astype(F32) for s in shapes)
  client_c = tuple(rng.normal(scale=0.1, size=s).astype(F32) for s in shapes)
  lr = 0.2
  update_fn = scaffold.build_scaffold_client_update(tiny_model_fn, lr, tff.learning.ClientWeighting.NUM_EXAMPLES)
  result, control_delta, new_control, _, participated = update_fn(
      tff.learning.models.ModelWeights.from_model(initial), batches,
      tf.data.Dataset.from_tensors(client_c), server_c)

  keras_model = tiny_keras()
  keras_model.set_weights([v.numpy() for v in initial.trainable_variables])
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for start in range(0, 11, 4):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[start:start + 4], keras_model(x[start:start + 4], training=True))
    grads = tape.gradient(loss, keras_model.trainable_variables)
    for v, g, c, ci in zip(keras_model.trainable_variables, grads, server_c, client_c):
      v.assign_sub(lr * (g.numpy() - ci + c))
  expected_update = [a.numpy() - b.numpy() for a, b in zip(initial.trainable_variables,
                                                           keras_model.trainable_variables)]
  expected_new_control = [ci - c + u / (3 * lr) for ci, c, u in zip(client_c, server_c, expected_update)]

  for got, want in zip(result.update, expected_update):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
  for got, want in zip(new_control, expected_new_control):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
  for got, new, old in zip(control_delta, expected_new_control, client_c):
    np.testing.assert_allclose(got.numpy(), new - old, rtol=1e-4, atol=1e-5)
  assert float(result.update_weight) == 11
  assert int(participated) == 1


def test_empty_control_dataset_means_zero_and_empty_client_keeps_its_control():
  initial = tiny_model_fn()
  weights = tff.learning.models.ModelWeights.from_model(initial)
  shapes = [v.shape for v in initial.trainable_variables]
  server_c = tuple(np.full(s, 0.3, F32) for s in shapes)
  client_c = tuple(np.full(s, -0.2, F32) for s in shapes)
  update_fn = scaffold.build_scaffold_client_update(tiny_model_fn, 0.1, tff.learning.ClientWeighting.UNIFORM)
  no_batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.zeros((0, 3), F32), y=np.zeros((0,), np.int32))).batch(4)
  result, delta, new_control, _, _ = update_fn(weights, no_batches, tf.data.Dataset.from_tensors(client_c), server_c)
  assert float(result.update_weight) == 0
  for d, c, old in zip(delta, new_control, client_c):
    assert not np.any(d.numpy())
    np.testing.assert_array_equal(c.numpy(), old)
  # An empty control dataset is c_i = 0.
  one_batch = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.ones((2, 3), F32), y=np.zeros((2,), np.int32))).batch(4)
  empty = tf.data.Dataset.from_tensors(client_c).take(0)
  result, delta, new_control, _, _ = update_fn(weights, one_batch, empty, server_c)
  assert float(result.update_weight) == 1  # UNIFORM weighting.
  for d, c in zip(delta, new_control):
    np.testing.assert_allclose(c.numpy(), d.numpy())


def test_server_control_update():
  c = (tf.constant([1.0, 2.0]),)
  mean_delta = (tf.constant([0.5, -1.0]),)
  np.testing.assert_allclose(scaffold.server_control_update(c, mean_delta, tf.constant(2), None)[0], [1.5, 1.0])
  np.testing.assert_allclose(scaffold.server_control_update(c, mean_delta, tf.constant(2), 8)[0], [1.125, 1.75])


@pytest.fixture(scope='module')
def digits_setup():
  return fixtures.digits_logistic(4)


def test_scaffold_learns_and_keeps_client_controls(digits_setup):
  data, build_keras, model_fn = digits_setup
  process = build_scaffold(model_fn, client_lr=0.1, server_lr=1.0)
  assert isinstance(process, tff.learning.templates.LearningProcess)
  store = fixtures.ClientStateHolder(process)  # Checks each returned c_i+ against `process.client_state_type`.
  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  client_ids = list(data.train.client_ids)
  state = process.initialize()
  for round_num in range(3):
    state, metrics = store.run_round(process, state, client_ids, fixtures.round_datasets(data.train, round_num))
    assert metrics['client_work']['participating_clients'] == 4
    assert metrics['client_work']['server_control_norm'] > 0
  assert evaluate(process.get_model_weights(state))['accuracy'] > 0.6
  # Full participation from c = c_i = 0: the server control is the mean of the clients' controls.
  server_c = state.client_work['control_variate']
  for j, c in enumerate(server_c):
    np.testing.assert_allclose(c, np.mean([store.get(cid)[j] for cid in client_ids], axis=0), atol=1e-6)
  assert len(store) == 4 and all(np.any(store.get(cid)[0]) for cid in client_ids)

  # The plain LearningProcess `next` runs the same round (the clients' new controls are not returned).
  datasets = [store.client_data(cid, ds) for cid, ds in zip(client_ids, fixtures.round_datasets(data.train, 3))]
  plain = process.next(state, datasets)
  with_controls = process.next_with_client_state(state, datasets)
  assert len(with_controls.client_state) == 4
  weights = tff.learning.models.ModelWeights(
      [np.zeros_like(w) for w in process.get_model_weights(plain.state).trainable], [])
  assert not np.any(process.get_model_weights(process.set_model_weights(plain.state, weights)).trainable[0])


@pytest.mark.parametrize('aggregator', ['gma', 'geometric_median'])
def test_scaffold_with_project_aggregators(digits_setup, aggregator):
  data, build_keras, model_fn = digits_setup
  factory = GradientMaskedFactory(tau=0.4) if aggregator == 'gma' else GeometricMedianFactory(num_passes=3)
  process = build_scaffold(model_fn, client_lr=0.1, server_lr=1.0, model_aggregator=factory, num_clients=4)
  store = fixtures.ClientStateHolder(process)
  state = process.initialize()
  client_ids = list(data.train.client_ids)
  for round_num in range(2):
    state, metrics = store.run_round(process, state, client_ids, fixtures.round_datasets(data.train, round_num))
    if aggregator == 'gma':
      assert 0 <= metrics['aggregator']['masked_fraction'] <= 1
      assert metrics['aggregator']['participating_clients'] == 4
  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  assert evaluate(process.get_model_weights(state))['accuracy'] > 0.4


def test_invalid_arguments(digits_setup):
  _, _, model_fn = digits_setup
  with pytest.raises(ValueError, match='client_lr'):
    build_scaffold(model_fn, client_lr=0.0)
  with pytest.raises(ValueError, match='server_lr'):
    build_scaffold(model_fn, client_lr=0.1, server_lr=-1.0)
  with pytest.raises(ValueError, match='num_clients'):
    build_scaffold(model_fn, client_lr=0.1, num_clients=0)
  with pytest.raises(ValueError, match='model_aggregator'):
    build_scaffold(model_fn, client_lr=0.1, model_aggregator='mean')
