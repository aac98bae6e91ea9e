"""The in-graph floor of a FedAvg round: the clients' arithmetic with nothing around it.

The same client work as a FedAvg round written as plain TF in one `tf.compat.v1.Session` graph in this process (no
dataset, variable or TFF runtime: what a round cannot go below here); `build_floor_in_worker` runs that graph in
TFF's worker. How it is built: docs/research/benchmark.md#sections-keys-and-method
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def _round(functional: tff.learning.models.FunctionalModel, client_arrays, start, *, batch_size: int,
           client_lr: float, momentum: float) -> list[tf.Tensor]:
  """The round's graph (module docstring) from the weight tensors `start`: the new model's weights."""
  finals, counts = [], []
  for x, y in client_arrays:
    x_all, y_all, size = tf.constant(x), tf.constant(y), len(y)
    num_batches = -(-size // batch_size)

    def step(i, weights, velocity, x_all=x_all, y_all=y_all, size=size):
      begin = i * batch_size
      end = tf.minimum(begin + batch_size, size)
      with tf.GradientTape() as tape:
        tape.watch(weights)
        predictions = functional.predict_on_batch((weights, ()), x_all[begin:end], training=True)
        loss = functional.loss(output=predictions, label=y_all[begin:end])
      gradients = tape.gradient(loss, weights)
      velocity = tuple(momentum * v + g for v, g in zip(velocity, gradients))
      return i + 1, tuple(w - client_lr * v for w, v in zip(weights, velocity)), velocity

    _, trained, _ = tf.while_loop(lambda i, *_: i < num_batches, step,
                                  (tf.constant(0), start, tuple(tf.zeros_like(w) for w in start)))
    finals.append(trained)
    counts.append(float(size))
  total = sum(counts)
  return [tf.add_n([c / total * f[k] for c, f in zip(counts, finals)]) for k in range(len(start))]


def _functional(build_keras, input_spec) -> tff.learning.models.FunctionalModel:
  return tff.learning.models.functional_model_from_keras(
      build_keras(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec)


def build_floor(build_keras: Callable[[], tf.keras.Model], input_spec,
                client_arrays: Sequence[tuple[np.ndarray, np.ndarray]], *, batch_size: int, client_lr: float,
                momentum: float, initial_weights: Sequence[np.ndarray]) -> Callable[[], list[np.ndarray]]:
  """One round of the floor (module docstring) on `client_arrays` [(x, y), ...] from `initial_weights`."""
  functional = _functional(build_keras, input_spec)
  graph = tf.Graph()
  with graph.as_default():
    mean = _round(functional, client_arrays, tuple(tf.constant(w) for w in initial_weights), batch_size=batch_size,
                  client_lr=client_lr, momentum=momentum)
  session = tf.compat.v1.Session(graph=graph)

  def round_fn() -> list[np.ndarray]:
    return session.run(mean)

  return round_fn


def build_floor_in_worker(build_keras: Callable[[], tf.keras.Model], input_spec,
                          client_arrays: Sequence[tuple[np.ndarray, np.ndarray]], *, batch_size: int,
                          client_lr: float, momentum: float, initial_weights: Sequence[np.ndarray]
                          ) -> Callable[[], list[np.ndarray]]:
  """The floor's very graph as one TFF computation (the weights in, the new weights out), run by TFF's worker:
  what the worker's way of running a TF graph costs by itself (TFF's session settings: no Grappler, optimizer level
  L0; its own thread pools), with no round, client, dataset or aggregation around it."""
  functional = _functional(build_keras, input_spec)
  weights_type = [tff.TensorType(np.asarray(w).dtype, np.shape(w)) for w in initial_weights]

  @tff.tensorflow.computation(weights_type)
  def floor_round(weights):
    return _round(functional, client_arrays, tuple(weights), batch_size=batch_size, client_lr=client_lr,
                  momentum=momentum)

  initial = [np.asarray(w) for w in initial_weights]
  return lambda: floor_round(initial)
