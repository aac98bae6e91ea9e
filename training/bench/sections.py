"""The benchmark's sections that time whole rounds and aggregations of its entries.

`rounds`, `aggregation`, `client_execution`, `scaling` and `floor`, each as ratios in one process; `breakdown` and
`peers` are in `training.bench.small_rounds`, `runner` in `training.bench.runner_runs`, the command line in
`training.bench.cli`. What each measures: docs/research/benchmark.md#sections-keys-and-method
"""

from __future__ import annotations

import collections
import cProfile
import dataclasses
import io
import os
import pstats
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma import runtime
from tff_gma.data import client_data as client_data_lib
from tff_gma.data import loaders
from training.bench import candidates as candidates_lib
from training.bench import floor as floor_lib
from training.bench import presets
from training.bench import timing
from training.engine import client_execution
from training.engine import fedavg_family
from training.engine import methods
from training.engine import worker_datasets
from training.runner import round_loop


# ----------------------------------------------------------------------------------------------------------------
# Section: rounds.


def _digits_setup(settings: presets.Settings, num_clients: int):
  data = loaders.load_federated_data('digits', 'iid', num_clients, settings.seed)
  build_keras = models.keras_builder(settings.model, data.input_shape, data.num_classes)
  return data, build_keras, models.model_fn(build_keras, data.input_spec)


def _project_inputs(data, settings: presets.Settings, clients: int) -> round_loop.ClientInputs:
  """The runner's per-round work: seeded client sampling, then shuffled, repeated, batched datasets."""
  return round_loop.ClientInputs(data.train, clients, local_epochs=1, batch_size=presets.BATCH_SIZE, seed=settings.seed)


def _stock_process(name: str, model_fn) -> tff.learning.templates.LearningProcess:
  """TFF as a user gets it: `build_weighted_fed_avg` with its default aggregator and server optimizer."""
  loop = {'stock_fedavg': tff.learning.LoopImplementation.DATASET_REDUCE,
          'stock_fedavg_iterator': tff.learning.LoopImplementation.DATASET_ITERATOR}[name]
  return tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=fedavg_family.client_optimizer(presets.ALGORITHM_CONFIG), loop_implementation=loop)


def _compile_runners(names: Sequence[str], make: Callable[[str], round_loop.RoundLoop], worker_pids: Sequence[int]):
  """Builds each runner and runs its first round; returns runners and the timings of both steps."""
  runners, build_seconds, compile_seconds = {}, {}, {}
  for name in names:
    presets.log(f'building and compiling {name}')
    runner, build = timing.timed_call(lambda: make(name), worker_pids)
    _, first = timing.timed_call(runner.step, worker_pids)
    runners[name] = runner
    build_seconds[name] = build.wall
    compile_seconds[name] = first.wall
  return runners, build_seconds, compile_seconds


def _profile_rounds(runner: round_loop.RoundLoop, rounds: int, top: int = 25) -> str:
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(rounds):
    runner.step()
  profiler.disable()
  out = io.StringIO()
  pstats.Stats(profiler, stream=out).sort_stats('cumulative').print_stats(top)
  return out.getvalue()


def bench_rounds(settings: presets.Settings, worker_pids: Sequence[int], profile: Sequence[str]) -> dict[str, Any]:
  data, build_keras, model_fn = _digits_setup(settings, settings.round_clients)
  ids = list(data.train.client_ids)
  candidates = {entry: candidates_lib.parse_candidate(entry) for entry in settings.aggregators}
  project_inputs = _project_inputs(data, settings, len(ids))
  stock_datasets = [data.train.create_tf_dataset_for_client(c).batch(presets.BATCH_SIZE) for c in ids]
  # The candidates share one fixed list of clients and datasets (the same inputs for every candidate).
  fixed = project_inputs(1)
  initial_weights = None

  def make(name: str) -> round_loop.RoundLoop:
    nonlocal initial_weights
    if name in candidates:
      method, inputs = candidates_lib.build_method(candidates[name], model_fn, len(ids)), lambda _: fixed
    elif name == 'project_pipeline':  # What the runner builds for --aggregator=mean, with its per-round inputs.
      method = methods.build(model_fn, 'fedavg', presets.BASELINE, algorithm_config=presets.ALGORITHM_CONFIG)
      inputs = project_inputs
    else:
      method, inputs = methods.Method(_stock_process(name, model_fn)), lambda _: (ids, stock_datasets)
    state = round_loop.seeded_initial_state(method.process, build_keras, settings.seed)
    if initial_weights is None:
      initial_weights = method.process.get_model_weights(state)
    state = method.process.set_model_weights(state, initial_weights)  # Every process starts from the same model.
    return round_loop.RoundLoop(method, state, inputs)

  names = list(settings.aggregators) + list(presets.PIPELINE)
  runners, build_seconds, compile_seconds = _compile_runners(names, make, worker_pids)
  presets.log(f'rounds: {settings.round_repetitions} interleaved sweeps over {len(names)} processes')
  samples = timing.interleaved_times(
      {name: r.step for name, r in runners.items()}, settings.round_repetitions, worker_pids=worker_pids)
  summaries = {name: timing.summarize(s) for name, s in samples.items()}
  medians = {name: summaries[name]['seconds'] for name in settings.aggregators}
  cpu_medians = {name: summaries[name]['cpu_seconds'] for name in settings.aggregators}
  profiles = {}
  for name in profile:
    if name in runners:
      presets.log(f'profiling {name}')
      profiles[name] = _profile_rounds(runners[name], max(2, settings.round_repetitions))
  stock, project = summaries['stock_fedavg']['seconds'], summaries['project_pipeline']['seconds']
  return collections.OrderedDict(
      setup=dict(dataset='digits', partition='iid', model=settings.model, clients=len(ids),
                 examples=int(sum(data.train.num_examples(c) for c in ids)), batch_size=presets.BATCH_SIZE,
                 local_epochs=1, repetitions=settings.round_repetitions, loop=settings.loop),
      round_time_ratio=timing.ratios_to(presets.BASELINE, medians),
      round_cpu_ratio=timing.ratios_to(presets.BASELINE, cpu_medians),
      pipeline_throughput_ratio=stock / project,
      iterator_loop_speedup=stock / summaries['stock_fedavg_iterator']['seconds'],
      timings=summaries,
      build_seconds=build_seconds,
      compile_seconds=compile_seconds,
      samples={name: [dataclasses.asdict(s) for s in ss] for name, ss in samples.items()},
      profiles=profiles,
  )


# ----------------------------------------------------------------------------------------------------------------
# Section: aggregation alone.


def _probe_value(kind: str, size: int) -> tuple[Any, Callable[[tf.Tensor], Any]]:
  """(value type, client value generator) of a probe of `kind` for a model of `size` floats."""
  vector = tff.TensorType(np.float32, [size])
  if kind == 'update_and_sensitivity':  # An update and a (non-negative) sensitivity of the model's size each.
    return collections.OrderedDict(update=vector, sensitivity=vector), (
        lambda seed: collections.OrderedDict(
            update=timing.random_client_value(vector, seed),
            sensitivity=timing.random_client_value(vector, seed + 1, nonnegative=True)))
  return vector, lambda seed: timing.random_client_value(vector, seed)


def bench_aggregation(settings: presets.Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  factories = {}
  for entry in settings.aggregators:
    probe = candidates_lib.probe_factory(candidates_lib.parse_candidate(entry), presets.PROBE_VALUE_BOUND)
    if probe is None:
      presets.log(f'aggregation: {entry} has no aggregation-only probe (a composed algorithm); its rounds are measured')
    else:
      factories[entry] = probe
  ratio, extra, timings, compile_seconds = {}, {}, {}, {}
  for size in settings.aggregation_sizes:
    for clients in settings.aggregation_clients:
      key = f'{size}x{clients}'
      seeds = list(range(settings.seed, settings.seed + clients))
      presets.log(f'aggregation {key}: compiling {len(factories)} probes')
      probes, generators = {}, {}
      for name, (kind, factory) in factories.items():
        value_type, make_value = _probe_value(kind, size)
        probes[name] = timing.aggregation_probe(factory, value_type, make_value=make_value)
        if f'generation_{kind}' not in generators:
          generators[f'generation_{kind}'] = timing.generation_probe(value_type, make_value=make_value)
      probes.update(generators)
      calls = {name: (lambda p=p: p(seeds)) for name, p in probes.items()}
      compile_seconds[key] = {name: timing.timed_call(call, worker_pids)[1].wall for name, call in calls.items()}
      samples = timing.interleaved_times(calls, settings.aggregation_repetitions, worker_pids=worker_pids)
      timings[key] = {name: timing.summarize(s) for name, s in samples.items()}
      medians = {name: timings[key][name]['seconds'] for name in factories}
      ratio[key] = timing.ratios_to(presets.BASELINE, medians)
      # What each candidate adds to a call of the mean, in seconds. (A ratio of times net of the generation
      # would divide by the mean's own cost, a sum, which is about the generation's and so lost in its noise.)
      extra[key] = {name: t - medians[presets.BASELINE] for name, t in medians.items()}
  return collections.OrderedDict(
      setup=dict(sizes=list(settings.aggregation_sizes), clients=list(settings.aggregation_clients),
                 repetitions=settings.aggregation_repetitions, value='float32 vector, standard normal per client',
                 weights='1..5'),
      aggregation_time_ratio=ratio,
      aggregation_extra_seconds=extra,
      timings=timings,
      compile_seconds=compile_seconds,
  )


# ----------------------------------------------------------------------------------------------------------------
# Section: where the clients train (TFF worker vs this process).

GENERATED_MODELS = ('resnet18_gn',)  # Trained on generated CIFAR-10-shaped examples; the others on the digits.
CIFAR_SHAPE, CIFAR_CLASSES = (32, 32, 3), 10


def _generated_cifar_setup(settings: presets.Settings, model: str):
  """`client_execution_clients` clients of `client_execution_examples` uniform [32, 32, 3] images, 10 classes."""
  rng = np.random.default_rng(settings.seed)
  n = settings.client_execution_examples
  arrays = collections.OrderedDict(
      (f'client_{i}', (rng.random((n, *CIFAR_SHAPE), dtype=np.float32),
                       rng.integers(0, CIFAR_CLASSES, n).astype(np.int32)))
      for i in range(settings.client_execution_clients))
  train = client_data_lib.from_client_arrays(arrays)
  element = train.create_tf_dataset_for_client(train.client_ids[0]).element_spec
  input_spec = collections.OrderedDict((k, tf.TensorSpec([None, *s.shape], s.dtype)) for k, s in element.items())
  build_keras = models.keras_builder(model, CIFAR_SHAPE, CIFAR_CLASSES)
  return train, build_keras, models.model_fn(build_keras, input_spec)


def bench_client_execution(settings: presets.Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  ratio, cpu_ratio, details = {}, {}, {}
  for model in settings.client_execution_models:
    if model in GENERATED_MODELS:
      train, build_keras, model_fn = _generated_cifar_setup(settings, model)
      data_name = f'generated CIFAR-10-shaped {list(CIFAR_SHAPE)}'
    else:
      data, build_keras, model_fn = _digits_setup(dataclasses.replace(settings, model=model),
                                                  settings.client_execution_clients)
      train, data_name = data.train, 'digits'
    ids = list(train.client_ids)
    fixed = (ids, [round_loop.client_dataset(train, c, local_epochs=1, batch_size=presets.BATCH_SIZE,
                                             seed=settings.seed, round_num=1) for c in ids])
    runners, build_seconds, compile_seconds, devices = {}, {}, {}, {}
    initial_weights = None
    for mode in client_execution.MODES:
      presets.log(f'client_execution {model}: building and compiling {mode}')
      method, build = timing.timed_call(lambda m=mode: methods.build(
          model_fn, 'fedavg', presets.BASELINE, algorithm_config=presets.ALGORITHM_CONFIG, client_execution=m),
          worker_pids)
      state = round_loop.seeded_initial_state(method.process, build_keras, settings.seed)
      if initial_weights is None:
        initial_weights = method.process.get_model_weights(state)
      runner = round_loop.RoundLoop(method, method.process.set_model_weights(state, initial_weights), lambda _: fixed)
      _, first = timing.timed_call(runner.step, worker_pids)
      runners[mode], build_seconds[mode], compile_seconds[mode] = runner, build.wall, first.wall
    presets.log(f'client_execution {model}: {settings.client_execution_repetitions} interleaved sweeps')
    samples = timing.interleaved_times({m: r.step for m, r in runners.items()},
                                           settings.client_execution_repetitions, worker_pids=worker_pids)
    timings = {m: timing.summarize(s) for m, s in samples.items()}
    devices = {m: r.method.client_devices() for m, r in runners.items()}
    ratio[model] = timings['local']['seconds'] / timings['worker']['seconds']
    cpu_ratio[model] = timings['local']['cpu_seconds'] / timings['worker']['cpu_seconds']
    details[model] = collections.OrderedDict(
        setup=dict(data=data_name, clients=len(ids), examples=int(sum(train.num_examples(c) for c in ids)),
                   batch_size=presets.BATCH_SIZE, local_epochs=1, aggregator=presets.BASELINE,
                   repetitions=settings.client_execution_repetitions,
                   parameters=int(sum(np.prod(t.shape) for t in initial_weights.trainable))),
        timings=timings, build_seconds=build_seconds, compile_seconds=compile_seconds, client_devices=devices,
        samples={m: [dataclasses.asdict(x) for x in ss] for m, ss in samples.items()})
  return collections.OrderedDict(
      client_execution_time_ratio=ratio, client_execution_cpu_ratio=cpu_ratio,
      gpus_visible=[d.name for d in tf.config.list_logical_devices('GPU')],
      device_line=client_execution.device_line(client_execution.local_devices()), models=details)


# ----------------------------------------------------------------------------------------------------------------
# Section: scaling with clients per round.


def bench_scaling(settings: presets.Settings, worker: runtime.WorkerProcess) -> list[dict[str, Any]]:
  total_clients = max(settings.scaling_clients)
  data, build_keras, model_fn = _digits_setup(settings, total_clients)
  ids = data.train.client_ids
  pids = {'python': os.getpid(), 'worker': worker.pid}
  rows = []
  for name in settings.scaling_aggregators:
    method = candidates_lib.build_method(candidates_lib.parse_candidate(name), model_fn, total_clients)
    runner = round_loop.RoundLoop(method, round_loop.seeded_initial_state(method.process, build_keras, settings.seed),
                              _project_inputs(data, settings, min(settings.scaling_clients)))
    # Compile on the smallest round: one computation serves every number of clients (the cardinality is an
    # argument of the call, not of the compiled computation).
    presets.log(f'scaling {name}: compiling')
    _, first = timing.timed_call(runner.step, [worker.pid])
    for clients in sorted(settings.scaling_clients):
      presets.log(f'scaling {name}: {clients} clients per round')
      runner.inputs = _project_inputs(data, settings, clients)
      with timing.PeakMemory(pids) as memory:
        samples = [timing.timed_call(runner.step, [worker.pid])[1]
                   for _ in range(settings.scaling_repetitions)]
      summary = timing.summarize(samples)
      rows.append(collections.OrderedDict(
          aggregator=name,
          clients_per_round=clients,
          total_clients=total_clients,
          examples_per_round=int(sum(data.train.num_examples(c) for c in
                                     round_loop.sample_clients(ids, clients, settings.seed, 1))),
          compile_seconds=first.wall,
          **summary,
          worker_cpu_seconds_per_client=summary['worker_cpu_seconds'] / clients,
          peak_rss_gib={k: (v or 0) / presets.GIB for k, v in memory.result['peak_rss_bytes'].items()},
          peak_total_gib=memory.result['peak_total_bytes'] / presets.GIB,
          sampled_peak_total_gib=memory.result['sampled_peak_total_bytes'] / presets.GIB,
      ))
  return rows


# ----------------------------------------------------------------------------------------------------------------
# Section: a round against its in-graph floor.

FLOOR_TARGET = 1.5  # A round within 1.5x its in-graph floor,
LOOP_SPEEDUP_TARGET = 2.0  # and twice the throughput of the sent-datasets loop (datasets sent every round, TFF's loop).
FLOOR_ENTRIES = ('floor', 'floor_in_worker', 'project_worker_datasets', 'project_default_threads',
                 'project_iterator', 'project_sent_datasets_iterator', 'stock_fedavg_iterator', 'project_one_batch')
# On a second worker with TensorFlow's default intra-op threads (one per core) instead of the runtime's
# (worker_process.DEFAULT_INTRA_OP_THREADS): project_default_threads (the default round otherwise) and the sent-datasets
# loop. The others run on the bench's worker (runtime's default, one thread).
_DEFAULT_THREADS_ENTRIES = ('project_default_threads', 'project_sent_datasets_iterator')
# floor_in_worker: the floor's graph as one TFF computation run by the worker (what the worker's way of running TF
# costs apart from any round). project_worker_datasets: the runner's default (datasets built in the worker, the
# in-graph client loop); project_iterator: the same with TFF's iterator loop; project_sent_datasets_iterator: the
# sent-datasets loop (datasets sent every round, TFF's iterator loop, the worker's default threads).
# project_one_batch: the project's round with each client holding one batch of examples: what a round costs beyond
# its clients' epochs (state to and from the worker, broadcast, aggregation, the server update, metrics, dataset
# set-up), so that `round - one batch` is the part that grows with the examples, comparable to the floor.


def _in_context(context, fn: Callable[[], Any]) -> Callable[[], Any]:
  """`fn` run with `context` as TFF's context (e.g. on another worker)."""
  def call():
    with tff.framework.get_context_stack().install(context):
      return fn()
  return call


@dataclasses.dataclass(frozen=True)
class _FloorCase:
  """One model's floor inputs: its generated clients, and the project's round inputs with their datasets built in the
  worker (all examples, and one batch a client)."""
  shape: tuple[int, ...]
  arrays: collections.OrderedDict
  train: Any
  input_spec: collections.OrderedDict
  build_keras: Callable[[], tf.keras.Model]
  model_fn: Callable[[], Any]
  inputs: round_loop.ClientInputs
  placement: worker_datasets.WorkerDatasets
  one_batch_inputs: round_loop.ClientInputs
  one_batch_placement: worker_datasets.WorkerDatasets
  ids: list[str]
  stock_datasets: list[tf.data.Dataset]  # TFF's stock FedAvg's: each client's examples, batched.


def _floor_case(settings: presets.Settings, model: str, examples: int) -> _FloorCase:
  """`floor_clients` clients of `examples` uniform examples of the model's shape, 10 classes; the worker's datasets."""
  shape, rng = presets.FLOOR_SHAPES[model], np.random.default_rng(settings.seed)
  arrays = collections.OrderedDict(
      (f'client_{i}', (rng.random((examples, *shape), dtype=np.float32),
                       rng.integers(0, 10, examples).astype(np.int32)))
      for i in range(settings.floor_clients))
  train = client_data_lib.from_client_arrays(arrays)
  element = train.create_tf_dataset_for_client(train.client_ids[0]).element_spec
  input_spec = collections.OrderedDict((k, tf.TensorSpec([None, *s.shape], s.dtype)) for k, s in element.items())
  build_keras = models.keras_builder(model, shape, 10)
  model_fn = models.model_fn(build_keras, input_spec)
  tf.keras.utils.set_random_seed(settings.seed)
  inputs = round_loop.ClientInputs(train, len(arrays), 1, settings.floor_batch_size, settings.seed)
  placement = worker_datasets.WorkerDatasets(inputs)
  one_batch = client_data_lib.from_client_arrays(collections.OrderedDict(
      (c, (x[:settings.floor_batch_size], y[:settings.floor_batch_size])) for c, (x, y) in arrays.items()))
  one_batch_inputs = round_loop.ClientInputs(one_batch, len(arrays), 1, settings.floor_batch_size, settings.seed)
  one_batch_placement = worker_datasets.WorkerDatasets(one_batch_inputs)
  ids = list(train.client_ids)
  stock_datasets = [train.create_tf_dataset_for_client(c).batch(settings.floor_batch_size) for c in ids]
  return _FloorCase(shape, arrays, train, input_spec, build_keras, model_fn, inputs, placement, one_batch_inputs,
                    one_batch_placement, ids, stock_datasets)


def _floor_entry_method(name: str, case: _FloorCase) -> tuple[methods.Method, Any]:
  """(the process, its round inputs) of a round entry of FLOOR_ENTRIES (module comment above)."""
  if name == 'stock_fedavg_iterator':
    return methods.Method(_stock_process(name, case.model_fn)), lambda _: (case.ids, case.stock_datasets)
  files = {'project_worker_datasets': case.placement, 'project_default_threads': case.placement,
           'project_iterator': case.placement, 'project_one_batch': case.one_batch_placement}.get(name)
  loop_config = dataclasses.replace(presets.ALGORITHM_CONFIG,
                                    client_loop='iterator' if name.endswith('iterator') else 'in_graph')
  method = methods.build(case.model_fn, 'fedavg', presets.BASELINE, algorithm_config=loop_config,
                         client_sources=None if files is None else files.client_sources)
  if files is not None:
    method.place_datasets_in_worker(files)
  return method, case.one_batch_inputs if name == 'project_one_batch' else case.inputs


def _compile_floor_entries(model: str, case: _FloorCase, settings: presets.Settings, default_threads_context,
                           pids: Sequence[int]) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
  """Every entry's round as a call, each from the same model, and its first call's seconds (its compilation)."""
  config = presets.ALGORITHM_CONFIG
  initial = None
  calls, compile_seconds = {}, {}
  for name in FLOOR_ENTRIES[2:]:
    method, round_inputs = _floor_entry_method(name, case)
    state = round_loop.seeded_initial_state(method.process, case.build_keras, settings.seed)
    if initial is None:
      initial = method.process.get_model_weights(state)
    loop = round_loop.RoundLoop(method, method.process.set_model_weights(state, initial), round_inputs)
    step = _in_context(default_threads_context, loop.step) if name in _DEFAULT_THREADS_ENTRIES else loop.step
    presets.log(f'floor {model}: building and compiling {name}')
    _, first = timing.timed_call(step, pids)
    calls[name], compile_seconds[name] = step, first.wall
  for name, build in (('floor', floor_lib.build_floor), ('floor_in_worker', floor_lib.build_floor_in_worker)):
    calls[name] = build(
        case.build_keras, case.input_spec, list(case.arrays.values()), batch_size=settings.floor_batch_size,
        client_lr=config.client_lr, momentum=config.client_momentum, initial_weights=list(initial.trainable))
    _, first = timing.timed_call(calls[name], pids)
    compile_seconds[name] = first.wall
  return calls, compile_seconds


def bench_floor(settings: presets.Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  """Per model: a FedAvg/mean round of `floor_clients` clients of generated examples, one local epoch, interleaved:
  the floor (in this process and in the worker), the runner's round as it runs by default, on a worker with
  TensorFlow's default threads, with the iterator loop, and as it ran before (sent datasets, iterator loop, default
  threads), TFF's stock iterator FedAvg and a one-batch round; each as a
  ratio to the floor (`round_to_floor`), and the default's speed-up over the loop before (`loop_before_speedup`)."""
  if len(settings.floor_examples) != len(settings.floor_models):
    raise ValueError('floor_examples needs one count per floor model')
  out = collections.OrderedDict(round_to_floor={}, loop_before_speedup={}, models={})
  for model, examples in zip(settings.floor_models, settings.floor_examples):
    case = _floor_case(settings, model, examples)
    default_threads = runtime.WorkerProcess(intra_op_threads=0)
    try:
      default_threads_context = runtime.create_simulation_context(default_threads.start())
      pids = (*worker_pids, default_threads.pid)
      calls, compile_seconds = _compile_floor_entries(model, case, settings, default_threads_context, pids)
      presets.log(f'floor {model}: {settings.floor_repetitions} interleaved sweeps')
      samples = timing.interleaved_times({n: calls[n] for n in FLOOR_ENTRIES}, settings.floor_repetitions,
                                         worker_pids=pids)
    finally:
      default_threads.stop()
      case.placement.close()
      case.one_batch_placement.close()
    timings = {n: timing.summarize(s) for n, s in samples.items()}
    floor_seconds = timings['floor']['seconds']
    out['round_to_floor'][model] = {n: timings[n]['seconds'] / floor_seconds for n in FLOOR_ENTRIES[1:]}
    # The part of the project's round that grows with the examples, over the floor's.
    out['round_to_floor'][model]['project_beyond_one_batch'] = (
        timings['project_worker_datasets']['seconds'] - timings['project_one_batch']['seconds']) / floor_seconds
    out['loop_before_speedup'][model] = (timings['project_sent_datasets_iterator']['seconds']
                                         / timings['project_worker_datasets']['seconds'])
    out['models'][model] = collections.OrderedDict(
        setup=dict(data=f'generated {list(case.shape)}, 10 classes', clients=len(case.ids),
                   examples_per_client=examples, batch_size=settings.floor_batch_size, local_epochs=1,
                   aggregator=presets.BASELINE, repetitions=settings.floor_repetitions),
        timings=timings, compile_seconds=compile_seconds,
        samples={n: [dataclasses.asdict(x) for x in ss] for n, ss in samples.items()})
  return out
