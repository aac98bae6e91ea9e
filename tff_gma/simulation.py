"""Simulation plumbing shared by the demo, the experiment runner and the tests.

Building learning processes (FedAvg, FedProx, FedAdam, FedYogi with any aggregation factory), preparing the
round's client datasets deterministically, and evaluating the global model on the central test split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

ALGORITHMS = ('fedavg', 'fedprox', 'fedadam', 'fedyogi')

# Paper defaults (GMA paper, Sec. 5 and App. C): client SGD with momentum 0.9; FedAdam/FedYogi with
# beta1 = 0.9, beta2 = 0.99 (Reddi et al.).
CLIENT_MOMENTUM = 0.9
ADAPTIVE_BETA_1 = 0.9
ADAPTIVE_BETA_2 = 0.99


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """Hyperparameters of the server/client optimisation, independent of the aggregation rule."""
  name: str = 'fedavg'
  client_lr: float = 0.05
  server_lr: float = 1.0
  client_momentum: float = CLIENT_MOMENTUM
  proximal_strength: float = 0.01  # FedProx mu.
  adaptive_epsilon: float = 1e-3  # FedAdam/FedYogi tau (Reddi et al.'s adaptivity epsilon).

  def __post_init__(self):
    if self.name not in ALGORITHMS:
      raise ValueError(f'algorithm must be one of {ALGORITHMS}, got {self.name!r}')
    for field in ('client_lr', 'server_lr'):
      if not getattr(self, field) > 0:
        raise ValueError(f'{field} must be positive, got {getattr(self, field)!r}')
    if not 0 <= self.client_momentum < 1:
      raise ValueError(f'client_momentum must lie in [0, 1), got {self.client_momentum!r}')
    if self.proximal_strength < 0:
      raise ValueError(f'proximal_strength must be non-negative, got {self.proximal_strength!r}')
    if not self.adaptive_epsilon > 0:
      raise ValueError(f'adaptive_epsilon must be positive, got {self.adaptive_epsilon!r}')


def server_optimizer(config: AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  # FedAdam/FedYogi are FedAvg with an adaptive server optimizer applied to the aggregated update (GMA paper,
  # Algorithm 2: the mask is applied to the update before the server optimizer sees it).
  if config.name == 'fedadam':
    return tff.learning.optimizers.build_adam(
        config.server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=config.adaptive_epsilon)
  if config.name == 'fedyogi':
    return tff.learning.optimizers.build_yogi(
        config.server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=config.adaptive_epsilon)
  return tff.learning.optimizers.build_sgdm(config.server_lr)


def client_optimizer(config: AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  return tff.learning.optimizers.build_sgdm(config.client_lr, momentum=config.client_momentum)


def build_learning_process(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    config: AlgorithmConfig,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
) -> tff.learning.templates.LearningProcess:
  """TFF's own FedAvg/FedProx process with `model_aggregator` in place of the weighted mean."""
  kwargs = dict(
      # TFF's default DATASET_REDUCE loop costs about twice the worker CPU per round of DATASET_ITERATOR, for
      # identical weights (measured by scripts/bench.py's --loop comparison).
      loop_implementation=tff.learning.LoopImplementation.DATASET_ITERATOR,
      client_optimizer_fn=client_optimizer(config),
      server_optimizer_fn=server_optimizer(config),
      model_aggregator=model_aggregator,
      metrics_aggregator=metrics_aggregator,
  )
  if config.name == 'fedprox':
    return tff.learning.algorithms.build_weighted_fed_prox(
        model_fn, proximal_strength=config.proximal_strength, **kwargs)
  return tff.learning.algorithms.build_weighted_fed_avg(model_fn, **kwargs)


def _round_seed(seed: int, round_num: int, index: int = 0) -> int:
  return int(np.random.SeedSequence([seed, round_num, index]).generate_state(1)[0] & 0x7FFFFFFF)


def sample_clients(client_ids: Sequence[str], num: int, seed: int, round_num: int) -> list[str]:
  """`num` distinct clients for the round; a function of (seed, round) only, so resumed runs repeat it."""
  if not 1 <= num <= len(client_ids):
    raise ValueError(f'clients_per_round must lie in [1, {len(client_ids)}], got {num}')
  if num == len(client_ids):
    return list(client_ids)
  rng = np.random.default_rng(_round_seed(seed, round_num))
  return [client_ids[i] for i in sorted(rng.choice(len(client_ids), size=num, replace=False))]


def client_dataset(
    client_data: tff.simulation.datasets.ClientData, client_id: str, *, local_epochs: int, batch_size: int,
    seed: int, round_num: int,
) -> tf.data.Dataset:
  """The client's data for one round: shuffled (seeded by seed, round and client), repeated, batched."""
  ds = client_data.create_tf_dataset_for_client(client_id)
  index = client_data.client_ids.index(client_id)
  return (ds.shuffle(10_000, seed=_round_seed(seed, round_num, index + 1), reshuffle_each_iteration=True)
          .repeat(local_epochs).batch(batch_size))


@dataclasses.dataclass
class CentralEvaluator:
  """Evaluates a `ModelWeights` on held-out arrays with a local Keras copy of the model (no TFF round-trip).

  With `pad_id` (sequence targets), positions whose target is `pad_id` count in neither loss nor accuracy.
  """
  build_keras: Callable[[], tf.keras.Model]
  x: np.ndarray
  y: np.ndarray
  batch_size: int = 512
  pad_id: Optional[int] = None

  def __call__(self, model_weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    return self.evaluate_arrays(model_weights, self.x, self.y)

  def evaluate_arrays(self, model_weights: tff.learning.models.ModelWeights, x: np.ndarray,
                      y: np.ndarray) -> dict[str, float]:
    logits = self.logits(model_weights, x).astype(np.float64)
    # A diverged model (e.g. plain averaging under the omniscient attack) has non-finite logits: its loss is
    # reported as NaN and its accuracy is what argmax picks (index 0 for a NaN row), without numpy warnings.
    with np.errstate(invalid='ignore', over='ignore'):
      shifted = logits - logits.max(axis=-1, keepdims=True)
      log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np.asarray(y)[..., None].astype(np.int64), axis=-1)[..., 0]
    correct = np.argmax(logits, axis=-1) == y
    mask = np.ones_like(correct) if self.pad_id is None else (np.asarray(y) != self.pad_id)
    count = max(int(mask.sum()), 1)
    return {'accuracy': float((correct * mask).sum() / count), 'loss': float((nll * mask).sum() / count)}

  def logits(self, model_weights: tff.learning.models.ModelWeights, x: np.ndarray) -> np.ndarray:
    # A fresh Keras model per call, called directly: a Keras model kept across TFF's tracing of other Keras models
    # (TFF builds them inside graphs) can end up refusing eager calls ("invalid state"); building one costs ms.
    model = self.build_keras()
    model(x[:1], training=False)
    model_weights.assign_weights_to(model)
    return np.concatenate([
        model(x[i:i + self.batch_size], training=False).numpy()
        for i in range(0, len(x), self.batch_size)
    ])


def flatten_metrics(metrics, prefix: str = '') -> dict[str, float]:
  """Nested metrics/measurements -> {'a/b/c': float} for logging; non-scalars are skipped."""
  out = {}
  if isinstance(metrics, dict) or hasattr(metrics, 'items'):
    for k, v in metrics.items():
      out.update(flatten_metrics(v, f'{prefix}{k}/'))
    return out
  try:
    value = np.asarray(metrics)
  except Exception:  # pylint: disable=broad-except
    return out
  if value.ndim == 0 and value.dtype.kind in 'biuf':
    out[prefix.rstrip('/')] = float(value)
  return out


def seeded_initial_state(process: tff.learning.templates.LearningProcess,
                         build_keras: Callable[[], tf.keras.Model], seed: int):
  """`process.initialize()` with the model weights replaced by a Keras initialisation seeded by `seed`.

  TFF's `initialize` draws the initial weights inside the worker, unseeded; replacing them makes runs with the
  same seed start from the same model (and every aggregator in a comparison from the same model).
  """
  state = process.initialize()
  tf.keras.utils.set_random_seed(seed)  # Seeds Keras' initializers (and Python's and NumPy's global RNGs).
  keras_model = build_keras()
  weights = tff.learning.models.ModelWeights(
      trainable=[v.numpy() for v in keras_model.trainable_weights],
      non_trainable=[v.numpy() for v in keras_model.non_trainable_weights])
  return process.set_model_weights(state, weights)
