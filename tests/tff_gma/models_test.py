"""The Keras models and their `tff.learning` wrappers (`tff_gma.models`)."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models


def _conv(k, c_in, c_out, bias=True):
  return k * k * c_in * c_out + (c_out if bias else 0)


def _dense(n_in, n_out):
  return n_in * n_out + n_out


def _lenet_params(h, w, c, classes):
  pooled = -(-(-(-h // 2)) // 2) * -(-(-(-w // 2)) // 2)  # Two 'same' 2x2 pools: ceil(ceil(h/2)/2).
  return (_conv(5, c, 6) + _conv(5, 6, 16) + _dense(pooled * 16, 120) + _dense(120, 84) + _dense(84, classes))


def _resnet18_params(c, classes):
  gn = lambda ch: 2 * ch  # GroupNorm: a scale and an offset per channel.
  total = _conv(3, c, 64, bias=False) + gn(64)
  c_in = 64
  for filters in (64, 128, 256, 512):
    for block in range(2):
      total += _conv(3, c_in, filters, False) + gn(filters) + _conv(3, filters, filters, False) + gn(filters)
      if c_in != filters:
        total += _conv(1, c_in, filters, False) + gn(filters)
      c_in = filters
  return total + _dense(512, classes)


def _lstm(n_in, units):
  return 4 * (units * (n_in + units) + units)


@pytest.mark.parametrize('name,shape,classes,expected_params', [
    ('logistic', (8, 8, 1), 10, _dense(64, 10)),
    ('cnn', (8, 8, 1), 10, _conv(3, 1, 16) + _conv(3, 16, 32) + _dense(2 * 2 * 32, 10)),
    ('lenet', (28, 28, 1), 10, _lenet_params(28, 28, 1, 10)),
    ('lenet', (8, 8, 3), 10, _lenet_params(8, 8, 3, 10)),
    ('lenet', (5, 7, 1), 4, _lenet_params(5, 7, 1, 4)),
    # LeNet-5 (LeCun et al. 1998's layer sizes with a 10-way ReLU head): 5x5x16 = 400 inputs to the first dense layer.
    ('lenet5', (28, 28, 1), 10, 61_706),
    ('lenet5', (32, 32, 3), 10, _conv(5, 3, 6) + _conv(5, 6, 16) + _dense(6 * 6 * 16, 120) + _dense(120, 84)
     + _dense(84, 10)),
    ('lenet5', (12, 12, 1), 10, _conv(5, 1, 6) + _conv(5, 6, 16) + _dense(16, 120) + _dense(120, 84) + _dense(84, 10)),
    # Reddi et al.'s EMNIST CNN; TFF's baseline documents 1,199,882 parameters for 10 classes.
    ('emnist_cnn', (28, 28, 1), 10, 1_199_882),
    ('emnist_cnn', (28, 28, 1), 62, _conv(3, 1, 32) + _conv(3, 32, 64) + _dense(12 * 12 * 64, 128) + _dense(128, 62)),
    ('emnist_cnn', (8, 8, 3), 10, _conv(3, 3, 32) + _conv(3, 32, 64) + _dense(2 * 2 * 64, 128) + _dense(128, 10)),
    ('char_lstm', (80,), 90, 90 * 8 + _lstm(8, 256) + _lstm(256, 256) + _dense(256, 90)),
])
def test_models_build_with_the_expected_shapes_and_sizes(name, shape, classes, expected_params):
  model = models.keras_builder(name, shape, classes)()
  assert model.count_params() == expected_params
  batch = np.zeros([2, *shape], np.int32 if name == 'char_lstm' else np.float32)
  out = model(batch)
  assert out.shape == ((2, shape[0], classes) if name == 'char_lstm' else (2, classes))


def _image_spec(shape):
  return collections.OrderedDict(x=tf.TensorSpec([None, *shape], tf.float32), y=tf.TensorSpec([None], tf.int32))


def _numpy_cross_entropy(logits, labels):
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  return -np.take_along_axis(log_probs, labels[..., np.newaxis], axis=-1)[..., 0]


@pytest.mark.parametrize('name,shape', [
    ('logistic', (8, 8, 1)), ('cnn', (8, 8, 3)), ('lenet', (8, 8, 1)), ('emnist_cnn', (28, 28, 1)),
])
def test_model_fn_wraps_image_models(name, shape):
  model = models.model_fn(models.keras_builder(name, shape, 10), _image_spec(shape))()
  assert isinstance(model, tff.learning.models.VariableModel)
  rng = np.random.default_rng(0)
  batch = collections.OrderedDict(x=rng.random([5, *shape]).astype(np.float32), y=np.arange(5, dtype=np.int32))
  out = model.forward_pass(batch, training=False)
  logits = out.predictions.numpy()
  assert logits.shape == (5, 10) and int(out.num_examples) == 5
  np.testing.assert_allclose(out.loss.numpy(), _numpy_cross_entropy(logits, batch['y']).mean(), rtol=1e-5)
  accuracy = model.report_local_unfinalized_metrics()['accuracy']
  np.testing.assert_allclose(accuracy, [np.sum(logits.argmax(-1) == batch['y']), 5])


def test_resnet18_is_the_11m_parameter_resnet_with_group_norm_and_wraps():
  keras_model = models.keras_builder('resnet18_gn', (32, 32, 3), 10)()  # Built once: ResNets build slowly.
  assert keras_model.count_params() == _resnet18_params(3, 10)
  assert 11.0e6 < keras_model.count_params() < 11.3e6  # ResNet-18 for CIFAR: 11.17M.
  norms = [layer for layer in keras_model.layers if isinstance(layer, tf.keras.layers.GroupNormalization)]
  assert len(norms) == 1 + 8 * 2 + 3 and all(layer.groups == 2 for layer in norms)
  assert not any(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in keras_model.layers)
  assert len([layer for layer in keras_model.layers if isinstance(layer, tf.keras.layers.Conv2D)]) == 1 + 16 + 3
  model = models.model_fn(lambda: keras_model, _image_spec((32, 32, 3)))()
  batch = collections.OrderedDict(
      x=np.random.default_rng(0).random([2, 32, 32, 3]).astype(np.float32), y=np.array([3, 7], np.int32))
  out = model.forward_pass(batch, training=False)
  assert out.predictions.shape == (2, 10)
  np.testing.assert_allclose(
      out.loss.numpy(), _numpy_cross_entropy(out.predictions.numpy(), batch['y']).mean(), rtol=1e-5)


def _small_char_lstm():
  return models.char_lstm((6,), 12, embedding_dim=4, lstm_units=8)  # Small: the sequence plumbing is tested.


def _sequence_batch(seq_len=6, vocab=12):
  rng = np.random.default_rng(1)
  y = rng.integers(1, vocab, size=[3, seq_len]).astype(np.int32)
  y[0, 4:] = 0  # Trailing padding, as the Shakespeare preprocessing makes it.
  y[2, 1:] = 0
  x = np.roll(y, 1, axis=1)
  x[:, 0] = vocab - 1
  return collections.OrderedDict(x=x, y=y)


def _sequence_spec(seq_len=6):
  return collections.OrderedDict(
      x=tf.TensorSpec([None, seq_len], tf.int32), y=tf.TensorSpec([None, seq_len], tf.int32))


def test_model_fn_masks_padding_of_sequences():
  batch = _sequence_batch()
  model = models.model_fn(_small_char_lstm, _sequence_spec(), pad_id=0)()
  out = model.forward_pass(batch, training=False)
  logits = out.predictions.numpy()
  assert logits.shape == (3, 6, 12)
  real = batch['y'] != 0
  per_token = _numpy_cross_entropy(logits, batch['y'])
  np.testing.assert_allclose(out.loss.numpy(), per_token[real].mean(), rtol=1e-5)
  correct = (logits.argmax(-1) == batch['y']) & real
  np.testing.assert_allclose(model.report_local_unfinalized_metrics()['accuracy'], [correct.sum(), real.sum()])
  # Without pad_id every position counts.
  plain = models.model_fn(_small_char_lstm, _sequence_spec())()
  plain_out = plain.forward_pass(batch, training=False)
  np.testing.assert_allclose(
      plain_out.loss.numpy(), _numpy_cross_entropy(plain_out.predictions.numpy(), batch['y']).mean(), rtol=1e-5)


def test_masked_metric_survives_keras_config_round_trip():
  metric = models.MaskedSparseCategoricalAccuracy(pad_id=3, name='accuracy')
  clone = models.MaskedSparseCategoricalAccuracy.from_config(metric.get_config())
  assert clone.pad_id == 3 and clone.name == 'accuracy'
  clone.update_state(np.array([[3, 1, 2]]), np.eye(4)[[[0, 1, 0]]])
  np.testing.assert_allclose(clone.result().numpy(), 0.5)


def test_sequence_model_trains_in_a_tff_learning_process():
  spec = _sequence_spec()
  process = tff.learning.algorithms.build_weighted_fed_avg(
      models.model_fn(_small_char_lstm, spec, pad_id=0),
      client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.5))
  batch = _sequence_batch()
  client_data = [tf.data.Dataset.from_tensor_slices(batch).batch(2) for _ in range(2)]
  state = process.initialize()
  output = process.next(state, client_data)
  train = output.metrics['client_work']['train']
  assert train['num_examples'] == 6
  assert np.isfinite(train['loss']) and 0.0 <= train['accuracy'] <= 1.0
  before = tf.nest.flatten(process.get_model_weights(state).trainable)
  after = tf.nest.flatten(process.get_model_weights(output.state).trainable)
  assert any(not np.allclose(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize('args,argument', [
    (('vgg', (8, 8, 1), 10), 'model'),
    (('lenet', (64,), 10), 'input_shape'),
    (('char_lstm', (8, 8, 1), 10), 'input_shape'),
    (('cnn', (8, 0, 1), 10), 'input_shape'),
    (('cnn', (8, 8, 1), 1), 'num_classes'),
    (('emnist_cnn', (5, 5, 1), 10), 'input_shape'),
    (('lenet5', (8, 8, 1), 10), 'lenet5 must be at least 12x12'),  # The digits: `lenet` takes them.
    (('lenet5', (28, 11, 1), 10), 'lenet5 must be at least 12x12'),
])
def test_keras_builder_rejects_invalid_arguments(args, argument):
  with pytest.raises(ValueError, match=argument):
    models.keras_builder(*args)()
