"""Simulation plumbing shared by the methods, the runner, the demo, the studies and the benchmark.

* The FedAvg family (FedAvg, FedProx, FedAdam, FedYogi): `AlgorithmConfig`, its optimizers, and its one client
  work (`build_client_work`), from which the learning process (`build_learning_process`), the corrupted
  process (`training.corruption`) and the RFA weight replay (`training.rfa_weights`) are all built. The round's
  parts (`build_components`: `Components`) serve both client execution modes (`training.client_execution`).
* The round's clients and their datasets, deterministically (`sample_clients`, `client_dataset`).
* `seeded_initial_state`, `flatten_metrics`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.learning.templates import proximal_client_work  # FedProx's client work.

from tff_gma import checks
from tff_gma.learning import gma_fed_avg

ALGORITHMS = ('fedavg', 'fedprox', 'fedadam', 'fedyogi')
ADAPTIVE_ALGORITHMS = ('fedadam', 'fedyogi')  # Adaptive server optimizers; the others' server is SGD.

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
      checks.check_positive_finite(getattr(self, field), field)
    if not 0 <= self.client_momentum < 1:
      raise ValueError(f'client_momentum must lie in [0, 1), got {self.client_momentum!r}')
    if self.proximal_strength < 0:
      raise ValueError(f'proximal_strength must be non-negative, got {self.proximal_strength!r}')
    if not self.adaptive_epsilon > 0:
      raise ValueError(f'adaptive_epsilon must be positive, got {self.adaptive_epsilon!r}')


def server_optimizer(config: AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  # FedAdam/FedYogi are FedAvg with an adaptive server optimizer applied to the aggregated update (Reddi et al.).
  if config.name == 'fedadam':
    return tff.learning.optimizers.build_adam(
        config.server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=config.adaptive_epsilon)
  if config.name == 'fedyogi':
    return tff.learning.optimizers.build_yogi(
        config.server_lr, beta_1=ADAPTIVE_BETA_1, beta_2=ADAPTIVE_BETA_2, epsilon=config.adaptive_epsilon)
  return tff.learning.optimizers.build_sgdm(config.server_lr)


def client_optimizer(config: AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  return tff.learning.optimizers.build_sgdm(config.client_lr, momentum=config.client_momentum)


def build_server_processes(
    config: AlgorithmConfig,
    weights_type,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    *,
    mask_on_step: bool = False,
) -> tuple[tff.templates.AggregationProcess, tff.learning.templates.FinalizerProcess]:
  """(aggregator, finalizer): how a round turns the client updates into the new model (`weights_type`'s).

  Default: `model_aggregator` (TFF's weighted mean if None) aggregates the updates, weighted as float32, and TFF's
  apply-optimizer finalizer applies `server_optimizer(config)` to its result, as `build_weighted_fed_avg` does.
  `mask_on_step=True` takes a `GradientMaskedFactory` and composes the GMA paper's Algorithm 2 instead
  (`tff_gma.learning.gma_fed_avg`): the server optimizer gets the unmasked mean, the mask scales its step.
  """
  if mask_on_step:
    return gma_fed_avg.build_gma_server_processes(model_aggregator, server_optimizer(config), weights_type)
  aggregator = (model_aggregator or tff.aggregators.MeanFactory()).create(
      weights_type.trainable, tff.TensorType(np.float32))
  return aggregator, tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer(config), weights_type)


# The client training loop of every FedAvg-family client work, in the worker and in the driver
# (`training.client_execution`): TFF's default DATASET_REDUCE loop costs about twice the worker CPU per round of
# DATASET_ITERATOR, for identical weights (measured by the benchmark's loop comparison).
LOOP_IMPLEMENTATION = tff.learning.LoopImplementation.DATASET_ITERATOR
CLIENT_WEIGHTING = tff.learning.ClientWeighting.NUM_EXAMPLES


def build_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    config: AlgorithmConfig,
    metrics_aggregator=None,
) -> tff.learning.templates.ClientWorkProcess:
  """The FedAvg family's client work: the one that training, corruption and the RFA weight replay run.

  TFF's model-delta client work (FedProx's with its proximal term), as `build_weighted_fed_avg` and
  `build_weighted_fed_prox` build it: SGD with momentum at `client_lr`, example-count weights. FedAdam and
  FedYogi differ only at the server.
  """
  if not isinstance(config, AlgorithmConfig):
    raise ValueError(f'config must be a simulation.AlgorithmConfig, got {config!r}')
  kwargs = dict(loop_implementation=LOOP_IMPLEMENTATION, metrics_aggregator=metrics_aggregator)
  if config.name == 'fedprox':
    return proximal_client_work.build_model_delta_client_work(
        model_fn, client_optimizer(config), CLIENT_WEIGHTING, delta_l2_regularizer=config.proximal_strength,
        **kwargs)
  return tff.learning.templates.build_model_delta_client_work(
      model_fn, client_optimizer(config), CLIENT_WEIGHTING, **kwargs)


@dataclasses.dataclass(frozen=True)
class Components:
  """The five parts `tff.learning.templates.compose_learning_process` composes a round from.

  The seam between where the round's parts run: `compose()` is the learning process that runs them all in the TFF
  worker (`--client_execution=worker`); `training.client_execution` runs `client_work`'s math in the driver's
  TensorFlow (GPU where there is one) and the rest (`distributor`'s state and measurements, `aggregator`,
  `finalizer`, the client metrics' aggregation) as one federated computation in the worker, on the state of
  `compose()`'s process (`--client_execution=local`). A builder that swaps the aggregator and finalizer
  (`dataclasses.replace`) gets both modes.
  """
  initial_weights_fn: tff.Computation
  distributor: tff.learning.templates.DistributionProcess
  client_work: tff.learning.templates.ClientWorkProcess
  aggregator: tff.templates.AggregationProcess
  finalizer: tff.learning.templates.FinalizerProcess

  @property
  def weights_type(self):
    return self.initial_weights_fn.type_signature.result

  def compose(self) -> tff.learning.templates.LearningProcess:
    return tff.learning.templates.compose_learning_process(
        self.initial_weights_fn, self.distributor, self.client_work, self.aggregator, self.finalizer)


def build_components(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    config: AlgorithmConfig,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    client_work: Optional[tff.learning.templates.ClientWorkProcess] = None,
    *,
    mask_on_step: bool = False,
) -> Components:
  """The parts of `build_learning_process`'s round (see `Components`; `mask_on_step`: `build_server_processes`)."""
  if client_work is None:
    client_work = build_client_work(model_fn, config, metrics_aggregator)

  @tff.tensorflow.computation()
  def initial_weights_fn():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  weights_type = initial_weights_fn.type_signature.result
  aggregator, finalizer = build_server_processes(config, weights_type, model_aggregator, mask_on_step=mask_on_step)
  return Components(initial_weights_fn, tff.learning.templates.build_broadcast_process(weights_type), client_work,
                    aggregator, finalizer)


def build_learning_process(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    config: AlgorithmConfig,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    client_work: Optional[tff.learning.templates.ClientWorkProcess] = None,
    *,
    mask_on_step: bool = False,
) -> tff.learning.templates.LearningProcess:
  """FedAvg/FedProx/FedAdam/FedYogi with `model_aggregator` in place of the weighted mean.

  Composed from TFF's templates as `build_weighted_fed_avg` composes it (broadcast, `build_client_work`, the
  aggregator with example-count weights, the server optimizer's finalizer): `build_components(...).compose()`;
  `client_work` replaces the client work (e.g. the corrupted one, which wraps `build_client_work`'s);
  `mask_on_step=True` with a `GradientMaskedFactory`: GMA's Algorithm 2 (`build_server_processes`).
  """
  return build_components(model_fn, config, model_aggregator, metrics_aggregator, client_work,
                          mask_on_step=mask_on_step).compose()


def build_client_results(client_work: tff.learning.templates.ClientWorkProcess) -> tff.Computation:
  """`(model_weights@SERVER, client_data@CLIENTS) -> ClientResult@CLIENTS`: the client work alone, no aggregation.

  SIMULATION ONLY: every client's update at once is what the omniscient attacker and the RFA weight replay need;
  no deployed computation does this. Starts from the client work's initial state, as every round of the FedAvg
  family does (its state is the client optimizer's hyperparameters).
  """
  _, weights_type, data_type = client_work.next.type_signature.parameter

  @tff.federated_computation(tff.FederatedType(weights_type.member, tff.SERVER), data_type)
  def client_results(model_weights, client_data):
    return client_work.next(client_work.initialize(), tff.federated_broadcast(model_weights), client_data).result

  return client_results


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
