"""Keras models for the experiments, and their `tff.learning` wrappers.

Every builder returns a fresh, uncompiled `tf.keras.Model`; `model_fn` wraps one as the no-argument callable
that `tff.learning.algorithms` expect (TFF must build the model inside its own graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
import tensorflow_federated as tff

MODELS = ('cnn', 'logistic')


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


_BUILDERS = {'cnn': digits_cnn, 'logistic': logistic_regression}


def keras_builder(name: str, input_shape, num_classes: int) -> Callable[[], tf.keras.Model]:
  if name not in _BUILDERS:
    raise ValueError(f'unknown model {name!r}; expected one of {sorted(_BUILDERS)}')
  return lambda: _BUILDERS[name](input_shape, num_classes)


def model_fn(
    build_keras: Callable[[], tf.keras.Model], input_spec,
) -> Callable[[], tff.learning.models.VariableModel]:
  """Wraps a Keras builder for `tff.learning`: sparse softmax cross-entropy on logits, accuracy metric."""

  def fn():
    return tff.learning.models.from_keras_model(
        build_keras(),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=input_spec,
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name='accuracy')],
    )

  return fn
