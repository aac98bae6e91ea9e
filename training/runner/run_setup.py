"""What a run trains with: its data, model, method and evaluator (`Setup`), and the TFF context that runs it.

`build_checked_setup` builds them (the data partitioned; poisoned or held out where the settings say) and refuses
with `errors.ConfigError` what only the data can tell; `install_context` readies the context the method runs in
(the runner's own TFF worker, or `--workers`). Both run before the run writes anything but its lock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma import runtime
from tff_gma.runtime import contexts as runtime_contexts
from tff_gma.data import idx
from tff_gma.data import loaders
from training import config as config_lib
from training.engine import corruption as corruption_lib
from training.engine import evaluation
from training.engine import fedavg_family
from training.engine import methods
from training.engine import registry
from training.engine import worker_datasets
from training.runner import round_loop
from training.runner.errors import ConfigError

PERSONAL_TEST_FRACTION = 0.2  # Personalized RFA: share of each client's examples held out to evaluate it.


@dataclasses.dataclass
class Setup:
  """A run's data, model and method."""
  data: loaders.FederatedDataset
  build_keras: Callable[[], tf.keras.Model]
  model_fn: Callable[[], tff.learning.models.VariableModel]
  method: methods.Method
  evaluator: evaluation.CentralEvaluator  # On the test split; on the validation split when there is one.
  corrupted: tuple[str, ...] = ()
  validation: Optional[tuple[np.ndarray, np.ndarray]] = None  # The pooled held-out (x, y) of validation runs.
  participation_eval: bool = True  # Evaluate on the round's participants' vs the other clients' data too.

  @property
  def process(self) -> tff.learning.templates.LearningProcess:
    return self.method.process

  @property
  def accuracy_key(self) -> str:
    """The metrics.csv column of the evaluated rounds' accuracy: on the validation split where there is one."""
    return 'validation/accuracy' if self.validation is not None else 'test/accuracy'


def load_data(config: config_lib.ExperimentConfig) -> loaders.FederatedDataset:
  """The run's partitioned data as `config` says, before validation, corruption or personal hold-out: how the runner
  loads a run's data, for studies that look at a run's data again (the membership attack)."""
  return loaders.load_federated_data(
      config.dataset, config.partition, config.num_clients, config.seed, data_dir=config.data_dir,
      fashion_mnist_source=config.fashion_mnist_source, train_subset_fraction=config.train_subset_fraction,
      **config.partition_kwargs())


def build_setup(config: config_lib.ExperimentConfig) -> Setup:
  """The data (partitioned; poisoned or held out where the settings say), the model and the method."""
  data = load_data(config)
  validation = None
  if config.validation_fraction > 0:
    data, validation = _split_validation(data, config.validation_fraction, config.seed)
  corrupted = ()
  if config.corruption != corruption_lib.NONE:
    corrupted = tuple(corruption_lib.corrupted_clients(data.train.client_ids, config.corrupt_fraction, config.seed))
    data = dataclasses.replace(data, train=corruption_lib.poison_data(
        data.train, corrupted, config.corruption, data.num_classes))
  held_out = None
  if registry.algorithm(config.algorithm).personal_evaluation:
    train, held_out = evaluation.hold_out(data.train, PERSONAL_TEST_FRACTION, config.seed)
    data = dataclasses.replace(data, train=train)
  build_keras = models.keras_builder(config.model, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec, pad_id=data.pad_id)
  update_corruption = None
  if config.corruption in corruption_lib.UPDATE_CORRUPTIONS:
    update_corruption = corruption_lib.UpdateCorruption(config.corruption, corrupted, tuple(data.train.client_ids),
                                                        config.seed, config.attack_params())
  method = methods.build(
      model_fn, config.algorithm, config.aggregator, algorithm_config=config.algorithm_config(),
      aggregator_params=config.aggregator_params(), method_params=config.method_params(),
      num_clients=config.num_clients,
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize if config.secure_metrics else None,
      update_corruption=update_corruption, held_out=held_out,
      cache_key=(config.dataset, config.model, data.input_shape, data.num_classes, data.pad_id),
      client_execution=config.client_execution, client_sources=_client_sources(config, data.train),
      staged=config.workers is not None)
  eval_x, eval_y = validation if validation is not None else (data.test_x, data.test_y)
  evaluator = evaluation.CentralEvaluator(build_keras, eval_x, eval_y, pad_id=data.pad_id)
  return Setup(data, build_keras, model_fn, method, evaluator, corrupted, validation, config.participation_eval)


def _split_validation(data: loaders.FederatedDataset, fraction: float, seed: int
                      ) -> tuple[loaders.FederatedDataset, tuple[np.ndarray, np.ndarray]]:
  """Each client's held-out share, pooled in client order, and the data without it and without any test data
  (test split and OOD clients emptied, so nothing downstream can evaluate on them)."""
  train, held_out = evaluation.hold_out(data.train, fraction, seed)
  held = [held_out[c] for c in data.train.client_ids if c in held_out]
  if not held:
    raise ConfigError(f'validation_fraction={fraction} holds out no example: every client has fewer than '
                      f'{math.ceil(1 / fraction)} examples')
  pooled = (np.concatenate([x for x, _ in held]), np.concatenate([y for _, y in held]))
  data = dataclasses.replace(data, train=train, test_x=data.test_x[:0], test_y=data.test_y[:0], ood_test=None)
  return data, pooled

def build_checked_setup(config: config_lib.ExperimentConfig) -> Setup:
  """`build_setup`, its refusals of what only the data can tell (more clients than examples, k above the
  classes...) raised as `ConfigError`; a damaged data file stays an `idx.IdxError` (the runner says `error:`)."""
  try:
    return build_setup(config)
  except ConfigError:
    raise
  except ValueError as e:
    if isinstance(e, idx.IdxError):  # The data's files, not a setting.
      raise
    raise ConfigError(str(e)) from None


def install_context(config: config_lib.ExperimentConfig, process: tff.learning.templates.LearningProcess
                    ) -> Callable[[], list[str]]:
  """Readies the TFF context that runs `process`: `--workers`, else the runner's own worker with the run's intra-op
  threads (a running worker with another count is replaced; a context the caller installed instead, e.g. several
  workers, is left alone). Raises `ConfigError` in one line when it cannot, nothing written yet. Returns what gives
  the gRPC targets of the context's workers (none for a context the caller installed)."""
  targets = lambda: []
  if config.workers is not None:
    try:
      runtime.check_single_aggregation_stage(process)
    except ConfigError:
      raise
    except ValueError as e:
      raise ConfigError(f'workers: {e}') from None
    try:
      listed = [t for t in config.workers.split(',') if t]
      runtime.set_multi_worker_context(listed)
      targets = lambda: listed
    except (RuntimeError, ValueError) as e:  # No worker answers at an address: a flag error, nothing written.
      raise ConfigError(f'workers: {e}') from None
  elif runtime_contexts.simulation_context_applies():
    try:
      worker = runtime.set_simulation_context(intra_op_threads=config.worker_intra_op_threads)
      targets = lambda: [worker.target]  # Read when asked: a worker that died is restarted at another address.
    except (RuntimeError, ValueError) as e:  # The worker did not start again: one line, nothing written yet.
      raise ConfigError(f'worker_intra_op_threads: the TFF worker did not start with '
                        f'{config.worker_intra_op_threads} thread(s): {" ".join(str(e).split())}') from None
  runtime.check_context_runs(process)  # A context the caller installed that cannot run it: one line.
  return targets


def client_loop_used(config: config_lib.ExperimentConfig, model_fn) -> Optional[str]:
  """The loop the run's clients walk their batches with (`--client_loop`, or `iterator` where `in_graph` does not
  apply); None for the composed algorithms, which walk them with their own loop."""
  if registry.algorithm(config.algorithm).kind != registry.FEDAVG_FAMILY:
    return None
  return fedavg_family.client_loop(model_fn, config.algorithm_config()).name


def _client_sources(config: config_lib.ExperimentConfig, train) -> Optional[worker_datasets.ClientSources]:
  """What the clients build their datasets from when `dataset_placement=worker` applies (else None, with a log
  line saying why)."""
  if config.dataset_placement != worker_datasets.WORKER:
    return None
  reason = worker_datasets.applies(algorithm=config.algorithm, aggregator=config.aggregator,
                                   corruption=config.corruption, client_execution=config.client_execution,
                                   workers=config.workers, train=train)
  if reason is not None:
    logging.info('dataset_placement=worker does not apply (%s): each round sends its datasets', reason)
    return None
  try:
    worker_datasets.check_memory(train, config.clients_per_round)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return worker_datasets.ClientSources(train.element_type_structure, config.local_epochs, config.batch_size)


def place_datasets(method: methods.Method, inputs: round_loop.ClientInputs
                   ) -> Optional[worker_datasets.WorkerDatasets]:
  """The run's files for a method whose clients build their datasets from them (None for the others)."""
  if method.client_sources is None:
    return None
  placement = worker_datasets.WorkerDatasets(inputs)
  method.place_datasets_in_worker(placement)
  return placement
