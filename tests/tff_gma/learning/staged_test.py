"""`StagedLearningProcess`: a round in stages returns what `compose_learning_process`'s `next` returns.

FedAvg with RFA composed from TFF's parts, and personalized RFA with its kept values, each over two rounds on the
digits, against the one-computation process built from the same parts; bit for bit on one worker.
"""

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma import runtime
from tests.tff_gma import fixtures


def _assert_same(a, b):
  a, b = tf.nest.flatten(a), tf.nest.flatten(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _fed_avg_parts(model_fn, factory):
  initial_weights_fn = tff.tensorflow.computation(lambda: tff.learning.models.ModelWeights.from_model(model_fn()))
  weights_type = initial_weights_fn.type_signature.result
  client_work = tff.learning.templates.build_model_delta_client_work(
      model_fn, tff.learning.optimizers.build_sgdm(0.1), tff.learning.ClientWeighting.NUM_EXAMPLES)
  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(
      tff.learning.optimizers.build_sgdm(1.0), weights_type)
  one = tff.learning.templates.compose_learning_process(
      initial_weights_fn, distributor, client_work, factory.create(weights_type.trainable, tff.TensorType(np.float32)),
      finalizer)
  in_stages = learning.compose_staged_learning_process(
      initial_weights_fn, distributor, client_work,
      aggregators.create_staged(factory, weights_type.trainable, tff.TensorType(np.float32)), finalizer)
  return one, in_stages


def test_fed_avg_with_rfa_in_stages_is_the_composed_round():
  data, _, model_fn = fixtures.digits_logistic(num_clients=4)
  one, in_stages = _fed_avg_parts(model_fn, aggregators.GeometricMedianFactory(num_passes=2, init='mean'))
  assert in_stages.initialize.type_signature == one.initialize.type_signature
  assert in_stages.get_model_weights.type_signature == one.get_model_weights.type_signature
  assert len(in_stages.aggregation.stages) == 2
  for _, comp in in_stages.computations():
    assert runtime.check_single_aggregation_stage(comp) <= 1
  state_one = state_two = one.initialize()  # Each `initialize` draws its own Keras initialization: one for both.
  for round_num in range(2):
    datasets = fixtures.round_datasets(data.train, round_num)
    output_one, output_two = one.next(state_one, datasets), in_stages.next(state_two, datasets)
    _assert_same(output_one.state, output_two.state)
    _assert_same(output_one.metrics, output_two.metrics)
    state_one, state_two = output_one.state, output_two.state
  trained = in_stages.get_model_weights(state_two).trainable
  assert any(not np.allclose(w, 0) for w in trained)
  _assert_same(in_stages.set_model_weights(state_two, in_stages.get_model_weights(state_one)), state_one)


def test_personalized_rfa_in_stages_keeps_the_same_client_values():
  data, _, model_fn = fixtures.digits_logistic(num_clients=3)
  optimizer = tff.learning.optimizers.build_sgdm(0.05)
  one = learning.build_personalized_rfa(model_fn, optimizer)
  in_stages = learning.build_personalized_rfa(model_fn, optimizer, staged=True)
  assert isinstance(in_stages, learning.StagedLearningProcess)
  assert in_stages.client_state_type == one.client_state_type
  assert in_stages.client_state_key == one.client_state_key == 'personal'
  batches = fixtures.round_datasets(data.train, 0)
  empty = tf.data.Dataset.from_tensors(tuple(tf.zeros(t.shape, t.dtype) for t in one.client_state_type)).take(0)
  client_data = [{'batches': b, 'personal': empty} for b in batches]
  state = one.initialize()  # Each process's `initialize` draws its own Keras initialization: one for both.
  assert in_stages.initialize.type_signature == one.initialize.type_signature
  output_one = one.next_with_client_state(state, client_data)
  output_two = in_stages.next_with_client_state(state, client_data)
  _assert_same(output_one.state, output_two.state)
  _assert_same(output_one.metrics, output_two.metrics)
  _assert_same(output_one.client_state, output_two.client_state)
  assert any(not np.allclose(v, 0) for v in tf.nest.flatten(output_two.client_state))
