"""Keras models for the experiments, and their `tff.learning` wrappers.

Every builder returns a fresh, uncompiled `tf.keras.Model` that outputs logits: `logistic`, `cnn` (8x8 digits),
`lenet` (the studies' LeNet-5-shaped net, 'same' convolutions), `lenet5` (LeNet-5's shape), `emnist_cnn`,
`resnet18_gn` and `char_lstm`, each after the paper its docstring names. `model_fn` wraps one as the no-argument
callable `tff.learning.algorithms` expect (TFF must build the model inside its own graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

MODELS = ('cnn', 'logistic', 'lenet', 'lenet5', 'emnist_cnn', 'resnet18_gn', 'char_lstm')
RESNET_GROUPS = 2  # GroupNorm groups per layer, as Hsieh et al. (2020) and Reddi et al. (2021).


def digits_cnn(input_shape=(8, 8, 1), num_classes: int = 10) -> tf.keras.Model:
  """A small CNN (two 3x3 convolutions, about 12k parameters) sized for 8x8 digits."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Conv2D(16, 3, padding='same', activation='relu'),
      tf.keras.layers.MaxPool2D(2),
      tf.keras.layers.Conv2D(32, 3, padding='same', activation='relu'),
      tf.keras.layers.MaxPool2D(2),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(num_classes),
  ])


def logistic_regression(input_shape=(8, 8, 1), num_classes: int = 10) -> tf.keras.Model:
  """Multinomial logistic regression: one linear layer on the flattened input (the GMA convex study)."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(num_classes),
  ])


def lenet(input_shape=(28, 28, 1), num_classes: int = 10) -> tf.keras.Model:
  """LeNet-5's layers, conv(6, 5x5) - pool - conv(16, 5x5) - pool - dense 120 - dense 84 - logits, all 'same'.

  Every convolution and pool pads 'same', so the net takes 8x8 digits as well as 28x28 images. It is not LeNet-5's
  shape: on 28x28 inputs the second pool leaves a 7x7x16 map (784 inputs to the first dense layer, 107,786
  parameters), where LeNet-5 has 5x5x16 (400 inputs, 61,706 parameters; `lenet5`). The Fashion-MNIST and digits
  studies ran this net.
  """
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Conv2D(6, 5, padding='same', activation='relu'),
      tf.keras.layers.MaxPool2D(2, padding='same'),
      tf.keras.layers.Conv2D(16, 5, padding='same', activation='relu'),
      tf.keras.layers.MaxPool2D(2, padding='same'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(120, activation='relu'),
      tf.keras.layers.Dense(84, activation='relu'),
      tf.keras.layers.Dense(num_classes),
  ])


def lenet5(input_shape=(28, 28, 1), num_classes: int = 10) -> tf.keras.Model:
  """LeNet-5's shape: conv(6, 5x5, 'same') - pool - conv(16, 5x5, 'valid') - pool - 400 - dense 120 - 84 - logits.

  On 28x28 inputs the first convolution padded 'same' gives what LeCun et al.'s 'valid' one gives on their 32x32
  (MNIST padded by 2): a 5x5x16 map before the dense layers, 61,706 parameters. ReLU and max pooling, as the
  federated-learning literature's LeNet-5 (not the original's scaled tanh and trainable subsampling; the GMA
  paper's Table 1 model for MNIST, FMNIST, FEMNIST and FedCMNIST). Needs height and width >= 12 (`keras_builder`
  refuses smaller inputs, e.g. the 8x8 digits: use `lenet` there).
  """
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Conv2D(6, 5, padding='same', activation='relu'),
      tf.keras.layers.MaxPool2D(2),
      tf.keras.layers.Conv2D(16, 5, padding='valid', activation='relu'),
      tf.keras.layers.MaxPool2D(2),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(120, activation='relu'),
      tf.keras.layers.Dense(84, activation='relu'),
      tf.keras.layers.Dense(num_classes),
  ])


def emnist_cnn(input_shape=(28, 28, 1), num_classes: int = 10) -> tf.keras.Model:
  """Reddi et al.'s EMNIST CNN: conv(32, 3x3) - conv(64, 3x3) - pool - dropout .25 - dense 128 - dropout .5.

  'valid' convolutions as in the paper (1.2M parameters on 28x28; TFF baselines' `create_conv_dropout_model`);
  inputs need at least 6x6 pixels.
  """
  if min(input_shape[:2]) < 6:
    raise ValueError(f'input_shape must be at least 6x6 for emnist_cnn, got {tuple(input_shape)}')
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape),
      tf.keras.layers.Conv2D(32, 3, activation='relu'),
      tf.keras.layers.Conv2D(64, 3, activation='relu'),
      tf.keras.layers.MaxPool2D(2),
      tf.keras.layers.Dropout(0.25),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(128, activation='relu'),
      tf.keras.layers.Dropout(0.5),
      tf.keras.layers.Dense(num_classes),
  ])


def _conv_norm(x, filters: int, kernel_size: int, strides: int, groups: int):
  x = tf.keras.layers.Conv2D(filters, kernel_size, strides=strides, padding='same', use_bias=False)(x)
  return tf.keras.layers.GroupNormalization(groups=groups)(x)


def _basic_block(x, filters: int, strides: int, groups: int):
  """ResNet basic block: two 3x3 conv-norm layers and a (projected, where shapes change) shortcut."""
  shortcut = x
  if strides != 1 or x.shape[-1] != filters:
    shortcut = _conv_norm(x, filters, 1, strides, groups)
  y = tf.keras.layers.ReLU()(_conv_norm(x, filters, 3, strides, groups))
  y = _conv_norm(y, filters, 3, 1, groups)
  return tf.keras.layers.ReLU()(tf.keras.layers.Add()([shortcut, y]))


def resnet18_gn(input_shape=(32, 32, 3), num_classes: int = 10, groups: int = RESNET_GROUPS) -> tf.keras.Model:
  """ResNet-18 (He et al., 2016) with GroupNorm in place of BatchNorm, in its CIFAR form (about 11.2M params).

  CIFAR form: a 3x3 stride-1 stem without max-pooling (the ImageNet 7x7 stride-2 stem and pool would shrink
  32x32 images to 8x8 before the first block), then 4 stages of 2 basic blocks with 64, 128, 256, 512 filters,
  global average pooling and a linear layer. GroupNorm keeps no batch statistics, which suits federated
  training on non-iid clients (Hsieh et al., 2020). The CIFAR model of the GMA paper (Table 1, App. D.3) and of
  Reddi et al. (2021).
  """
  inputs = tf.keras.Input(shape=input_shape)
  x = tf.keras.layers.ReLU()(_conv_norm(inputs, 64, 3, 1, groups))
  for stage, filters in enumerate((64, 128, 256, 512)):
    for block in range(2):
      x = _basic_block(x, filters, strides=2 if stage > 0 and block == 0 else 1, groups=groups)
  x = tf.keras.layers.GlobalAveragePooling2D()(x)
  return tf.keras.Model(inputs, tf.keras.layers.Dense(num_classes)(x), name='resnet18_gn')


def char_lstm(
    input_shape=(80,), num_classes: int = 90, embedding_dim: int = 8, lstm_units: int = 256,
) -> tf.keras.Model:
  """Next-character model: embedding (8) - LSTM (256) - LSTM (256) - logits over the vocabulary, per position.

  The Shakespeare model of McMahan et al. (2017) and Reddi et al. (2021).

  `input_shape` is (sequence_length,) of int character ids and `num_classes` the vocabulary size (inputs and
  targets share it). No Keras masking: `tff.learning` ignores Keras masks, so padding is excluded from loss and
  accuracy by `model_fn(..., pad_id=...)` instead; padding only trails a sequence, so it cannot affect the
  (causal) outputs at real positions.
  """
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=input_shape, dtype=tf.int32),
      tf.keras.layers.Embedding(num_classes, embedding_dim),
      tf.keras.layers.LSTM(lstm_units, return_sequences=True),
      tf.keras.layers.LSTM(lstm_units, return_sequences=True),
      tf.keras.layers.Dense(num_classes),
  ])


_BUILDERS = {
    'cnn': digits_cnn,
    'logistic': logistic_regression,
    'lenet': lenet,
    'lenet5': lenet5,
    'emnist_cnn': emnist_cnn,
    'resnet18_gn': resnet18_gn,
    'char_lstm': char_lstm,
}
_SEQUENCE_MODELS = ('char_lstm',)
_LENET5_MIN_SIDE = 12  # 12 -> pool 6 -> valid 5x5 conv 2 -> pool 1: the smallest side that leaves a feature map.


def keras_builder(name: str, input_shape: Sequence[int], num_classes: int) -> Callable[[], tf.keras.Model]:
  """A no-argument builder of model `name` (one of `MODELS`) for examples of `input_shape`."""
  if name not in _BUILDERS:
    raise ValueError(f'unknown model {name!r}; expected one of {sorted(_BUILDERS)}')
  input_shape = tuple(int(d) for d in input_shape)
  rank = 1 if name in _SEQUENCE_MODELS else 3
  if len(input_shape) != rank or min(input_shape) < 1:
    kind = '(sequence_length,)' if rank == 1 else '(height, width, channels)'
    raise ValueError(f'input_shape for model {name!r} must be {kind}, got {input_shape}')
  if name == 'lenet5' and min(input_shape[:2]) < _LENET5_MIN_SIDE:
    raise ValueError(f'input_shape for model lenet5 must be at least {_LENET5_MIN_SIDE}x{_LENET5_MIN_SIDE} (its '
                     f'valid 5x5 convolution runs on the pooled map), got {input_shape}; model lenet takes any size')
  if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
    raise ValueError(f'num_classes must be an integer >= 2, got {num_classes!r}')
  num_classes = int(num_classes)
  return lambda: _BUILDERS[name](input_shape, num_classes)


class MaskedSparseCategoricalCrossentropy(tf.keras.losses.Loss):
  """Mean softmax cross-entropy over the positions whose target is not `pad_id` (logits input)."""

  def __init__(self, pad_id: int, name: str = 'masked_sparse_categorical_crossentropy'):
    # SUM of the scalar `call` returns leaves it as is: the mean over real tokens of the whole batch.
    super().__init__(reduction=tf.keras.losses.Reduction.SUM, name=name)
    self.pad_id = pad_id

  def call(self, y_true, y_pred):
    per_token = tf.keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    mask = tf.cast(tf.not_equal(y_true, tf.cast(self.pad_id, y_true.dtype)), per_token.dtype)
    return tf.math.divide_no_nan(tf.reduce_sum(per_token * mask), tf.reduce_sum(mask))

  def get_config(self):
    return {**super().get_config(), 'pad_id': self.pad_id}


class MaskedSparseCategoricalAccuracy(tf.keras.metrics.SparseCategoricalAccuracy):
  """Accuracy over the positions whose target is not `pad_id`."""

  def __init__(self, pad_id: int, name: str = 'accuracy', dtype=None):
    super().__init__(name=name, dtype=dtype)
    self.pad_id = pad_id

  def update_state(self, y_true, y_pred, sample_weight=None):
    mask = tf.cast(tf.not_equal(y_true, tf.cast(self.pad_id, y_true.dtype)), self.dtype)
    if sample_weight is not None:
      mask *= tf.cast(sample_weight, self.dtype)
    return super().update_state(y_true, y_pred, sample_weight=mask)

  def get_config(self):
    return {**super().get_config(), 'pad_id': self.pad_id}


def model_fn(
    build_keras: Callable[[], tf.keras.Model], input_spec, pad_id: Optional[int] = None,
) -> Callable[[], tff.learning.models.VariableModel]:
  """Wraps a Keras builder for `tff.learning`: sparse softmax cross-entropy on logits, accuracy metric.

  With `pad_id` (sequence data, e.g. `FederatedDataset.pad_id`), positions whose target is `pad_id` count in
  neither loss nor accuracy. Targets may have any shape the logits have without their last axis ([batch] or
  [batch, sequence_length]).

  The returned callable carries `functional_model`, a no-argument builder of the same model as a
  `tff.learning.models.FunctionalModel` (same loss), which the in-graph client loop
  (`tff_gma.learning.in_graph`) trains.
  """

  def fn():
    accuracy = (tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy') if pad_id is None
                else MaskedSparseCategoricalAccuracy(pad_id, name='accuracy'))
    return tff.learning.models.from_keras_model(
        build_keras(), loss=_loss(pad_id), input_spec=input_spec, metrics=[accuracy])

  fn.functional_model = lambda: tff.learning.models.functional_model_from_keras(
      build_keras, _loss(pad_id), input_spec)
  return fn


def _loss(pad_id: Optional[int]) -> tf.keras.losses.Loss:
  if pad_id is None:
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  return MaskedSparseCategoricalCrossentropy(pad_id)
