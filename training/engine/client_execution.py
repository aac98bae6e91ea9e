"""Where a round's client training runs: in the TFF worker (`worker`, the default) or in this process (`local`).

TFF 0.87's worker has no GPU support, so `local` runs the FedAvg family's client work in this process's TensorFlow
(its GPUs, if any), then the rest of the round (aggregator, finalizer, metrics) in ONE computation in the worker
(`build_server_round`), with the worker mode's state and metrics. Refused (`check`): the composed methods, update
corruption, several workers. Detail and equivalence: docs/runtime.md#gpu-and-client-execution-modes"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.learning import in_graph
from training import config as config_lib
from training.engine import corruption as corruption_lib
from training.engine import fedavg_family

WORKER = 'worker'
LOCAL = 'local'
MODES = (WORKER, LOCAL)
# Where `worker` mode trains: the TFF worker's TensorFlow, which has no GPU device (TFF_NOTES, docs/runtime.md
# "GPU and client execution modes").
WORKER_DEVICES = ('TFF worker_binary CPU (TFF 0.87.0 wheel, built without GPU support)',)

_MAX_CPU_TRAINERS = 8
_warned_cpu = False
_warn_lock = threading.Lock()
_graph_build_lock = threading.Lock()


def check(client_execution: str, *, algorithm: str, aggregator: str, corruption: str = 'none',
          workers: Optional[str] = None, composed: bool = False) -> None:
  """Raises ValueError naming `client_execution` when the mode cannot run this method (see the module doc)."""
  if client_execution not in MODES:
    raise ValueError(f'client_execution must be one of {MODES}, got {client_execution!r}')
  if client_execution == WORKER:
    return
  if composed or algorithm not in config_lib.FEDAVG_FAMILY:
    raise ValueError(
        f'client_execution: local runs the client work of fedavg, fedprox, fedadam and fedyogi in this process; '
        f'{algorithm}/{aggregator} has its own client work (tff_gma.learning: extra client outputs for its own '
        f'server logic) that runs only in the TFF worker: use --client_execution=worker')
  if corruption in corruption_lib.UPDATE_CORRUPTIONS:
    raise ValueError(
        f'client_execution: corruption={corruption} corrupts updates inside the TFF client work '
        f'(training.engine.corruption), which local mode does not run: use --client_execution=worker (data corruptions '
        f'run in either mode)')
  if workers is not None:
    raise ValueError('client_execution: local trains the clients in this process, --workers splits them over TFF '
                     'workers: use one or the other')


def local_devices(devices: Optional[Sequence[str]] = None) -> list[str]:
  """The devices local client training uses: `devices`, else every GPU TensorFlow sees here, else its CPU.

  Without a GPU, warns once per process (one line) that local mode trains on the CPU.
  """
  global _warned_cpu
  if devices:
    return list(devices)
  gpus = [d.name for d in tf.config.list_logical_devices('GPU')]
  if gpus:
    return gpus
  # One trainer per core, each training its clients in turn and the trainers at the same time: the worker trains a
  # round's clients concurrently on its thread pool too, and one client's small ops do not keep two cores busy
  # (one trainer makes a small round slower than the worker's).
  cpu = [tf.config.list_logical_devices('CPU')[0].name] * max(1, min(_MAX_CPU_TRAINERS, len(os.sched_getaffinity(0))))
  with _warn_lock:
    if not _warned_cpu:
      _warned_cpu = True
      logging.warning('%s', device_line(cpu))
  return cpu


def device_line(devices: Sequence[str]) -> str:
  """What local mode says about where it trains (`local_devices` logs it once when there is no GPU)."""
  if any('GPU' in d for d in devices):
    return f'client_execution=local: client training on {len(devices)} device(s), round-robin: {", ".join(devices)}'
  return (f'client_execution=local: TensorFlow sees no GPU in this process; client training runs on the CPU '
          f'({", ".join(dict.fromkeys(devices))}; {len(devices)} client(s) at a time)')


def assign_devices(num_clients: int, devices: Sequence[str]) -> list[str]:
  """Client i trains on devices[i % len(devices)] (round-robin)."""
  if not devices:
    raise ValueError('devices must name at least one device')
  return [devices[i % len(devices)] for i in range(num_clients)]


def _assign_trainers(num_clients: int, num_trainers: int) -> list[int]:
  """Client i trains on trainer i % num_trainers (a device may have several trainers: the CPU one per core)."""
  return [i % num_trainers for i in range(num_clients)]


class _DeviceTrainer:
  """The family's client update (`fedavg_family.client_loop`'s loop) with its own model, its variables on `device`."""

  def __init__(self, device: str, model_fn, algorithm_config: config_lib.AlgorithmConfig):
    self.device = device
    self._proximal = algorithm_config.name == 'fedprox'
    self._optimizer = fedavg_family.client_optimizer(algorithm_config)
    loop = fedavg_family.client_loop(model_fn, algorithm_config)
    self.loop = loop.name
    if loop.name == 'in_graph':
      self._session_update = _SessionUpdate(device, model_fn, loop.functional_model, algorithm_config, self._optimizer)
      return
    models = []

    def capturing_model_fn():
      model = model_fn()
      models.append(model)
      return model

    with tf.device(device):
      self._update = fedavg_family.build_client_update(capturing_model_fn, algorithm_config, loop)
    (self._model,) = models

  def train(self, weights, dataset: tf.data.Dataset, hparams):
    """(ClientResult, unfinalized metrics) of one client, as NumPy, and the device its update was computed on."""
    # The client work's state is the client optimizer's hyperparameters, as in the worker (FedProx: none).
    hparams = None if self._proximal else hparams
    if self.loop == 'in_graph':
      return self._session_update(weights, dataset, hparams)
    with tf.device(self.device):
      # TFF's worker builds a fresh model per client; this one is reused, so its metrics start from zero here.
      self._model.reset_metrics()
      initial = tf.nest.map_structure(tf.convert_to_tensor, weights)
      hparams = None if hparams is None else tf.nest.map_structure(tf.convert_to_tensor, hparams)
      result, metrics = self._update(self._optimizer, hparams, initial, dataset)
    placed_on = tf.nest.flatten(result.update)[0].device
    to_numpy = lambda t: t.numpy()
    return (tff.learning.templates.ClientResult(
        update=tf.nest.map_structure(to_numpy, result.update), update_weight=result.update_weight.numpy()),
            tf.nest.map_structure(to_numpy, metrics), placed_on)


class _SessionUpdate:
  """The in-graph client update (`in_graph.build_examples_update`) in a TF1 graph and session of its own.

  Why a session: TFF 0.87's functional Keras model predicts only inside a graph (it raises under eager TF, and
  this process runs eagerly), as the worker runs it. So the update is built once into a graph on `device` whose
  inputs are placeholders (the model weights, the optimizer's hyperparameters, and the client's examples with
  their batch boundaries), and each client is one `Session.run`. The examples are read from the client's dataset
  here by the worker's own `in_graph.read_batches` (the same batches in the same order); the graph is
  built for the first dataset's element structure, and again for another one.
  """

  def __init__(self, device: str, model_fn, functional_model, algorithm_config: config_lib.AlgorithmConfig, optimizer):
    self._device = device
    self._model_fn = model_fn
    self._functional_model = functional_model
    self._optimizer = optimizer
    self._proximal_strength = fedavg_family.proximal_strength(algorithm_config)
    self._graphs: dict[str, tuple] = {}  # Structure key -> (session, placeholders, outputs).
    self._read_batches = tf.function(in_graph.read_batches)  # Its TensorArrays need a graph: traced once per spec.

  def _build(self, weights, element_spec, hparams):
    graph = tf.Graph()
    with graph.as_default(), tf.device(self._device):
      update = in_graph.build_examples_update(self._model_fn, self._functional_model,
                                              weighting=fedavg_family.CLIENT_WEIGHTING,
                                              proximal_strength=self._proximal_strength)
      placeholder = lambda a: tf.compat.v1.placeholder(tf.as_dtype(np.asarray(a).dtype), np.shape(a))
      weights_in = tf.nest.map_structure(placeholder, weights)
      hparams_in = None if hparams is None else tf.nest.map_structure(placeholder, hparams)
      examples_in = tf.nest.map_structure(
          lambda s: tf.compat.v1.placeholder(s.dtype, tf.TensorShape([None]).concatenate(s.shape[1:])), element_spec)
      offsets_in = tf.compat.v1.placeholder(tf.int32, [None])
      outputs = update(self._optimizer, weights_in, examples_in, offsets_in, hparams_in)
      initialize = tf.compat.v1.global_variables_initializer()  # The metrics' variables.
    session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(allow_soft_placement=True))
    session.run(initialize)
    # The device the graph asked for (a session does not say where the placer put an op; soft placement may move
    # an op without a kernel there to the CPU).
    placed_on = tf.nest.flatten(outputs[0].update)[0].device or self._device
    return session, (weights_in, hparams_in, examples_in, offsets_in), outputs, placed_on

  def __call__(self, weights, dataset: tf.data.Dataset, hparams):
    key = repr((tf.nest.map_structure(np.shape, weights), dataset.element_spec, hparams is None))
    if key not in self._graphs:
      # One build at a time in this process: making Keras objects inside a TF1 graph swaps Keras's layer classes to
      # their TF1 bases (process-wide), which trainers building side by side in threads would race on.
      with _graph_build_lock:
        self._graphs[key] = self._build(weights, dataset.element_spec, hparams)
    session, inputs, outputs, placed_on = self._graphs[key]
    with tf.device(self._device):
      examples, offsets = self._read_batches(dataset)
    values = (weights, hparams, tf.nest.map_structure(lambda t: t.numpy(), examples), offsets.numpy())
    feed = {p: v for p, v in zip(tf.nest.flatten(inputs), tf.nest.flatten(values)) if p is not None}
    result, metrics = tf.nest.pack_sequence_as(outputs, session.run(tf.nest.flatten(outputs), feed_dict=feed))
    return (tff.learning.templates.ClientResult(update=result.update, update_weight=result.update_weight),
            metrics, placed_on)


class LocalClientTrainer:
  """The FedAvg family's client work (`fedavg_family.build_client_work`'s math) run in this process."""

  def __init__(self, model_fn: Callable[[], tff.learning.models.VariableModel],
               algorithm_config: config_lib.AlgorithmConfig, devices: Optional[Sequence[str]] = None):
    if algorithm_config.name not in config_lib.FEDAVG_FAMILY:
      raise ValueError(f'algorithm_config.name must be one of {config_lib.FEDAVG_FAMILY}, got '
                       f'{algorithm_config.name!r}')
    self.devices = local_devices(devices)
    # One trainer per entry, each with its own variables.
    self._trainers = [_DeviceTrainer(d, model_fn, algorithm_config) for d in self.devices]
    self.devices_used: set[str] = set()  # Devices the updates were computed on (TensorFlow's full names).

  def train(self, weights, datasets: Sequence[tf.data.Dataset], hparams) -> tuple[list, list]:
    """The clients' `ClientResult`s and unfinalized metrics, in the order of `datasets`."""
    assigned = _assign_trainers(len(datasets), len(self._trainers))
    outputs: list[Any] = [None] * len(datasets)

    def run_trainer(k: int) -> None:
      for i, ds in enumerate(datasets):
        if assigned[i] == k:
          outputs[i] = self._trainers[k].train(weights, ds, hparams)

    used = list(dict.fromkeys(assigned))
    if len(used) <= 1:
      for k in used:
        run_trainer(k)
    else:  # One thread per trainer: each trains its clients in turn, the trainers at the same time.
      with concurrent.futures.ThreadPoolExecutor(len(used)) as pool:
        for future in [pool.submit(run_trainer, k) for k in used]:
          future.result()
    self.devices_used.update(placed for _, _, placed in outputs)
    return [r for r, _, _ in outputs], [m for _, m, _ in outputs]


def _unfinalized_metrics_type(model_fn):
  with tf.Graph().as_default():
    model = model_fn()
    finalizers = model.metric_finalizers()
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                  model.report_local_unfinalized_metrics())
  return finalizers, tff.types.tensorflow_to_type(specs)


def build_server_round(components: fedavg_family.Components, process: tff.learning.templates.LearningProcess,
                       model_fn, metrics_aggregator=None) -> tff.Computation:
  """`(state@SERVER, ClientResult@CLIENTS, unfinalized metrics@CLIENTS) -> LearningProcessOutput`.

  `process` (= `components.compose()`) with its client work's `next` replaced by the clients' results: the
  distributor, the aggregator and the finalizer as `compose_learning_process` composes them, and the client
  work's measurements `OrderedDict(train=<metrics aggregator over the clients' unfinalized metrics>)` as TFF's
  model-delta client works build them. Raises ValueError if the result type differs from `process.next`'s.
  """
  state_type = process.next.type_signature.parameter[0]
  result_type = components.client_work.next.type_signature.result.result
  finalizers, metrics_type = _unfinalized_metrics_type(model_fn)
  metrics_fn = (metrics_aggregator or tff.learning.metrics.sum_then_finalize)(finalizers)

  @tff.federated_computation(state_type, result_type, tff.FederatedType(metrics_type, tff.CLIENTS))
  def server_round(state, client_result, client_metrics):
    distributor_output = components.distributor.next(state.distributor, state.global_model_weights)
    client_work_measurements = tff.federated_zip(collections.OrderedDict(train=metrics_fn(client_metrics)))
    aggregator_output = components.aggregator.next(state.aggregator, client_result.update,
                                                   client_result.update_weight)
    finalizer_output = components.finalizer.next(state.finalizer, state.global_model_weights,
                                                 aggregator_output.result)
    new_state = tff.federated_zip(tff.learning.templates.LearningAlgorithmState(
        finalizer_output.result, distributor_output.state, state.client_work, aggregator_output.state,
        finalizer_output.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        distributor=distributor_output.measurements, client_work=client_work_measurements,
        aggregator=aggregator_output.measurements, finalizer=finalizer_output.measurements))
    return tff.learning.templates.LearningProcessOutput(new_state, metrics)

  want = process.next.type_signature.result
  got = server_round.type_signature.result
  if not got.is_equivalent_to(want):
    raise ValueError(f'the local round computes {got}, not the worker-mode round\'s {want}')
  return server_round


class LocalRound:
  """One round of `components.compose()` with the client work run in this process (`run_round`)."""

  def __init__(self, components: fedavg_family.Components, model_fn, algorithm_config: config_lib.AlgorithmConfig,
               metrics_aggregator=None, devices: Optional[Sequence[str]] = None,
               process: Optional[tff.learning.templates.LearningProcess] = None):
    self.process = process or components.compose()
    self.server_round = build_server_round(components, self.process, model_fn, metrics_aggregator)
    self.trainer = LocalClientTrainer(model_fn, algorithm_config, devices)

  @property
  def devices(self) -> list[str]:
    return self.trainer.devices

  def client_devices(self) -> list[str]:
    """The TensorFlow devices the clients' updates were computed on so far (the configured ones before)."""
    return sorted(self.trainer.devices_used) or list(self.trainer.devices)

  def run_round(self, state, client_ids: Sequence[str], datasets: Sequence[tf.data.Dataset], round_num: int):
    """(state, metrics) of the round: the process's `next(state, datasets)`, client work run here."""
    del client_ids, round_num  # Everything the round needs is in the datasets, as in `process.next`.
    results, metrics = self.trainer.train(state.global_model_weights, datasets, state.client_work)
    output = self.server_round(state, results, metrics)
    return output.state, output.metrics
