"""A training method = a learning algorithm with an aggregator, and how one of its rounds is run.

Three kinds of processes hide behind one interface (`Method.run_round`), so the demo and the runner treat them
alike:
* TFF's own FedAvg/FedProx/FedAdam/FedYogi with any aggregator of `training.registry` as `model_aggregator`;
* the composed processes of `tff_gma.learning`: Elastic FedAvg (`--aggregator=elastic`, with the FedAvg/FedAdam/
  FedYogi server optimizers), FedGMA (`--algorithm=fedgma`, any registry aggregator averages the models);
* SCAFFOLD (`--algorithm=scaffold`, any registry aggregator), whose clients keep control variates across rounds:
  they live in a `ControlVariateStore` that `save`/`load` keep beside the runner's checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import learning
from tff_gma import simulation
from training import registry

COMPOSED_ALGORITHMS = ('fedgma', 'scaffold')
ALGORITHMS = simulation.ALGORITHMS + COMPOSED_ALGORITHMS
# Aggregators that are learning processes of their own rather than a `model_aggregator`.
PROCESS_AGGREGATORS = ('elastic',)
AGGREGATORS = registry.NAMES + PROCESS_AGGREGATORS
AGGREGATOR_DESCRIPTIONS = {
    **registry.DESCRIPTIONS,
    'elastic': 'elastic aggregation: update scaled by parameter sensitivity (tau)',
}


@dataclasses.dataclass(frozen=True)
class MethodParams:
  """Hyperparameters of the composed methods (paper defaults)."""
  elastic_tau: float = 0.5  # Elastic aggregation tau.
  elastic_mu: float = 0.95  # Elastic sensitivity momentum.
  sensitivity_fraction: float = 0.1  # Elastic: fraction of a client's batches used for the sensitivity.
  fedgma_step_size: float = 0.1  # FedGMA extra server step eta_s.
  fedgma_threshold: float = 0.8  # FedGMA AND-mask p.


def check(algorithm: str, aggregator: str) -> None:
  """Raises ValueError naming the flag when the combination does not exist."""
  if algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm: unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}')
  if aggregator not in AGGREGATORS:
    raise ValueError(f'aggregator: unknown aggregator {aggregator!r}; expected one of {AGGREGATORS}')
  if aggregator == 'elastic' and algorithm not in ('fedavg', 'fedadam', 'fedyogi'):
    raise ValueError(f'aggregator: elastic runs with algorithm fedavg, fedadam or fedyogi, not {algorithm!r}')


@dataclasses.dataclass
class Method:
  process: tff.learning.templates.LearningProcess
  control_variates: Optional[learning.ControlVariateStore] = None
  _STORE_FILE = 'scaffold_control_variates_{}.npz'

  def run_round(self, state, client_ids: Sequence[str], datasets: Sequence[tf.data.Dataset]):
    """One round on the given clients; returns (state, metrics)."""
    if self.control_variates is not None:
      return self.control_variates.run_round(self.process, state, client_ids, datasets)
    output = self.process.next(state, list(datasets))
    return output.state, output.metrics

  def save_client_state(self, directory: str, round_num: int) -> None:
    """Saves what clients keep between rounds (SCAFFOLD's c_i), versioned like the checkpoints."""
    if self.control_variates is not None:
      os.makedirs(directory, exist_ok=True)
      self.control_variates.save(os.path.join(directory, self._STORE_FILE.format(round_num)))
      stale = os.path.join(directory, self._STORE_FILE.format(round_num - 3))
      if os.path.exists(stale):
        os.remove(stale)

  def load_client_state(self, directory: str, round_num: int) -> None:
    if self.control_variates is not None and round_num > 0:
      path = os.path.join(directory, self._STORE_FILE.format(round_num))
      if not os.path.exists(path):
        raise FileNotFoundError(f'checkpoint of round {round_num} has no SCAFFOLD client state at {path}')
      self.control_variates = learning.ControlVariateStore.load(path, like=self.control_variates)


def build(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm: simulation.AlgorithmConfig | str,
    aggregator: str,
    *,
    algorithm_config: Optional[simulation.AlgorithmConfig] = None,
    aggregator_params: Optional[registry.AggregatorParams] = None,
    method_params: Optional[MethodParams] = None,
    num_clients: Optional[int] = None,
    metrics_aggregator=None,
) -> Method:
  """The method `algorithm` x `aggregator` (names as the runner's flags).

  `algorithm_config` carries the learning rates and optimizer settings (its own `name` is ignored for the
  composed algorithms, which take the FedAvg optimizers).
  """
  name = algorithm if isinstance(algorithm, str) else algorithm.name
  check(name, aggregator)
  config = algorithm_config or (algorithm if not isinstance(algorithm, str) else simulation.AlgorithmConfig())
  if name in COMPOSED_ALGORITHMS:
    config = dataclasses.replace(config, name='fedavg')
  else:
    config = dataclasses.replace(config, name=name)
  params = aggregator_params or registry.AggregatorParams()
  extra = method_params or MethodParams()
  if aggregator == 'elastic':
    return Method(learning.build_elastic_fed_avg(
        model_fn, simulation.client_optimizer(config), simulation.server_optimizer(config),
        tau=extra.elastic_tau, mu=extra.elastic_mu, sensitivity_fraction=extra.sensitivity_fraction,
        secure=params.secure, value_bound=params.secure_bound, metrics_aggregator=metrics_aggregator))
  model_aggregator = registry.build(aggregator, params)
  if name == 'fedgma':
    return Method(learning.build_fedgma(
        model_fn, simulation.client_optimizer(config), simulation.server_optimizer(config),
        server_step_size=extra.fedgma_step_size, mask_threshold=extra.fedgma_threshold,
        model_aggregator=model_aggregator, metrics_aggregator=metrics_aggregator))
  if name == 'scaffold':
    process = learning.build_scaffold(
        model_fn, config.client_lr, config.server_lr, model_aggregator, num_clients=num_clients,
        metrics_aggregator=metrics_aggregator)
    return Method(process, learning.ControlVariateStore.for_process(process))
  return Method(simulation.build_learning_process(model_fn, config, model_aggregator, metrics_aggregator))
