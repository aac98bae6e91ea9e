"""Helpers of the library's tests, written against `tff_gma` and TFF only (never the `training` harness).

* `digits_logistic`: the digits data split over clients, with its logistic Keras builder and `model_fn`.
* `client_dataset`, `round_datasets`: a client's round dataset as the harness makes it (seeded shuffle per seed,
  round and client, local epochs, batches), so that thresholds tuned on the harness's data still hold.
* `central_evaluator`: accuracy and loss of a `ModelWeights` on held-out arrays, through a fresh Keras model.
* `seeded_initial_state`: `process.initialize()` with seeded Keras initial weights.
* `fed_avg_family`: FedAvg / FedProx / FedAdam / FedYogi from TFF's own builders, with the harness's defaults.
* `ClientStateHolder`: the values the clients of a `LearningProcessWithClientState` keep, by client id, in memory.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.data import loaders
from tff_gma.learning import client_lib

# The harness's FedAvg-family defaults (GMA paper, Sec. 5 and App. C): client SGD with momentum 0.9, FedProx's mu,
# FedAdam/FedYogi's betas and adaptivity epsilon (Reddi et al.).
CLIENT_LR = 0.05
CLIENT_MOMENTUM = 0.9
PROXIMAL_STRENGTH = 0.01
ADAPTIVE_BETA_1, ADAPTIVE_BETA_2, ADAPTIVE_EPSILON = 0.9, 0.99, 1e-3
ALGORITHMS = ('fedavg', 'fedprox', 'fedadam', 'fedyogi')


def digits_logistic(num_clients: int = 4, partition: str = 'iid', seed: int = 0):
  """(federated digits data, its logistic Keras builder, its `model_fn`)."""
  data = loaders.load_federated_data('digits', partition, num_clients, seed)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  return data, build_keras, models.model_fn(build_keras, data.input_spec)


# ------------------------------------------------------------------------------------------------ client datasets


def _round_seed(seed: int, round_num: int, index: int = 0) -> int:
  return int(np.random.SeedSequence([seed, round_num, index]).generate_state(1)[0] & 0x7FFFFFFF)


def client_dataset(client_data: tff.simulation.datasets.ClientData, client_id: str, *, local_epochs: int,
                   batch_size: int, seed: int, round_num: int) -> tf.data.Dataset:
  """The client's data for one round: shuffled (seeded by seed, round and client), repeated, batched."""
  ds = client_data.create_tf_dataset_for_client(client_id)
  index = client_data.client_ids.index(client_id)
  return (ds.shuffle(10_000, seed=_round_seed(seed, round_num, index + 1), reshuffle_each_iteration=True)
          .repeat(local_epochs).batch(batch_size))


def round_datasets(client_data: tff.simulation.datasets.ClientData, round_num: int, *, batch_size: int = 16,
                   seed: int = 0, local_epochs: int = 1) -> list[tf.data.Dataset]:
  """Every client's `client_dataset` for the round, in `client_data.client_ids` order."""
  return [client_dataset(client_data, cid, local_epochs=local_epochs, batch_size=batch_size, seed=seed,
                         round_num=round_num) for cid in client_data.client_ids]


# ----------------------------------------------------------------------------------------------- model and state


def central_evaluator(build_keras: Callable[[], tf.keras.Model], x: np.ndarray, y: np.ndarray,
                      batch_size: int = 512) -> Callable[[tff.learning.models.ModelWeights], dict[str, float]]:
  """`weights -> {'accuracy', 'loss'}` (mean softmax cross-entropy of the logits) on `(x, y)`.

  Builds a fresh Keras model per call: one built before TFF traced a model in a graph can be left invalid.
  """

  def evaluate(model_weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    model = build_keras()
    model(x[:1], training=False)
    model_weights.assign_weights_to(model)
    logits = np.concatenate([model(x[i:i + batch_size], training=False).numpy()
                             for i in range(0, len(x), batch_size)]).astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    labels = np.asarray(y).astype(np.int64)
    return {'accuracy': float(np.mean(np.argmax(logits, axis=-1) == labels)),
            'loss': float(-np.mean(log_probs[np.arange(len(labels)), labels]))}

  return evaluate


def seeded_initial_state(process: tff.learning.templates.LearningProcess,
                         build_keras: Callable[[], tf.keras.Model], seed: int):
  """`process.initialize()` with the model weights of a Keras initialisation seeded by `seed`."""
  state = process.initialize()
  tf.keras.utils.set_random_seed(seed)
  keras_model = build_keras()
  weights = tff.learning.models.ModelWeights(
      trainable=[v.numpy() for v in keras_model.trainable_weights],
      non_trainable=[v.numpy() for v in keras_model.non_trainable_weights])
  return process.set_model_weights(state, weights)


def fed_avg_family(model_fn: Callable[[], tff.learning.models.VariableModel], algorithm: str = 'fedavg',
                   model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None, *,
                   client_lr: float = CLIENT_LR, server_lr: float = 1.0) -> tff.learning.templates.LearningProcess:
  """`algorithm` (ALGORITHMS) from TFF's builders: momentum-SGD clients, example weights, the library's loop."""
  if algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, got {algorithm!r}')
  client_optimizer = tff.learning.optimizers.build_sgdm(client_lr, momentum=CLIENT_MOMENTUM)
  if algorithm == 'fedadam':
    server_optimizer = tff.learning.optimizers.build_adam(
        server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=ADAPTIVE_EPSILON)
  elif algorithm == 'fedyogi':
    server_optimizer = tff.learning.optimizers.build_yogi(
        server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=ADAPTIVE_EPSILON)
  else:
    server_optimizer = tff.learning.optimizers.build_sgdm(server_lr)
  kwargs = dict(model_aggregator=model_aggregator, loop_implementation=client_lib.DEFAULT_LOOP_IMPLEMENTATION)
  if algorithm == 'fedprox':
    return tff.learning.algorithms.build_weighted_fed_prox(
        model_fn, PROXIMAL_STRENGTH, client_optimizer, server_optimizer, **kwargs)
  return tff.learning.algorithms.build_weighted_fed_avg(model_fn, client_optimizer, server_optimizer, **kwargs)


# -------------------------------------------------------------------------------------------------- client state


class ClientStateHolder:
  """The kept values (a tuple of arrays) of each client of one `LearningProcessWithClientState`, in memory."""

  def __init__(self, process: client_lib.LearningProcessWithClientState):
    if not isinstance(process, client_lib.LearningProcessWithClientState):
      raise ValueError(f'process must be a LearningProcessWithClientState, got {process!r}')
    leaves = tff.structure.flatten(process.client_state_type)
    self._specs = [(tuple(t.shape), np.dtype(t.dtype)) for t in leaves]
    self._key = process.client_state_key
    self._arrays: dict[str, tuple[np.ndarray, ...]] = {}

  def __len__(self) -> int:
    return len(self._arrays)

  def get(self, client_id: str) -> tuple[np.ndarray, ...]:
    """The client's values; zeros for a client not seen yet."""
    if client_id in self._arrays:
      return self._arrays[client_id]
    return tuple(np.zeros(shape, dtype) for shape, dtype in self._specs)

  def set(self, client_id: str, arrays: Sequence[np.ndarray]) -> None:
    arrays = tuple(np.asarray(a) for a in arrays)
    got = [(a.shape, a.dtype) for a in arrays]
    if got != self._specs:  # What the process returned must match its own `client_state_type`.
      raise ValueError(f'client {client_id!r}: shapes and dtypes {got}, expected {self._specs}')
    self._arrays[client_id] = arrays

  def client_data(self, client_id: str, batches: tf.data.Dataset) -> collections.OrderedDict:
    """The client's input to the process: its batches and a one-element dataset of its kept values."""
    kept = tf.data.Dataset.from_tensors(tuple(tf.constant(a) for a in self.get(client_id)))
    return collections.OrderedDict([(client_lib.BATCHES, batches), (self._key, kept)])

  def run_round(self, process: client_lib.LearningProcessWithClientState, state, client_ids: Sequence[str],
                datasets: Sequence[tf.data.Dataset]):
    """One `next_with_client_state` round; keeps the clients' new values; returns (state, metrics)."""
    output = process.next_with_client_state(
        state, [self.client_data(cid, ds) for cid, ds in zip(client_ids, datasets)])
    assert len(output.client_state) == len(client_ids)
    for client_id, values in zip(client_ids, output.client_state):
      self.set(client_id, values)
    return output.state, output.metrics
