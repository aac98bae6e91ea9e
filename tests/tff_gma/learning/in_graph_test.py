"""tff_gma.learning.in_graph: the in-graph client loop against TFF's own model-delta client works (FedProx's: the
library's iterator client work, `tff_gma.learning.fed_prox`, TFF's having the opposite sign)."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests.tff_gma import fixtures
from tff_gma import models
from tff_gma.data import loaders
from tff_gma.learning import fed_prox
from tff_gma.learning import in_graph

_ITERATOR = tff.learning.LoopImplementation.DATASET_ITERATOR


def _setup(model_name: str):
  data = loaders.load_federated_data('digits', 'label_skew', 4, 0)
  build = models.keras_builder(model_name, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build, data.input_spec)
  functional = tff.learning.models.functional_model_from_keras(
      build, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), data.input_spec)
  return data, build, model_fn, functional


def test_read_batches_keeps_every_batch_and_its_boundaries():
  x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
  y = np.arange(10, dtype=np.int32)
  # Batched per epoch, then repeated: the last batch of each epoch is short (4, 4, 2, 4, 4, 2).
  dataset = tf.data.Dataset.from_tensor_slices({'x': x, 'y': y}).batch(4).repeat(2)

  @tff.tensorflow.computation(tff.SequenceType(tff.types.tensorflow_to_type(dataset.element_spec)))
  def read(data):
    return in_graph.read_batches(data)

  examples, offsets = read(dataset)
  np.testing.assert_array_equal(offsets, [0, 4, 8, 10, 14, 18, 20])
  np.testing.assert_array_equal(examples['x'], np.concatenate([x, x]))
  np.testing.assert_array_equal(examples['y'], np.concatenate([y, y]))
  empty_examples, empty_offsets = read(dataset.take(0))
  np.testing.assert_array_equal(empty_offsets, [0])
  assert empty_examples['x'].shape == (0, 3)


@pytest.mark.parametrize('model_name', ['logistic', 'cnn'])
@pytest.mark.parametrize('proximal_strength', [0.0, 0.1])
def test_equals_tff_client_work(model_name, proximal_strength):
  data, build, model_fn, functional = _setup(model_name)
  optimizer = tff.learning.optimizers.build_sgdm(0.05, momentum=0.9)
  weighting = tff.learning.ClientWeighting.NUM_EXAMPLES
  if proximal_strength:  # The library's FedProx client work (TFF's has the opposite sign: fed_prox_test).
    reference = fed_prox.build_fed_prox_client_work(
        model_fn, optimizer, weighting, proximal_strength=proximal_strength, loop_implementation=_ITERATOR)
  else:
    reference = tff.learning.templates.build_model_delta_client_work(
        model_fn, optimizer, weighting, loop_implementation=_ITERATOR)
  client_work = in_graph.build_in_graph_client_work(model_fn, functional, optimizer,
                                                    proximal_strength=proximal_strength)
  assert client_work.initialize.type_signature == reference.initialize.type_signature
  assert client_work.next.type_signature == reference.next.type_signature
  datasets = fixtures.round_datasets(data.train, 1, batch_size=16, local_epochs=2)
  keras = build()
  weights = tff.learning.models.ModelWeights(trainable=[v.numpy() for v in keras.trainable_weights],
                                             non_trainable=[])
  clients = len(datasets)
  expected = reference.next(reference.initialize(), [weights] * clients, datasets)
  actual = client_work.next(client_work.initialize(), [weights] * clients, datasets)
  for want, got in zip(expected.result, actual.result):
    assert float(got.update_weight) == float(want.update_weight)
    for a, b in zip(tf.nest.flatten(want.update), tf.nest.flatten(got.update)):
      np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)  # float32 rounding of one client's update
  assert actual.measurements['train']['num_examples'] == expected.measurements['train']['num_examples']
  assert actual.measurements['train']['num_batches'] == expected.measurements['train']['num_batches']
  np.testing.assert_allclose(actual.measurements['train']['loss'], expected.measurements['train']['loss'], rtol=1e-6)
  np.testing.assert_allclose(actual.measurements['train']['accuracy'], expected.measurements['train']['accuracy'],
                             rtol=1e-6)


def test_non_finite_update_is_zeroed_with_weight_zero():
  data, build, model_fn, functional = _setup('logistic')
  client_work = in_graph.build_in_graph_client_work(model_fn, functional, tff.learning.optimizers.build_sgdm(0.1))
  keras = build()
  trainable = [v.numpy() for v in keras.trainable_weights]
  trainable[0][0, 0] = np.nan  # A NaN weight makes the whole update non-finite.
  weights = tff.learning.models.ModelWeights(trainable=trainable, non_trainable=[])
  datasets = fixtures.round_datasets(data.train, 1, batch_size=16)[:1]
  output = client_work.next(client_work.initialize(), [weights], datasets)
  (result,) = output.result
  assert float(result.update_weight) == 0.0
  assert all(np.all(np.asarray(u) == 0) for u in tf.nest.flatten(result.update))
  assert output.measurements['train']['num_examples'] == 0  # Metrics reset, as TFF's client work does.


def test_support_names_what_it_cannot_carry():
  data, _, model_fn, functional = _setup('logistic')
  assert in_graph.in_graph_support(model_fn, functional) is None
  assert 'no functional model' in in_graph.in_graph_support(model_fn, None)

  def batch_norm_keras():
    return tf.keras.Sequential([tf.keras.layers.InputLayer(data.input_shape), tf.keras.layers.Flatten(),
                                tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(data.num_classes)])

  reason = in_graph.in_graph_support(models.model_fn(batch_norm_keras, data.input_spec), functional)
  assert 'non-trainable' in reason
  with pytest.raises(ValueError, match='in-graph client loop cannot train this model: it has non-trainable'):
    in_graph.build_in_graph_client_work(models.model_fn(batch_norm_keras, data.input_spec), functional,
                                        tff.learning.optimizers.build_sgdm(0.1))
