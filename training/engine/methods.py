"""Building a method: `build` makes the learning process of a registry pair, `Method` drives its rounds.

One interface for every method (`run_round`, its clients' state saved and restored, `evaluate_clients`): the FedAvg
family with any model aggregator, or a composed process of `tff_gma.learning`; clients train in the TFF worker or,
for the FedAvg family, in this process (`client_execution`). docs/experiments.md#building-and-driving-a-method"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from training import config as config_lib
from training.engine import client_execution as client_execution_lib
from training.engine import client_state
from training.engine import corruption as corruption_lib
from training.engine import evaluation
from training.engine import fedavg_family
from training.engine import registry

KEEP_CHECKPOINTS = 3  # Rounds of server checkpoints (and of client state) kept in an output directory.


class Method:
  """A built method: its learning process and how a round of it runs.

  docs/experiments.md#building-and-driving-a-method says what is behind it.
  """

  def __init__(self, process: tff.learning.templates.LearningProcess,
               round_fn: Optional[Callable[..., tuple[Any, Any]]] = None,
               store: Optional[client_state.ClientStateStore] = None,
               held_out: Optional[Mapping[str, tuple[np.ndarray, np.ndarray]]] = None,
               local_round: Optional[client_execution_lib.LocalRound] = None,
               client_sources=None):
    self.process = process
    # Set when the process's clients take sources to build their datasets from (`build(client_sources=...)`).
    self.client_sources = client_sources
    self._local_round = local_round
    self._round_fn = round_fn if local_round is None else local_round.run_round
    self.client_state = store  # Values the clients keep between rounds (SCAFFOLD's c_i, personalized v_k).
    self._held_out = dict(held_out or {})
    self._worker_datasets = None

  def place_datasets_in_worker(self, worker_datasets) -> None:
    """Gives a method built with `client_sources` the run's files (`training.engine.worker_datasets`): `run_round`
    then sends each participant's file prefix and shuffle seeds, and the worker builds the dataset the round's
    `datasets` would have sent (the same examples, order and batches)."""
    if self.client_sources is None:
      raise ValueError('this method was built for datasets sent each round (build(client_sources=None))')
    self._worker_datasets = worker_datasets

  def run_round(self, state, client_ids: Sequence[str], datasets: Sequence[tf.data.Dataset], round_num: int):
    """One round on the given clients; returns (state, metrics)."""
    if self.client_sources is not None:
      if self._worker_datasets is None:
        raise ValueError('this method\'s clients build their datasets from files: place_datasets_in_worker first')
      output = self.process.next(state, self._worker_datasets.sources(client_ids, round_num))
      return output.state, output.metrics
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
    algorithm_config: Optional[config_lib.AlgorithmConfig] = None,
    aggregator_params: Optional[config_lib.AggregatorParams] = None,
    method_params: Optional[config_lib.MethodParams] = None,
    num_clients: Optional[int] = None,
    metrics_aggregator=None,
    update_corruption: Optional[corruption_lib.UpdateCorruption] = None,
    held_out: Optional[Mapping[str, tuple[np.ndarray, np.ndarray]]] = None,
    cache_key: Optional[tuple] = None,
    client_execution: str = client_execution_lib.WORKER,
    client_sources=None,
    staged: bool = False,
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
      (`training.engine.client_execution`; FedAvg family only).
    client_sources: a `training.engine.worker_datasets.ClientSources` (FedAvg family, in the worker, without
      update corruption): the clients take a source each (file prefix, seeds) and build their datasets in their
      own computation; the method then needs `place_datasets_in_worker` before its first round.
    staged: for several TFF workers: an aggregator of several sequential stages (`registry.Aggregator.multi_stage`)
      runs its round one computation a stage (`tff_gma.learning.StagedLearningProcess`); others are unchanged.
  """
  registry.check(algorithm, aggregator, update_corruption.kind if update_corruption else corruption_lib.NONE,
        client_execution)
  # The optimizers are the FedAvg-family algorithm's own, FedAvg's for a composed algorithm: the name says which.
  optimizers_of = algorithm if registry.algorithm(algorithm).kind == registry.FEDAVG_FAMILY else 'fedavg'
  algorithm_config = dataclasses.replace(algorithm_config or config_lib.AlgorithmConfig(), name=optimizers_of)
  aggregator_params = aggregator_params or config_lib.AggregatorParams()
  method_params = method_params or config_lib.MethodParams()
  corrupted = update_corruption is not None
  staged = staged and registry.aggregator(aggregator).multi_stage
  if staged and corrupted:
    raise ValueError(f'workers: corruption={update_corruption.kind} is simulated on the whole round\'s updates at '
                     f'once, which a round in stages ({algorithm}/{aggregator} on several workers) does not run: use '
                     f'one worker')
  key = None if cache_key is None else (
      cache_key, algorithm, aggregator, algorithm_config, aggregator_params, method_params, num_clients,
      metrics_aggregator, corrupted, client_execution, None if client_sources is None else client_sources.key, staged)
  if key is not None and key in _PROCESS_CACHE:
    process = _PROCESS_CACHE[key]
  else:
    refusal = client_sources_refusal(algorithm, aggregator, corrupted, client_execution)
    if client_sources is not None and refusal is not None:
      raise ValueError(f'client_sources: {refusal}; got {algorithm}/{aggregator}')
    process = _build_process(model_fn, algorithm, aggregator, algorithm_config, aggregator_params, method_params,
                             num_clients, metrics_aggregator, corrupted, client_execution, client_sources, staged)
    if key is not None:
      _PROCESS_CACHE[key] = process
  if isinstance(process, client_execution_lib.LocalRound):
    return Method(process.process, local_round=process)
  if corrupted:
    harness = corruption_lib.CorruptedRounds(process, update_corruption.kind, update_corruption.corrupted,
                                              update_corruption.client_ids, update_corruption.seed,
                                              update_corruption.params)
    return Method(process, lambda *args: tuple(harness.run_round(*args)))
  if getattr(process, 'client_state_key', None) is not None:  # A `LearningProcessWithClientState`, staged or not.
    return Method(process, store=client_state.ClientStateStore.for_process(process), held_out=held_out)
  return Method(process, client_sources=client_sources)


def client_sources_refusal(algorithm: str, aggregator: str, corrupted: bool, client_execution: str) -> Optional[str]:
  """None when the method's clients can build their datasets from sources (`build(client_sources=...)`: the FedAvg
  family's own client work, in the worker, without update corruption), else why not (one line)."""
  if (registry.algorithm(algorithm).kind != registry.FEDAVG_FAMILY
      or registry.aggregator(aggregator).kind != registry.MODEL_AGGREGATOR):
    return 'only the FedAvg family\'s client work reads its examples from files'
  if client_execution != client_execution_lib.WORKER or corrupted:
    return 'this round trains its clients itself (local client execution or update corruption)'
  return None


def _build_process(model_fn, algorithm: str, aggregator: str, algorithm_config: config_lib.AlgorithmConfig,
                   aggregator_params: config_lib.AggregatorParams, method_params: config_lib.MethodParams,
                   num_clients: Optional[int], metrics_aggregator, corrupted: bool,
                   client_execution: str = client_execution_lib.WORKER, client_sources=None, staged: bool = False
                   ) -> tff.learning.templates.LearningProcess | client_execution_lib.LocalRound:
  aggregator_record, algorithm_record = registry.aggregator(aggregator), registry.algorithm(algorithm)
  if aggregator_record.kind == registry.PROCESS or algorithm_record.kind == registry.COMPOSED:
    return registry.build_process(model_fn, algorithm, aggregator, algorithm_config, aggregator_params,
                                  method_params, num_clients=num_clients, metrics_aggregator=metrics_aggregator,
                                  staged=staged)
  model_aggregator = registry.build(aggregator, aggregator_params)
  # GMA with FedAdam/FedYogi is the GMA paper's Algorithm 2: the adaptive moments see the unmasked mean and the mask
  # scales the step (the drop-in factory would mask before Adam, which largely undoes the mask). FedAvg/FedProx
  # keep the drop-in factory: with their SGD server both placements are the same.
  mask_on_step = (isinstance(model_aggregator, aggregators.GradientMaskedFactory)
                  and algorithm_config.name in config_lib.ADAPTIVE_ALGORITHMS and aggregator_record.mask_on_step)
  if client_execution == client_execution_lib.LOCAL:  # The same components; the clients train in this process.
    components = fedavg_family.build_components(model_fn, algorithm_config, model_aggregator, metrics_aggregator,
                                                mask_on_step=mask_on_step)
    return client_execution_lib.LocalRound(components, model_fn, algorithm_config, metrics_aggregator)
  if corrupted:
    return corruption_lib.build_learning_process(
        model_fn, algorithm_config, model_aggregator, metrics_aggregator, mask_on_step=mask_on_step)
  return fedavg_family.build_learning_process(
      model_fn, algorithm_config, model_aggregator, metrics_aggregator, mask_on_step=mask_on_step,
      client_sources=client_sources, staged=staged)
