"""The one method registry: every method the runner, the demo, the studies and the benchmark can name.

A method is a learning algorithm (`ALGORITHMS`) with an aggregator (`AGGREGATORS`, see `training.registry`),
built by `build` and driven through one interface, `Method`:

* `run_round(state, client_ids, datasets, round_num) -> (state, metrics)`;
* `checkpoint_client_state(directory, round_num)` / `restore_client_state(directory, round_num)`: what clients
  keep between rounds (nothing for most methods);
* `evaluate_clients(evaluator, model_weights)`: evaluations that need the clients' own values (personalized
  RFA's personalized models), `{}` for the others.

What is behind it:
* TFF's FedAvg/FedProx/FedAdam/FedYogi composed from the one client work of `training.simulation`, with any
  aggregator of `training.registry` as the model aggregator; with update corruption (`gaussian`, `omniscient`),
  the same process with the corrupted client work of `training.corruption` and its simulated attacker;
* the composed processes of `tff_gma.learning`: Elastic FedAvg (`--aggregator=elastic`, with the FedAvg/FedAdam/
  FedYogi server optimizers), FedGMA (`--algorithm=fedgma`), SCAFFOLD (`--algorithm=scaffold`) and personalized
  RFA (`--algorithm=personalized`); the last two keep client state (`training.client_state`).

Where the clients train (`build(..., client_execution=...)`, the runner's `--client_execution`): `worker` (default)
runs the whole round in the TFF worker; `local` runs the FedAvg family's client work in this process's TensorFlow
(its GPUs where there are any) and the rest of the round in the worker (`training.client_execution`), from the same
`simulation.Components`; the composed methods and the update corruptions are refused there (`check`).

Adding an aggregator is one entry in `training.registry` (plus its module and test); adding an algorithm is one
branch of `_build_process` here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma.learning import elastic as elastic_learning
from tff_gma.learning import fedgma as fedgma_learning
from training import client_execution as client_execution_lib
from training import client_state
from training import corruption as corruption_lib
from training import evaluation
from training import registry
from training import simulation

PERSONALIZED = 'personalized'  # Personalized RFA (RFA paper, Algorithm 4) with --aggregator=rfa.
COMPOSED_ALGORITHMS = ('fedgma', 'scaffold', PERSONALIZED)
ALGORITHMS = simulation.ALGORITHMS + COMPOSED_ALGORITHMS
# Aggregators that are learning processes of their own rather than a `model_aggregator`.
PROCESS_AGGREGATORS = ('elastic',)
AGGREGATORS = registry.NAMES + PROCESS_AGGREGATORS
AGGREGATOR_DESCRIPTIONS = {
    **registry.DESCRIPTIONS,
    'elastic': 'elastic aggregation: update scaled by parameter sensitivity (tau)',
}
METHOD_DESCRIPTIONS = {
    **AGGREGATOR_DESCRIPTIONS,
    'fedgma': 'FedGMA: averaged models + AND-masked server step (p=0.8)',
    'scaffold': 'SCAFFOLD with client control variates, weighted mean of the updates',
    PERSONALIZED: 'personalized RFA: shared parameters by RFA, personal ones kept by the clients',
}
KEEP_CHECKPOINTS = 3  # Rounds of server checkpoints (and of client state) kept in an output directory.


@dataclasses.dataclass(frozen=True)
class MethodParams:
  """Hyperparameters of the composed methods (paper defaults, from the library)."""
  elastic_tau: float = elastic_learning.DEFAULT_TAU  # Elastic aggregation tau.
  elastic_mu: float = elastic_learning.DEFAULT_MU  # Elastic sensitivity momentum.
  sensitivity_fraction: float = elastic_learning.DEFAULT_SENSITIVITY_FRACTION  # Share of batches for it.
  fedgma_step_size: float = fedgma_learning.DEFAULT_SERVER_STEP_SIZE  # FedGMA extra server step eta_s.
  fedgma_threshold: float = fedgma_learning.DEFAULT_MASK_THRESHOLD  # FedGMA AND-mask p.


def resolve(name: str) -> tuple[str, str]:
  """A method's short name (the demo's and the benchmark's) -> (algorithm, aggregator).

  An aggregator name is FedAvg with it; a composed algorithm's name is that algorithm with its usual aggregator
  (the mean; RFA for personalized RFA); 'ALGORITHM/AGGREGATOR' names both.
  """
  if '/' in name:
    algorithm, _, aggregator = name.partition('/')
  elif name in AGGREGATORS:
    algorithm, aggregator = 'fedavg', name
  elif name in COMPOSED_ALGORITHMS:
    algorithm, aggregator = name, 'rfa' if name == PERSONALIZED else 'mean'
  else:
    raise ValueError(f'unknown method {name!r}; known: {", ".join(METHOD_DESCRIPTIONS)} or ALGORITHM/AGGREGATOR')
  check(algorithm, aggregator)
  return algorithm, aggregator


def check(algorithm: str, aggregator: str, corruption: str = corruption_lib.NONE,
          client_execution: str = client_execution_lib.WORKER, workers: Optional[str] = None) -> None:
  """Raises ValueError naming the flag when the combination does not exist (or cannot run in that mode)."""
  if algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm: unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}')
  if aggregator not in AGGREGATORS:
    raise ValueError(f'aggregator: unknown aggregator {aggregator!r}; expected one of {AGGREGATORS}')
  if aggregator in PROCESS_AGGREGATORS and algorithm not in ('fedavg', 'fedadam', 'fedyogi'):
    raise ValueError(f'aggregator: {aggregator} runs with algorithm fedavg, fedadam or fedyogi, not {algorithm!r}')
  if corruption in corruption_lib.UPDATE_CORRUPTIONS and (
      algorithm not in simulation.ALGORITHMS or aggregator in PROCESS_AGGREGATORS):
    raise ValueError(f'corruption: {corruption} corrupts the client work of fedavg, fedprox, fedadam and fedyogi '
                     f'with a model aggregator, not algorithm={algorithm!r}, aggregator={aggregator!r}')
  client_execution_lib.check(client_execution, algorithm=algorithm, aggregator=aggregator, corruption=corruption,
                             workers=workers, composed=aggregator in PROCESS_AGGREGATORS)


@dataclasses.dataclass(frozen=True)
class UpdateCorruption:
  """A run's update corruption: which clients send `kind` (`gaussian`/`omniscient`) instead of their update."""
  kind: str
  corrupted: tuple[str, ...]
  client_ids: tuple[str, ...]
  seed: int


class Method:
  """A built method: its learning process and how a round of it runs (see the module docstring)."""

  def __init__(self, process: tff.learning.templates.LearningProcess,
               round_fn: Optional[Callable[..., tuple[Any, Any]]] = None,
               store: Optional[client_state.ClientStateStore] = None,
               held_out: Optional[Mapping[str, tuple[np.ndarray, np.ndarray]]] = None,
               local_round: Optional[client_execution_lib.LocalRound] = None):
    self.process = process
    self._local_round = local_round
    self._round_fn = round_fn if local_round is None else local_round.run_round
    self.client_state = store  # Values the clients keep between rounds (SCAFFOLD's c_i, personalized v_k).
    self._held_out = dict(held_out or {})

  def run_round(self, state, client_ids: Sequence[str], datasets: Sequence[tf.data.Dataset], round_num: int):
    """One round on the given clients; returns (state, metrics)."""
    if self._round_fn is not None:
      return self._round_fn(state, list(client_ids), list(datasets), round_num)
    if self.client_state is not None:
      return self.client_state.run_round(self.process, state, client_ids, datasets)
    output = self.process.next(state, list(datasets))
    return output.state, output.metrics

  @property
  def client_execution(self) -> str:
    """Where the clients train: `worker` (in the TFF worker) or `local` (in this process)."""
    return client_execution_lib.WORKER if self._local_round is None else client_execution_lib.LOCAL

  def client_devices(self) -> list[str]:
    """Where the clients' training ran: the TensorFlow devices in `local` mode, the TFF worker's CPU otherwise."""
    if self._local_round is None:
      return list(client_execution_lib.WORKER_DEVICES)
    return self._local_round.client_devices()

  def checkpoint_client_state(self, directory: str, round_num: int) -> None:
    """Saves what clients keep as of `round_num` (call before the round's server checkpoint)."""
    if self.client_state is not None:
      self.client_state.checkpoint(directory, round_num, KEEP_CHECKPOINTS)

  def restore_client_state(self, directory: str, round_num: int) -> None:
    """Loads what clients kept as of `round_num` (round 0: nothing yet)."""
    if self.client_state is not None:
      self.client_state.restore(directory, round_num)

  def evaluate_clients(self, evaluator: evaluation.CentralEvaluator,
                       model_weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    """Personalized RFA: `personalized/*` on the clients' held-out examples; `{}` for other methods."""
    if self.client_state is None or not self._held_out:
      return {}
    return evaluation.evaluate_personalized(evaluator, model_weights, self.client_state.get, self._held_out)


# Built processes by everything that defines them: a driver building many methods in one Python process (a
# study, the demo) traces each computation once. The processes hold no state of a run.
_PROCESS_CACHE: dict[tuple, tff.learning.templates.LearningProcess] = {}


def build(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm: str,
    aggregator: str,
    *,
    algorithm_config: Optional[simulation.AlgorithmConfig] = None,
    aggregator_params: Optional[registry.AggregatorParams] = None,
    method_params: Optional[MethodParams] = None,
    num_clients: Optional[int] = None,
    metrics_aggregator=None,
    update_corruption: Optional[UpdateCorruption] = None,
    held_out: Optional[Mapping[str, tuple[np.ndarray, np.ndarray]]] = None,
    cache_key: Optional[tuple] = None,
    client_execution: str = client_execution_lib.WORKER,
) -> Method:
  """The method `algorithm` x `aggregator` (names as the runner's flags).

  Args:
    model_fn: no-argument callable returning a `tff.learning.models.VariableModel`.
    algorithm, aggregator: see `ALGORITHMS`, `AGGREGATORS`; `check` refuses impossible combinations.
    algorithm_config: learning rates and optimizer settings (its own `name` is ignored: `algorithm` decides;
      the composed algorithms take the FedAvg optimizers).
    aggregator_params, method_params: the aggregator's and the composed methods' hyperparameters.
    num_clients: the population size (SCAFFOLD's |S| / N).
    metrics_aggregator: as in TFF's builders.
    update_corruption: corrupt some clients' updates (FedAvg family only).
    held_out: personalized RFA: each client's held-out examples for `evaluate_clients`.
    cache_key: what else defines `model_fn`'s model (data set, model name, input shape...); with it, the built
      process is reused by later calls with the same settings.
    client_execution: `worker` (default): the whole round runs in the TFF worker; `local`: the clients train in
      this process's TensorFlow (a GPU where there is one) and the rest of the round runs in the worker
      (`training.client_execution`; FedAvg family only).
  """
  check(algorithm, aggregator, update_corruption.kind if update_corruption else corruption_lib.NONE,
        client_execution)
  config = algorithm_config or simulation.AlgorithmConfig()
  config = dataclasses.replace(config, name=algorithm if algorithm in simulation.ALGORITHMS else 'fedavg')
  params = aggregator_params or registry.AggregatorParams()
  extra = method_params or MethodParams()
  corrupted = update_corruption is not None
  key = None if cache_key is None else (
      cache_key, algorithm, aggregator, config, params, extra, num_clients, metrics_aggregator, corrupted,
      client_execution)
  if key is not None and key in _PROCESS_CACHE:
    process = _PROCESS_CACHE[key]
  else:
    process = _build_process(model_fn, algorithm, aggregator, config, params, extra, num_clients,
                             metrics_aggregator, corrupted, client_execution)
    if key is not None:
      _PROCESS_CACHE[key] = process
  if isinstance(process, client_execution_lib.LocalRound):
    return Method(process.process, local_round=process)
  if corrupted:
    harness = corruption_lib.UpdateCorruption(process, update_corruption.kind, update_corruption.corrupted,
                                              update_corruption.client_ids, update_corruption.seed)
    return Method(process, lambda *args: tuple(harness.run_round(*args)))
  if isinstance(process, learning.LearningProcessWithClientState):
    return Method(process, store=client_state.ClientStateStore.for_process(process), held_out=held_out)
  return Method(process)


def _build_process(model_fn, algorithm: str, aggregator: str, config: simulation.AlgorithmConfig,
                   params: registry.AggregatorParams, extra: MethodParams, num_clients: Optional[int],
                   metrics_aggregator, corrupted: bool, client_execution: str = client_execution_lib.WORKER
                   ) -> tff.learning.templates.LearningProcess | client_execution_lib.LocalRound:
  if aggregator == 'elastic':
    return learning.build_elastic_fed_avg(
        model_fn, simulation.client_optimizer(config), simulation.server_optimizer(config),
        tau=extra.elastic_tau, mu=extra.elastic_mu, sensitivity_fraction=extra.sensitivity_fraction,
        secure=params.secure, value_bound=params.secure_bound, metrics_aggregator=metrics_aggregator)
  model_aggregator = registry.build(aggregator, params)
  if algorithm == 'fedgma':
    return learning.build_fedgma(
        model_fn, simulation.client_optimizer(config), simulation.server_optimizer(config),
        server_step_size=extra.fedgma_step_size, mask_threshold=extra.fedgma_threshold,
        model_aggregator=model_aggregator, metrics_aggregator=metrics_aggregator)
  if algorithm == 'scaffold':
    return learning.build_scaffold(
        model_fn, config.client_lr, config.server_lr, model_aggregator, num_clients=num_clients,
        metrics_aggregator=metrics_aggregator)
  if algorithm == PERSONALIZED:
    return learning.build_personalized_rfa(
        model_fn, simulation.client_optimizer(config), simulation.server_optimizer(config), model_aggregator,
        metrics_aggregator)
  # GMA with FedAdam/FedYogi is the GMA paper's Algorithm 2: the adaptive moments see the unmasked mean and the mask
  # scales the step (the drop-in factory would mask before Adam, which largely undoes the mask). FedAvg/FedProx
  # keep the drop-in factory: with their SGD server both placements are the same.
  mask_on_step = (isinstance(model_aggregator, aggregators.GradientMaskedFactory)
                  and config.name in simulation.ADAPTIVE_ALGORITHMS)
  if client_execution == client_execution_lib.LOCAL:  # The same components; the clients train in this process.
    components = simulation.build_components(model_fn, config, model_aggregator, metrics_aggregator,
                                             mask_on_step=mask_on_step)
    return client_execution_lib.LocalRound(components, model_fn, config, metrics_aggregator)
  if corrupted:
    return corruption_lib.build_learning_process(
        model_fn, config, model_aggregator, metrics_aggregator, mask_on_step=mask_on_step)
  return simulation.build_learning_process(
      model_fn, config, model_aggregator, metrics_aggregator, mask_on_step=mask_on_step)
