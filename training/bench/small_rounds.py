"""Small rounds against the speed of their math: two sections of `python -m training.bench`.

`breakdown`: where a small FedAvg/mean round's time goes, one TFF invocation at a time; `peers`: the round against
the same round as plain TensorFlow in this process (`PlainTFRound`) and against its in-graph floor.
What each measures: docs/research/benchmark.md#sections-keys-and-method
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.data import client_data as client_data_lib
from tff_gma.learning import in_graph
from training.bench import floor as floor_lib
from training.bench import presets
from training.bench import timing
from training.engine import client_pipeline
from training.engine import fedavg_family
from training.engine import methods
from training.engine import worker_datasets
from training.runner import round_loop

NUM_CLASSES = 10
CSV_ROW_KEYS = 40  # About the keys of a runner's metrics.csv row (round metrics, evaluation, timings).
# Derived parts of a round: (part, probe, probe it contains) -> median of the first minus median of the second.
PARTS = (('aggregation', 'client_work_and_aggregation', 'client_work'),
         ('finalizer_state_metrics', 'next', 'client_work_and_aggregation'),
         ('client_training', 'client_work', 'client_data'),
         ('python_round_overhead', 'round_step', 'next'))
PEER_ENTRIES = ('plain_tf', 'project', 'floor')
# The limits: (model, clients, examples per client) -> (the entry the project's round is divided by, limit).
TARGETS = {('lenet', 10, 120): ('plain_tf', 1.15), ('lenet', 10, 600): ('plain_tf', 1.05),
           ('cnn', 10, 144): ('floor', 1.5)}


def case_name(model: str, clients: int, examples: int) -> str:
  return f'{model} {clients}x{examples}'


# ----------------------------------------------------------------------------------------------------------------
# The project's round on generated examples.


@dataclasses.dataclass
class GeneratedRound:
  """The runner's default FedAvg/mean round on generated examples (`build_generated_round`); `close` removes the
  worker's files."""
  model: str
  client_arrays: collections.OrderedDict  # client id -> (x, y)
  build_keras: Callable[[], tf.keras.Model]
  model_fn: Callable[[], tff.learning.models.VariableModel]
  input_spec: Any
  inputs: round_loop.ClientInputs
  placement: worker_datasets.WorkerDatasets
  method: methods.Method
  loop: round_loop.RoundLoop

  @property
  def client_ids(self) -> list[str]:
    return list(self.client_arrays)

  def initial_weights(self) -> list[np.ndarray]:
    return list(self.method.process.get_model_weights(self.loop.state).trainable)

  def close(self) -> None:
    self.placement.close()


def build_generated_round(model: str, clients: int, examples: int, *, batch_size: int, seed: int) -> GeneratedRound:
  """`clients` clients of `examples` uniform examples of the model's shape (`presets.FLOOR_SHAPES`), labels in
  0..9, drawn as the floor section draws them; the method and round loop as its `project_worker_datasets` entry
  builds them (one local epoch, `presets.ALGORITHM_CONFIG`), from the model `seeded_initial_state` draws."""
  shape, rng = presets.FLOOR_SHAPES[model], np.random.default_rng(seed)
  arrays = collections.OrderedDict(
      (f'client_{i}', (rng.random((examples, *shape), dtype=np.float32),
                       rng.integers(0, NUM_CLASSES, examples).astype(np.int32)))
      for i in range(clients))
  train = client_data_lib.from_client_arrays(arrays)
  element = train.create_tf_dataset_for_client(train.client_ids[0]).element_spec
  input_spec = collections.OrderedDict((k, tf.TensorSpec([None, *s.shape], s.dtype)) for k, s in element.items())
  build_keras = models.keras_builder(model, shape, NUM_CLASSES)
  model_fn = models.model_fn(build_keras, input_spec)
  tf.keras.utils.set_random_seed(seed)
  inputs = round_loop.ClientInputs(train, clients, 1, batch_size, seed)
  placement = worker_datasets.WorkerDatasets(inputs)
  method = methods.build(model_fn, 'fedavg', presets.BASELINE, algorithm_config=presets.ALGORITHM_CONFIG,
                         client_sources=placement.client_sources)
  method.place_datasets_in_worker(placement)
  state = round_loop.seeded_initial_state(method.process, build_keras, seed)
  return GeneratedRound(model, arrays, build_keras, model_fn, input_spec, inputs, placement, method,
                        round_loop.RoundLoop(method, state, inputs))


# ----------------------------------------------------------------------------------------------------------------
# The plain TensorFlow peer.


class PlainTFRound:
  """FedAvg's round written as a plain TensorFlow program in this process: the peer the project's round is held to.

  An eager Python driver calls, for each client in turn, one `tf.function` (traced once, when built, for every client:
  the examples' count is a dimension of its signature) that runs the client's local epoch as a loop over its batches:
  the Keras model's own `tf.Variable`s set to the server model, momentum in `tf.Variable`s set to zero, then per batch
  the loss's gradient and SGD with momentum as TFF's `build_sgdm` steps (v = momentum * v + g; w = w - lr * v). Then a
  second `tf.function` (traced once) applies the example-weighted mean of the clients' updates with the server's SGD, as
  TFF's mean and finalizer do. The examples are tensors held in this process; each round a client takes them in the
  order the project's round does (the permutation `client_pipeline.round_pipeline` draws with the round's seed pair,
  `round_seeds(round_num)`, one per client), so both take the same batches.
  """

  def __init__(self, build_keras: Callable[[], tf.keras.Model], client_arrays: Sequence[tuple[np.ndarray, np.ndarray]],
               round_seeds: Callable[[int], Sequence[tuple[int, int]]], *, batch_size: int, client_lr: float,
               momentum: float, server_lr: float, initial_weights: Sequence[np.ndarray]):
    self._model = build_keras()
    self._velocity = [tf.Variable(tf.zeros_like(w)) for w in self._model.trainable_variables]
    self._loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    self._batch_size, self._client_lr, self._momentum, self._server_lr = batch_size, client_lr, momentum, server_lr
    self._clients = [(tf.constant(x), tf.constant(y)) for x, y in client_arrays]
    self._counts = [tf.constant(float(len(y))) for _, y in client_arrays]
    self._round_seeds = round_seeds
    x, y = client_arrays[0]
    weight_specs = [tf.TensorSpec(np.shape(w), tf.float32) for w in initial_weights]
    # Traced now, right after the model is built: a Keras model built later inside a TF1 graph (the floor's, TFF's
    # computations) switches Keras' classes to their v1 versions, and this model could not be traced after it.
    self._client_epoch = tf.function(self._epoch, input_signature=[
        weight_specs, tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None], y.dtype),
        tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64)]).get_concrete_function()
    self._server_update = tf.function(self._mean_update)
    self.weights = [tf.constant(w) for w in initial_weights]
    self.round_num = 0

  def _epoch(self, server_weights, x, y, seed, seed2):
    variables = self._model.trainable_variables
    for variable, weight in zip(variables, server_weights):
      variable.assign(weight)
    for velocity in self._velocity:
      velocity.assign(tf.zeros_like(velocity))
    size = tf.shape(y, out_type=tf.int64)[0]
    order = client_pipeline.round_pipeline(tf.data.Dataset.range(size), seed, seed2, local_epochs=1,
                                      batch_size=size).get_single_element()
    x, y = tf.gather(x, order), tf.gather(y, order)
    for begin in tf.range(0, size, self._batch_size):
      end = tf.minimum(begin + self._batch_size, size)
      with tf.GradientTape() as tape:
        loss = self._loss(y[begin:end], self._model(x[begin:end], training=True))
      for variable, velocity, gradient in zip(variables, self._velocity, tape.gradient(loss, variables)):
        velocity.assign(self._momentum * velocity + gradient)
        variable.assign_sub(self._client_lr * velocity)
    return [variable.read_value() for variable in variables]

  def _mean_update(self, server_weights, client_weights, counts):
    total = tf.add_n(counts)
    return [w - self._server_lr * tf.add_n([c * (w - trained[k]) for c, trained in zip(counts, client_weights)])
            / total for k, w in enumerate(server_weights)]

  def round(self, weights: Sequence[tf.Tensor], round_num: int) -> list[tf.Tensor]:
    """The server model after round `round_num` from `weights`."""
    trained = [self._client_epoch(list(weights), x, y, tf.constant(seed, tf.int64), tf.constant(seed2, tf.int64))
               for (x, y), (seed, seed2) in zip(self._clients, self._round_seeds(round_num))]
    return self._server_update(list(weights), trained, self._counts)

  def step(self) -> list[tf.Tensor]:
    """The next round from the current model (as `RoundLoop.step`)."""
    self.round_num += 1
    self.weights = self.round(self.weights, self.round_num)
    return self.weights


def build_plain_tf_round(setup: GeneratedRound, batch_size: int) -> PlainTFRound:
  """The peer of `setup`'s round: its clients' examples and seeds, its initial model, the project's settings."""
  config, ids = presets.ALGORITHM_CONFIG, setup.client_ids
  return PlainTFRound(setup.build_keras, list(setup.client_arrays.values()),
                      lambda round_num: setup.inputs.seeds(ids, round_num), batch_size=batch_size,
                      client_lr=config.client_lr, momentum=config.client_momentum, server_lr=config.server_lr,
                      initial_weights=setup.initial_weights())


# ----------------------------------------------------------------------------------------------------------------
# Section: breakdown.


def _sum_of(structure) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(structure)])


def _over_clients(sources_type, client_fn: Callable[[Any], tf.Tensor]) -> tff.Computation:
  """`sources@CLIENTS -> sum of client_fn(sources)@SERVER`: one client computation per client."""
  client = tff.tensorflow.computation(client_fn, sources_type)

  @tff.federated_computation(tff.FederatedType(sources_type, tff.CLIENTS))
  def over_clients(sources):
    return tff.federated_sum(tff.federated_map(client, sources))

  return over_clients


def _client_probes(setup: GeneratedRound) -> dict[str, tff.Computation]:
  """The clients' computations alone, on their sources: nothing, their data, their data as `batches` reads it."""
  client_sources = setup.placement.client_sources
  probes = {
      'dispatch': _over_clients(client_sources.source_type, lambda sources: tf.constant(1.0)),
      'client_data': _over_clients(client_sources.source_type, lambda sources: _sum_of(
          in_graph.read_batches(client_sources.dataset(sources)))),
  }
  if hasattr(client_sources, 'batches'):  # The faster read, where ClientSources has it.
    probes['client_data_batches'] = _over_clients(client_sources.source_type,
                                                  lambda sources: _sum_of(client_sources.batches(sources)))
  return probes


def _client_work_probes(setup: GeneratedRound) -> dict[str, tff.Computation]:
  """`(weights@SERVER, sources@CLIENTS)`: broadcast and the client work (`fedavg_family.build_components`'), returning
  the summed update weight; and the same with the aggregator's `next` on the updates (and a scalar of its result)."""
  components = fedavg_family.build_components(setup.model_fn, presets.ALGORITHM_CONFIG,
                                              client_sources=setup.placement.client_sources)
  work, aggregator = components.client_work, components.aggregator
  weights_type = tff.FederatedType(components.weights_type, tff.SERVER)
  data_type = work.next.type_signature.parameter[2]
  aggregate_sum = tff.tensorflow.computation(_sum_of, aggregator.next.type_signature.result.result.member)

  @tff.federated_computation(weights_type, data_type)
  def client_work(weights, data):
    output = work.next(work.initialize(), tff.federated_broadcast(weights), data)
    return tff.federated_sum(output.result.update_weight)

  @tff.federated_computation(weights_type, data_type)
  def client_work_and_aggregation(weights, data):
    output = work.next(work.initialize(), tff.federated_broadcast(weights), data)
    aggregate = aggregator.next(aggregator.initialize(), output.result.update, output.result.update_weight)
    return tff.federated_sum(output.result.update_weight), tff.federated_map(aggregate_sum, aggregate.result)

  return {'client_work': client_work, 'client_work_and_aggregation': client_work_and_aggregation}


def _program_calls(state, row: dict[str, float], directory: str) -> dict[str, Callable[[], Any]]:
  """The runner's per-round writes into `directory`: a checkpoint of `state`, a `row` released to a CSV file."""
  manager = tff.program.FileProgramStateManager(os.path.join(directory, 'checkpoints'),
                                                keep_total=methods.KEEP_CHECKPOINTS)
  release = tff.program.CSVFileReleaseManager(os.path.join(directory, 'metrics.csv'), key_fieldname='round')
  versions, keys = itertools.count(1), itertools.count(1)
  return {'checkpoint_save': lambda: asyncio.run(manager.save(state, next(versions))),
          'csv_release': lambda: asyncio.run(release.release(row, next(keys)))}


def _breakdown_calls(setup: GeneratedRound) -> dict[str, Callable[[], Any]]:
  """The probes of the breakdown that run TFF computations (module docstring) as no-argument calls, on round 1's
  sources, and the Python-side dataset building."""
  process, loop = setup.method.process, setup.loop
  sources = setup.placement.sources(setup.client_ids, 1)
  state_type = process.next.type_signature.parameter[0]

  @tff.federated_computation(state_type)
  def state_in_out(state):
    return state

  calls = {
      'round_step': loop.step,
      'next': lambda: process.next(loop.state, sources),
      'state_in_out': lambda: state_in_out(loop.state),
      'get_model_weights': lambda: process.get_model_weights(loop.state),
  }
  calls.update({name: (lambda p=probe: p(sources)) for name, probe in _client_probes(setup).items()})
  weights = process.get_model_weights(loop.state)
  calls.update({name: (lambda p=probe: p(weights, sources)) for name, probe in _client_work_probes(setup).items()})
  calls['client_inputs_python'] = lambda: setup.inputs(1)
  return calls


def _compile(name: str, calls: dict[str, Callable[[], Any]], worker_pids: Sequence[int]
             ) -> tuple[dict[str, Any], dict[str, float]]:
  """Each call's first run (compilation included): (results, wall seconds)."""
  results, seconds = {}, {}
  for probe, call in calls.items():
    presets.log(f'{name}: compiling {probe}')
    results[probe], sample = timing.timed_call(call, worker_pids)
    seconds[probe] = sample.wall
  return results, seconds


def _breakdown_case(settings: presets.Settings, model: str, examples: int,
                    worker_pids: Sequence[int]) -> dict[str, Any]:
  clients, batch_size = settings.small_rounds_clients, settings.floor_batch_size
  name = case_name(model, clients, examples)
  setup = build_generated_round(model, clients, examples, batch_size=batch_size, seed=settings.seed)
  directory = tempfile.mkdtemp(prefix='tff_gma_bench_')
  try:
    calls = _breakdown_calls(setup)
    results, compile_seconds = _compile(f'breakdown {name}', calls, worker_pids)
    row = dict(results['round_step'].row)  # A round's metrics row, filled up to a runner's row's size.
    row.update({f'extra/{i}': 0.0 for i in range(CSV_ROW_KEYS - len(row))})
    program_calls = _program_calls(setup.loop.state, row, directory)
    compile_seconds.update(_compile(f'breakdown {name}', program_calls, worker_pids)[1])
    calls.update(program_calls)
    presets.log(f'breakdown {name}: {settings.breakdown_repetitions} interleaved sweeps')
    samples = timing.interleaved_times(calls, settings.breakdown_repetitions, worker_pids=worker_pids)
  finally:
    setup.close()
    shutil.rmtree(directory, ignore_errors=True)
  timings = {probe: timing.summarize(s) for probe, s in samples.items()}
  parts = collections.OrderedDict(
      (part, timings[whole]['seconds'] - timings[inner]['seconds']) for part, whole, inner in PARTS)
  return collections.OrderedDict(
      setup=_setup_row(settings, model, examples, settings.breakdown_repetitions),
      timings=timings, parts=parts, compile_seconds=compile_seconds,
      samples={probe: [dataclasses.asdict(x) for x in ss] for probe, ss in samples.items()})


def _setup_row(settings: presets.Settings, model: str, examples: int, repetitions: int) -> dict[str, Any]:
  return dict(model=model, data=f'generated {list(presets.FLOOR_SHAPES[model])}, {NUM_CLASSES} classes',
              clients=settings.small_rounds_clients, examples_per_client=examples,
              batch_size=settings.floor_batch_size, local_epochs=1, aggregator=presets.BASELINE,
              repetitions=repetitions)


def bench_breakdown(settings: presets.Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  """Per (model, examples) of `settings.breakdown_cases`: every probe's medians (seconds, Python and worker CPU) and
  the derived parts (`PARTS`: differences of medians, in seconds, so noise can make one negative).

  `next` and `state_in_out` send the state from Python and bring it back; `client_work` and
  `client_work_and_aggregation` send the model weights and bring back scalars; `dispatch` and `client_data` send
  the clients' sources. Worker CPU counts in the kernel's clock ticks (usually 10 ms).
  """
  return _by_case(settings, settings.breakdown_cases, 'round_parts', 'parts',
                  lambda model, examples: _breakdown_case(settings, model, examples, worker_pids))


def _by_case(settings: presets.Settings, cases: Sequence[tuple[str, int]], key: str, part: str,
             run_case: Callable[[str, int], dict[str, Any]]) -> dict[str, Any]:
  """`{key: {case name: run_case(...)[part]}, 'cases': {case name: run_case(...)}}` over `cases`."""
  out = collections.OrderedDict({key: {}, 'cases': {}})
  for model, examples in cases:
    case = run_case(model, examples)
    name = case_name(model, settings.small_rounds_clients, examples)
    out[key][name] = case[part]
    out['cases'][name] = case
  return out


# ----------------------------------------------------------------------------------------------------------------
# Section: peers.


def _peers_case(settings: presets.Settings, model: str, examples: int, worker_pids: Sequence[int]) -> dict[str, Any]:
  batch_size, config = settings.floor_batch_size, presets.ALGORITHM_CONFIG
  name = case_name(model, settings.small_rounds_clients, examples)
  setup = build_generated_round(model, settings.small_rounds_clients, examples, batch_size=batch_size,
                                seed=settings.seed)
  try:
    calls = {
        'plain_tf': build_plain_tf_round(setup, batch_size).step,
        'project': setup.loop.step,
        'floor': floor_lib.build_floor(setup.build_keras, setup.input_spec, list(setup.client_arrays.values()),
                                       batch_size=batch_size, client_lr=config.client_lr,
                                       momentum=config.client_momentum, initial_weights=setup.initial_weights()),
    }
    compile_seconds = _compile(f'peers {name}', calls, worker_pids)[1]
    presets.log(f'peers {name}: {settings.peers_repetitions} interleaved sweeps')
    samples = timing.interleaved_times(calls, settings.peers_repetitions, worker_pids=worker_pids)
  finally:
    setup.close()
  timings = {entry: timing.summarize(s) for entry, s in samples.items()}
  seconds = {entry: t['seconds'] for entry, t in timings.items()}
  cpu = {entry: t['cpu_seconds'] for entry, t in timings.items()}
  ratios = collections.OrderedDict(
      project_to_plain_tf=seconds['project'] / seconds['plain_tf'],
      project_to_floor=seconds['project'] / seconds['floor'],
      plain_tf_to_floor=seconds['plain_tf'] / seconds['floor'],
      project_to_plain_tf_cpu=cpu['project'] / cpu['plain_tf'],
      project_to_floor_cpu=cpu['project'] / cpu['floor'])
  return collections.OrderedDict(
      setup=_setup_row(settings, model, examples, settings.peers_repetitions), ratios=ratios, timings=timings,
      compile_seconds=compile_seconds,
      samples={entry: [dataclasses.asdict(x) for x in ss] for entry, ss in samples.items()})


def bench_peers(settings: presets.Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  """Per (model, examples) of `settings.peers_cases`: the plain TF round, the project's and the floor, interleaved;
  `peer_ratios[case]`: the project's median round time over the plain TF round's and over the floor's (and CPU)."""
  return _by_case(settings, settings.peers_cases, 'peer_ratios', 'ratios',
                  lambda model, examples: _peers_case(settings, model, examples, worker_pids))


# ----------------------------------------------------------------------------------------------------------------
# Targets and Markdown.


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  """The targets (`TARGETS`) of the peers cases measured."""
  targets = []
  for name, case in result.get('details', {}).get('peers', {}).get('cases', {}).items():
    setup = case['setup']
    target = TARGETS.get((setup['model'], setup['clients'], setup['examples_per_client']))
    if target is None:
      continue
    entry, limit = target
    value, cpu_value = case['ratios'][f'project_to_{entry}'], case['ratios'][f'project_to_{entry}_cpu']
    against = 'plain TF' if entry == 'plain_tf' else 'its in-graph floor'
    targets.append(dict(target=f'project round ({name}) <= {limit:.2f}x {against}', value=value, met=value <= limit,
                        cpu_value=cpu_value))
  return targets


def _ms(seconds: float) -> str:
  return f'{1000 * seconds:.1f}'


def _breakdown_markdown(breakdown: dict[str, Any]) -> list[str]:
  lines = ['## Where a small round\'s time goes (`training.bench.small_rounds`, breakdown)', '',
           'Each probe timed interleaved with the others; medians in milliseconds: wall, this Python process\'s CPU, '
           'the TFF worker\'s CPU. Parts: differences of medians.', '']
  for name, case in breakdown['cases'].items():
    lines += [f'### {name}, batch {case["setup"]["batch_size"]}', '',
              '| probe | ms | Python CPU ms | worker CPU ms |', '|---|---|---|---|']
    lines += [f'| {probe} | {_ms(t["seconds"])} | {_ms(t["python_cpu_seconds"])} | {_ms(t["worker_cpu_seconds"])} |'
              for probe, t in case['timings'].items()]
    lines += [f'| part: {part} ({whole} - {inner}) | {_ms(case["parts"][part])} | | |'
              for part, whole, inner in PARTS]
    lines.append('')
  return lines


def _peers_markdown(peers: dict[str, Any]) -> list[str]:
  lines = ['## The round against plain TF and its floor (`training.bench.small_rounds`, peers)', '',
           'Interleaved in one run; medians. plain TF: `PlainTFRound` (a `tf.function` epoch per client, an eager '
           'driver); project: `RoundLoop.step` (datasets built in the worker); floor: `training.bench.floor`.', '',
           '| case | plain TF s | project s | floor s | project / plain TF | project / floor | plain TF / floor | '
           'CPU: project / plain TF |', '|---' * 8 + '|']
  for name, case in peers['cases'].items():
    t, r = case['timings'], case['ratios']
    lines.append(f'| {name}, batch {case["setup"]["batch_size"]} | {t["plain_tf"]["seconds"]:.3f} | '
                 f'{t["project"]["seconds"]:.3f} | {t["floor"]["seconds"]:.3f} | '
                 f'**{r["project_to_plain_tf"]:.2f}x** | **{r["project_to_floor"]:.2f}x** | '
                 f'{r["plain_tf_to_floor"]:.2f}x | {r["project_to_plain_tf_cpu"]:.2f}x |')
  lines.append('')
  return lines


def markdown(result: dict[str, Any]) -> list[str]:
  """The tables of the sections measured (none: no line)."""
  details = result['details']
  return ((_breakdown_markdown(details['breakdown']) if 'breakdown' in details else [])
          + (_peers_markdown(details['peers']) if 'peers' in details else []))
