"""The benchmark: aggregator overhead and client scaling in TFF's runtime, as ratios to the mean in the same run.

    python -m training.bench --quick      # a few minutes (scripts/bench.sh --quick)
    python -m training.bench              # the full benchmark (run it on a quiet machine)
    python -m training.bench --smoke      # every section and key on tiny sizes (the tests)

The candidates are methods of `training.engine.methods`, named as `registry.resolve` names them (an aggregator, which is
FedAvg with it; a composed algorithm; ALGORITHM/AGGREGATOR), each optionally with aggregator or method settings:
`NAME+setting=value+...` (fields of `training.engine.config_lib.AggregatorParams` or `training.engine.config_lib.MethodParams`; a
bare boolean setting means true), e.g. `gma+secure`, `rfa+num_passes=5`. The entry is the candidate's label in
the JSON. Default: every aggregator the methods know (`registry.AGGREGATORS`: the registry's and Elastic), then
secure GMA and RFA with 1 and 5 passes; an aggregator added to `training.engine.registry` is benchmarked with no edit
here. Secure entries without `secure_bound` get the section's bound (model updates: 1; the probe's values: 4).

Three sections, each written into the JSON (--output, default outputs/bench/bench.json) and a Markdown table
beside it (bench.md):

* rounds: one round of each candidate (`methods.build`: the process the runner trains, the project's client
  work with TFF's DATASET_ITERATOR loop) on the digits model, all on the same client datasets and from the same
  model, as `round_time_ratio` (median round time / median of `mean`). Also the project's mean pipeline
  (`project_pipeline`: what the runner builds for --aggregator=mean, with its per-round client sampling and
  dataset construction) against TFF's stock `build_weighted_fed_avg` with plain batched datasets:
  `pipeline_throughput_ratio` = stock round time / project round time (> 1: the project's pipeline is faster).
  And the client-loop comparison: stock FedAvg with `loop_implementation=DATASET_ITERATOR`
  (`stock_fedavg_iterator`) against TFF's default DATASET_REDUCE (`stock_fedavg`): `iterator_loop_speedup`.
* aggregation: each FedAvg candidate's aggregation process alone (`training.engine.registry.build`; Elastic's
  `ElasticFactory`), for models of 1e4, 1e5, 1e6 floats and 10 / 100 clients, with the client values generated
  inside the TFF worker (`training.bench.timing.aggregation_probe`): `aggregation_time_ratio[config][candidate]`.
  The generation of the client values is the same for every candidate of a config (Elastic's values are twice
  as many: an update and a sensitivity) and is timed on its own (`generation_vector`,
  `generation_update_and_sensitivity`); `aggregation_extra_seconds` is what each candidate adds to a call of the
  mean.
* scaling: round time and peak resident memory (this process and the TFF worker) against clients per round
  (10, 50, 100, 500) of the digits set split over 500 clients (about 3 examples each).
* client_execution: FedAvg with the mean, its clients trained in the TFF worker (`--client_execution=worker`)
  against in this process's TensorFlow (`local`, `training.engine.client_execution`), interleaved in one run, on the
  digits CNN (the digits over 10 clients) and on ResNet-18-GN with CIFAR-10-shaped generated examples ([32, 32, 3],
  10 clients x 300; `--client_execution_examples` makes it smaller): `client_execution_time_ratio[model]` =
  local round time / worker round time (< 1: local is faster), with the TensorFlow devices each mode trained on
  and local mode's device line. Without a GPU, local trains on this process's CPU.

Method: everything is compiled first (the first call of each computation, timed and reported as
compile_seconds), then the candidates run in interleaved sweeps (order rotated each sweep) on the same inputs,
and the medians are compared. Each sample also records the CPU seconds of this Python process and of the TFF
worker (from /proc), which splits a round's time into the worker's work, Python's (tracing, serialization, gRPC)
and waiting; `round_cpu_ratio` is the ratio of those CPU seconds, steadier than wall time when other work shares
the machine. --profile=NAME adds a cProfile of the Python side of NAME's rounds (profile_NAME.txt).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import collections  # pylint: disable=g-import-not-at-top
import cProfile
import dataclasses
import datetime
import io
import json
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma import runtime
from tff_gma.data import client_data as client_data_lib
from tff_gma.data import loaders
from training import config as config_lib
from training.bench import timing
from training.engine import client_execution
from training.engine import methods
from training.engine import registry
from training.engine import fedavg_family
from training.runner import round_loop

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = 'mean'
# Parameter variants benchmarked by default besides every aggregator of `registry.AGGREGATORS` (the targets
# concern secure GMA and RFA's number of passes).
VARIANTS = ('gma+secure', 'gma_binary+secure', 'rfa+num_passes=1', 'rfa+num_passes=5')
AGGREGATORS = tuple(registry.AGGREGATORS) + VARIANTS
PIPELINE = ('stock_fedavg', 'stock_fedavg_iterator', 'project_pipeline')
SECTIONS = ('rounds', 'aggregation', 'scaling', 'client_execution')
GIB = 1024**3
MEMORY_LIMIT_GIB = 24.0
# Targets of issue 8 (ratios to `mean` in the same run).
GMA_TARGET, RFA_3_TARGET, ELASTIC_TARGET = 1.10, 1.5, 1.3
ROUND_TARGETS = {'gma': GMA_TARGET, 'gma_binary': GMA_TARGET, 'rfa': RFA_3_TARGET, 'elastic': ELASTIC_TARGET}
PIPELINE_TARGET = 0.95

# The digits setup (the runner's defaults: client SGD 0.05 with momentum 0.9, server SGD 1).
ALGORITHM_CONFIG = config_lib.AlgorithmConfig()
BATCH_SIZE = config_lib.ExperimentConfig.batch_size  # The runner's default client batch.
SECURE_VALUE_BOUND = 1.0  # Per-coordinate bound of a model update for secure entries (digits models: |d| << 1).
PROBE_VALUE_BOUND = 4.0  # The probe's values are standard normal.
DIGITS_TRAIN_EXAMPLES = 1437


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one run measures; --quick and --smoke pick smaller ones."""
  sections: tuple[str, ...] = SECTIONS
  aggregators: tuple[str, ...] = AGGREGATORS  # Candidate entries (see the module docstring).
  model: str = 'cnn'
  # The candidates' client training loop: the project's (`fedavg_family.build_client_work`), recorded; TFF's
  # default DATASET_REDUCE loop is measured by the `stock_fedavg` / `stock_fedavg_iterator` pair.
  loop: str = 'iterator'
  round_clients: int = 10
  round_repetitions: int = 7
  aggregation_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
  aggregation_clients: tuple[int, ...] = (10, 100)
  aggregation_repetitions: int = 5
  scaling_clients: tuple[int, ...] = (10, 50, 100, 500)
  scaling_aggregators: tuple[str, ...] = ('mean', 'gma', 'rfa')
  scaling_repetitions: int = 3
  # client_execution: models (cnn: the digits; resnet18_gn: generated CIFAR-10-shaped examples), clients, the
  # generated examples per client, interleaved repetitions.
  client_execution_models: tuple[str, ...] = ('cnn', 'resnet18_gn')
  client_execution_clients: int = 10
  client_execution_examples: int = 300
  client_execution_repetitions: int = 3
  seed: int = 0


QUICK = Settings(
    round_repetitions=3,
    aggregation_sizes=(10_000, 1_000_000),
    aggregation_clients=(10,),
    aggregation_repetitions=3,
    scaling_clients=(10, 100, 500),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
    client_execution_examples=100,
    client_execution_repetitions=2,
)
# For the tests: every section and key, on sizes that take seconds.
SMOKE = Settings(
    aggregators=('mean', 'gma'),
    model='logistic',
    round_clients=3,
    round_repetitions=1,
    aggregation_sizes=(1000,),
    aggregation_clients=(3,),
    aggregation_repetitions=1,
    scaling_clients=(2, 4),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
    client_execution_models=('logistic',),  # The section's test adds resnet18_gn (its build takes a minute).
    client_execution_clients=2,
    client_execution_examples=4,
    client_execution_repetitions=1,
)
MODES = {'full': Settings(), 'quick': QUICK, 'smoke': SMOKE}


def _log(message: str) -> None:
  print(f'[bench {time.strftime("%H:%M:%S")}] {message}', file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Candidates: entries of the method registry.


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A benchmark entry: `registry.resolve(name)` with aggregator and method settings."""
  label: str
  algorithm: str
  aggregator: str
  aggregator_params: config_lib.AggregatorParams = config_lib.AggregatorParams()
  method_params: config_lib.MethodParams = config_lib.MethodParams()

  def params(self, secure_bound: float) -> config_lib.AggregatorParams:
    """The aggregator settings, with `secure_bound` where the entry is secure and sets none."""
    if self.aggregator_params.secure and self.aggregator_params.secure_bound is None:
      return dataclasses.replace(self.aggregator_params, secure_bound=secure_bound)
    return self.aggregator_params


def _setting_value(field: dataclasses.Field, raw: Optional[str], entry: str) -> Any:
  kind = str(field.type)
  if 'bool' in kind:
    if raw is None or raw.lower() in ('true', '1', 'yes'):
      return True
    if raw.lower() in ('false', '0', 'no'):
      return False
    raise ValueError(f'{entry!r}: {field.name} takes true or false, got {raw!r}')
  if raw is None:
    raise ValueError(f'{entry!r}: {field.name} needs a value ({field.name}=...)')
  try:
    if 'int' in kind:
      return int(raw)
    if 'float' in kind:
      return float(raw)
  except ValueError:
    raise ValueError(f'{entry!r}: {field.name} takes a number, got {raw!r}') from None
  return raw


def parse_candidate(entry: str) -> Candidate:
  """'rfa+num_passes=5' -> Candidate('rfa+num_passes=5', 'fedavg', 'rfa', AggregatorParams(num_passes=5), ...).

  Raises ValueError naming the entry for an unknown method or setting or a value of the wrong type.
  """
  name, *settings = entry.split('+')
  try:
    algorithm, aggregator = registry.resolve(name)
  except ValueError as e:
    raise ValueError(f'{entry!r}: {e}') from None
  fields = {
      'aggregator': {f.name: f for f in dataclasses.fields(config_lib.AggregatorParams)},
      'method': {f.name: f for f in dataclasses.fields(config_lib.MethodParams)},
  }
  overrides: dict[str, dict[str, Any]] = {'aggregator': {}, 'method': {}}
  for setting in settings:
    key, sep, raw = setting.partition('=')
    where = next((w for w, known in fields.items() if key in known), None)
    if where is None:
      known = sorted(set(fields['aggregator']) | set(fields['method']))
      raise ValueError(f'{entry!r}: unknown setting {key!r}; expected NAME+setting=value+... with settings among '
                       f'{", ".join(known)}')
    overrides[where][key] = _setting_value(fields[where][key], raw if sep else None, entry)
  return Candidate(entry, algorithm, aggregator, config_lib.AggregatorParams(**overrides['aggregator']),
                   config_lib.MethodParams(**overrides['method']))


def probe_factory(candidate: Candidate,
                  value_bound: float) -> Optional[tuple[str, tff.aggregators.WeightedAggregationFactory]]:
  """(kind of client value, aggregation factory) of a FedAvg candidate's aggregator alone; None for the others.

  A registry aggregator is `registry.build`'s factory on model-sized vectors; Elastic (a learning process of its
  own in `methods.build`) is its `ElasticFactory` on an update and a sensitivity. Composed algorithms (and any
  other process aggregator) have no aggregation-only probe: their rounds are measured.
  """
  if candidate.algorithm != 'fedavg':
    return None
  params = candidate.params(value_bound)
  record = registry.aggregator(candidate.aggregator)
  if record.kind == registry.PROCESS:
    return None if record.probe is None else record.probe(params, candidate.method_params)
  return 'vector', registry.build(candidate.aggregator, params)


def build_method(candidate: Candidate, model_fn, num_clients: int) -> methods.Method:
  """`methods.build` of the candidate on the digits setup (updates bounded by SECURE_VALUE_BOUND if secure)."""
  return methods.build(model_fn, candidate.algorithm, candidate.aggregator, algorithm_config=ALGORITHM_CONFIG,
                       aggregator_params=candidate.params(SECURE_VALUE_BOUND),
                       method_params=candidate.method_params, num_clients=num_clients)


def round_target(candidate: Candidate) -> Optional[float]:
  """The issue's limit on the candidate's round time ratio to the mean, if it has one."""
  if candidate.algorithm != 'fedavg':
    return None
  if candidate.aggregator == 'rfa' and candidate.aggregator_params.num_passes != 3:
    return None  # The limit is RFA's with the paper's 3 passes.
  return ROUND_TARGETS.get(candidate.aggregator)


# ----------------------------------------------------------------------------------------------------------------
# Section: rounds.


def _digits_setup(settings: Settings, num_clients: int):
  data = loaders.load_federated_data('digits', 'iid', num_clients, settings.seed)
  build_keras = models.keras_builder(settings.model, data.input_shape, data.num_classes)
  return data, build_keras, models.model_fn(build_keras, data.input_spec)


def _project_inputs(data, settings: Settings, clients: int) -> round_loop.ClientInputs:
  """The runner's per-round work: seeded client sampling, then shuffled, repeated, batched datasets."""
  return round_loop.ClientInputs(data.train, clients, local_epochs=1, batch_size=BATCH_SIZE, seed=settings.seed)


def _stock_process(name: str, model_fn) -> tff.learning.templates.LearningProcess:
  """TFF as a user gets it: `build_weighted_fed_avg` with its default aggregator and server optimizer."""
  loop = {'stock_fedavg': tff.learning.LoopImplementation.DATASET_REDUCE,
          'stock_fedavg_iterator': tff.learning.LoopImplementation.DATASET_ITERATOR}[name]
  return tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=fedavg_family.client_optimizer(ALGORITHM_CONFIG), loop_implementation=loop)


def _compile_runners(names: Sequence[str], make: Callable[[str], round_loop.RoundLoop], worker_pids: Sequence[int]):
  """Builds each runner and runs its first round; returns runners and the timings of both steps."""
  runners, build_seconds, compile_seconds = {}, {}, {}
  for name in names:
    _log(f'building and compiling {name}')
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


def bench_rounds(settings: Settings, worker_pids: Sequence[int], profile: Sequence[str]) -> dict[str, Any]:
  data, build_keras, model_fn = _digits_setup(settings, settings.round_clients)
  ids = list(data.train.client_ids)
  candidates = {entry: parse_candidate(entry) for entry in settings.aggregators}
  project_inputs = _project_inputs(data, settings, len(ids))
  stock_datasets = [data.train.create_tf_dataset_for_client(c).batch(BATCH_SIZE) for c in ids]
  # The candidates share one fixed list of clients and datasets (the same inputs for every candidate).
  fixed = project_inputs(1)
  initial_weights = None

  def make(name: str) -> round_loop.RoundLoop:
    nonlocal initial_weights
    if name in candidates:
      method, inputs = build_method(candidates[name], model_fn, len(ids)), lambda _: fixed
    elif name == 'project_pipeline':  # What the runner builds for --aggregator=mean, with its per-round inputs.
      method, inputs = methods.build(model_fn, 'fedavg', BASELINE, algorithm_config=ALGORITHM_CONFIG), project_inputs
    else:
      method, inputs = methods.Method(_stock_process(name, model_fn)), lambda _: (ids, stock_datasets)
    state = round_loop.seeded_initial_state(method.process, build_keras, settings.seed)
    if initial_weights is None:
      initial_weights = method.process.get_model_weights(state)
    state = method.process.set_model_weights(state, initial_weights)  # Every process starts from the same model.
    return round_loop.RoundLoop(method, state, inputs)

  names = list(settings.aggregators) + list(PIPELINE)
  runners, build_seconds, compile_seconds = _compile_runners(names, make, worker_pids)
  _log(f'rounds: {settings.round_repetitions} interleaved sweeps over {len(names)} processes')
  samples = timing.interleaved_times(
      {name: r.step for name, r in runners.items()}, settings.round_repetitions, worker_pids=worker_pids)
  summaries = {name: timing.summarize(s) for name, s in samples.items()}
  medians = {name: summaries[name]['seconds'] for name in settings.aggregators}
  cpu_medians = {name: summaries[name]['cpu_seconds'] for name in settings.aggregators}
  profiles = {}
  for name in profile:
    if name in runners:
      _log(f'profiling {name}')
      profiles[name] = _profile_rounds(runners[name], max(2, settings.round_repetitions))
  stock, project = summaries['stock_fedavg']['seconds'], summaries['project_pipeline']['seconds']
  return collections.OrderedDict(
      setup=dict(dataset='digits', partition='iid', model=settings.model, clients=len(ids),
                 examples=int(sum(data.train.num_examples(c) for c in ids)), batch_size=BATCH_SIZE,
                 local_epochs=1, repetitions=settings.round_repetitions, loop=settings.loop),
      round_time_ratio=timing.ratios_to(BASELINE, medians),
      round_cpu_ratio=timing.ratios_to(BASELINE, cpu_medians),
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


def bench_aggregation(settings: Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  factories = {}
  for entry in settings.aggregators:
    probe = probe_factory(parse_candidate(entry), PROBE_VALUE_BOUND)
    if probe is None:
      _log(f'aggregation: {entry} has no aggregation-only probe (a composed algorithm); its rounds are measured')
    else:
      factories[entry] = probe
  ratio, extra, timings, compile_seconds = {}, {}, {}, {}
  for size in settings.aggregation_sizes:
    for clients in settings.aggregation_clients:
      key = f'{size}x{clients}'
      seeds = list(range(settings.seed, settings.seed + clients))
      _log(f'aggregation {key}: compiling {len(factories)} probes')
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
      ratio[key] = timing.ratios_to(BASELINE, medians)
      # What each candidate adds to a call of the mean, in seconds. (A ratio of times net of the generation
      # would divide by the mean's own cost, a sum, which is about the generation's and so lost in its noise.)
      extra[key] = {name: t - medians[BASELINE] for name, t in medians.items()}
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


def _generated_cifar_setup(settings: Settings, model: str):
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


def bench_client_execution(settings: Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
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
    fixed = (ids, [round_loop.client_dataset(train, c, local_epochs=1, batch_size=BATCH_SIZE, seed=settings.seed,
                                             round_num=1) for c in ids])
    runners, build_seconds, compile_seconds, devices = {}, {}, {}, {}
    initial_weights = None
    for mode in client_execution.MODES:
      _log(f'client_execution {model}: building and compiling {mode}')
      method, build = timing.timed_call(lambda m=mode: methods.build(
          model_fn, 'fedavg', BASELINE, algorithm_config=ALGORITHM_CONFIG, client_execution=m), worker_pids)
      state = round_loop.seeded_initial_state(method.process, build_keras, settings.seed)
      if initial_weights is None:
        initial_weights = method.process.get_model_weights(state)
      runner = round_loop.RoundLoop(method, method.process.set_model_weights(state, initial_weights), lambda _: fixed)
      _, first = timing.timed_call(runner.step, worker_pids)
      runners[mode], build_seconds[mode], compile_seconds[mode] = runner, build.wall, first.wall
    _log(f'client_execution {model}: {settings.client_execution_repetitions} interleaved sweeps')
    samples = timing.interleaved_times({m: r.step for m, r in runners.items()},
                                           settings.client_execution_repetitions, worker_pids=worker_pids)
    timings = {m: timing.summarize(s) for m, s in samples.items()}
    devices = {m: r.method.client_devices() for m, r in runners.items()}
    ratio[model] = timings['local']['seconds'] / timings['worker']['seconds']
    cpu_ratio[model] = timings['local']['cpu_seconds'] / timings['worker']['cpu_seconds']
    details[model] = collections.OrderedDict(
        setup=dict(data=data_name, clients=len(ids), examples=int(sum(train.num_examples(c) for c in ids)),
                   batch_size=BATCH_SIZE, local_epochs=1, aggregator=BASELINE,
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


def bench_scaling(settings: Settings, worker: runtime.WorkerProcess) -> list[dict[str, Any]]:
  total_clients = max(settings.scaling_clients)
  data, build_keras, model_fn = _digits_setup(settings, total_clients)
  ids = data.train.client_ids
  pids = {'python': os.getpid(), 'worker': worker.pid}
  rows = []
  for name in settings.scaling_aggregators:
    method = build_method(parse_candidate(name), model_fn, total_clients)
    runner = round_loop.RoundLoop(method, round_loop.seeded_initial_state(method.process, build_keras, settings.seed),
                              _project_inputs(data, settings, min(settings.scaling_clients)))
    # Compile on the smallest round: one computation serves every number of clients (the cardinality is an
    # argument of the call, not of the compiled computation).
    _log(f'scaling {name}: compiling')
    _, first = timing.timed_call(runner.step, [worker.pid])
    for clients in sorted(settings.scaling_clients):
      _log(f'scaling {name}: {clients} clients per round')
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
          peak_rss_gib={k: (v or 0) / GIB for k, v in memory.result['peak_rss_bytes'].items()},
          peak_total_gib=memory.result['peak_total_bytes'] / GIB,
          sampled_peak_total_gib=memory.result['sampled_peak_total_bytes'] / GIB,
      ))
  return rows


# ----------------------------------------------------------------------------------------------------------------
# Targets, JSON and Markdown.


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  targets = []
  for name, ratio in result.get('round_time_ratio', {}).items():
    limit = round_target(parse_candidate(name))
    if limit is not None:
      targets.append(dict(target=f'{name} round time <= {limit:.2f}x mean', value=ratio, met=ratio <= limit,
                          cpu_value=result.get('round_cpu_ratio', {}).get(name)))
  if 'pipeline_throughput_ratio' in result:
    value = result['pipeline_throughput_ratio']
    targets.append(dict(target=f'project mean pipeline throughput >= {PIPELINE_TARGET:.2f}x stock FedAvg',
                        value=value, met=value >= PIPELINE_TARGET))
  for row in result.get('scaling', []):
    if row['clients_per_round'] == 500:
      targets.append(dict(target=f'500 clients per round ({row["aggregator"]}) within {MEMORY_LIMIT_GIB:.0f} GiB',
                          value=row['peak_total_gib'], met=row['peak_total_gib'] <= MEMORY_LIMIT_GIB))
  return targets


def _fmt(value: float, digits: int = 3) -> str:
  return f'{value:.{digits}f}'


def to_markdown(result: dict[str, Any]) -> str:
  lines = [f'# Benchmark ({result["environment"]["mode"]}, {result["environment"]["date"]})', '',
           f'Command: `{result["environment"]["command"]}`  ',
           f'Machine: {result["environment"]["cpus"]} CPUs, load average {result["environment"]["load_before"]} '
           f'before, {result["environment"]["load_after"]} after; TFF {result["environment"]["tff"]}.', '']
  if 'rounds' in result['details']:
    rounds = result['details']['rounds']
    setup = rounds['setup']
    lines += [f'## Round time (`training.engine.methods`, digits, model {setup["model"]}, {setup["loop"]} loop)', '',
              f'{setup["clients"]} clients, {setup["examples"]} examples, batch {setup["batch_size"]}, '
              f'{setup["repetitions"]} interleaved repetitions; medians. CPU columns: seconds of CPU per round in '
              'this Python process and in the TFF worker.', '',
              '| process | round s | ratio to mean | CPU ratio to mean | Python CPU s | worker CPU s | build s | '
              'first call s |', '|---' * 8 + '|']
    for name, times in rounds['timings'].items():
      ratio, cpu_ratio = result['round_time_ratio'].get(name), result['round_cpu_ratio'].get(name)
      lines.append(f'| {name} | {_fmt(times["seconds"])} | {_fmt(ratio, 2) if ratio is not None else "-"} | '
                   f'{_fmt(cpu_ratio, 2) if cpu_ratio is not None else "-"} | '
                   f'{_fmt(times["python_cpu_seconds"])} | {_fmt(times["worker_cpu_seconds"])} | '
                   f'{_fmt(rounds["build_seconds"][name], 1)} | {_fmt(rounds["compile_seconds"][name], 1)} |')
    lines += ['', f'Project mean pipeline throughput / stock FedAvg: '
              f'**{_fmt(result["pipeline_throughput_ratio"], 3)}**. Stock FedAvg with '
              f'`loop_implementation=DATASET_ITERATOR` / with the default `DATASET_REDUCE`: '
              f'**{_fmt(result["iterator_loop_speedup"], 2)}x** the throughput.', '']
  if 'aggregation' in result['details']:
    agg = result['details']['aggregation']
    names = list(next(iter(result['aggregation_time_ratio'].values())).keys())
    lines += ['## Aggregation process alone (values generated in the worker)', '',
              'Ratio of median call time to `mean` (TFF `MeanFactory`); in brackets the milliseconds it adds to '
              'a call of the mean. `gen s`: generating the client values alone. Config: floats x clients.', '',
              '| config | mean s | gen s | ' + ' | '.join(n for n in names if n != BASELINE) + ' |',
              '|---' * (len(names) + 2) + '|']
    for key, ratios in result['aggregation_time_ratio'].items():
      cells = [f'{_fmt(ratios[n], 2)} ({1000 * agg["aggregation_extra_seconds"][key][n]:+.0f})'
               for n in names if n != BASELINE]
      lines.append(f'| {key} | {_fmt(agg["timings"][key][BASELINE]["seconds"])} | '
                   f'{_fmt(agg["timings"][key]["generation_vector"]["seconds"])} | ' + ' | '.join(cells) + ' |')
    lines.append('')
  if result.get('scaling'):
    lines += [f'## Scaling with clients per round (digits over {result["scaling"][0]["total_clients"]} clients)', '',
              'Peak resident memory over the rounds of each row (VmHWM reset before the row), of this Python '
              'process, of the TFF worker, and their sum.', '',
              '| aggregator | clients/round | examples | round s | Python CPU s | worker CPU s | '
              'worker CPU ms/client | peak Python GiB | peak worker GiB | peak total GiB |', '|---' * 10 + '|']
    for row in result['scaling']:
      lines.append(f'| {row["aggregator"]} | {row["clients_per_round"]} | {row["examples_per_round"]} | '
                   f'{_fmt(row["seconds"])} | {_fmt(row["python_cpu_seconds"])} | '
                   f'{_fmt(row["worker_cpu_seconds"])} | {_fmt(1000 * row["worker_cpu_seconds_per_client"], 1)} | '
                   f'{_fmt(row["peak_rss_gib"]["python"], 2)} | {_fmt(row["peak_rss_gib"]["worker"], 2)} | '
                   f'{_fmt(row["peak_total_gib"], 2)} |')
    lines.append('')
  if 'client_execution' in result['details']:
    section = result['details']['client_execution']
    lines += ['## Where the clients train: TFF worker vs this process (`--client_execution`)', '',
              f'FedAvg with the mean, one round; `local` / `worker` round time, medians of interleaved repetitions. '
              f'Local mode: {section["device_line"]}', '',
              '| model | data | clients x examples | worker round s | local round s | local / worker | '
              'CPU ratio | worker-mode devices | local-mode devices |', '|---' * 9 + '|']
    for model, row in section['models'].items():
      t = row['timings']
      lines.append(f'| {model} ({row["setup"]["parameters"]} params) | {row["setup"]["data"]} | '
                   f'{row["setup"]["clients"]} x {row["setup"]["examples"] // row["setup"]["clients"]} | '
                   f'{_fmt(t["worker"]["seconds"])} | {_fmt(t["local"]["seconds"])} | '
                   f'**{_fmt(result["client_execution_time_ratio"][model], 2)}** | '
                   f'{_fmt(section["client_execution_cpu_ratio"][model], 2)} | '
                   f'{"; ".join(row["client_devices"]["worker"])} | {"; ".join(row["client_devices"]["local"])} |')
    lines.append('')
  if result['targets']:
    lines += ['## Targets', '', 'Wall-time ratios decide; the CPU-time ratio (Python + worker) is shown beside them '
              'because it is less disturbed by other work on the machine.', '',
              '| target | value | met | CPU ratio |', '|---|---|---|---|']
    lines += [f'| {t["target"]} | {_fmt(t["value"])} | {"yes" if t["met"] else "**no**"} | '
              f'{_fmt(t["cpu_value"]) if t.get("cpu_value") is not None else "-"} |' for t in result['targets']]
    lines.append('')
  return '\n'.join(lines)


def _json_default(value):
  if isinstance(value, (np.floating, np.integer)):
    return value.item()
  raise TypeError(f'not JSON serializable: {type(value)}')


# ----------------------------------------------------------------------------------------------------------------
# Command line.

FLAGS = flags.FLAGS
_INT_LISTS = ('aggregation_sizes', 'aggregation_clients', 'scaling_clients')
_REPETITIONS = ('round_repetitions', 'aggregation_repetitions', 'scaling_repetitions',
                'client_execution_repetitions', 'client_execution_clients', 'client_execution_examples')


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The program's flags (defined when it runs, or into a test's `FlagValues`: importing defines none)."""
  f = flag_values
  flags.DEFINE_bool('quick', False, 'Smaller run: a few minutes.', flag_values=f)
  flags.DEFINE_bool('smoke', False, 'Tiny run of every section and key (for the tests).', flag_values=f)
  flags.DEFINE_string('output', os.path.join(_ROOT, 'outputs', 'bench', 'bench.json'),
                      'JSON path; the Markdown table goes beside it as bench.md (and profile_NAME.txt).',
                      flag_values=f)
  flags.DEFINE_list('sections', None, f'Subset of {",".join(SECTIONS)} (default: all).', flag_values=f)
  flags.DEFINE_list('aggregators', None, 'Candidates: training.engine.methods names, each optionally NAME+setting=value+... '
                    f'(mean is always kept; default: {",".join(AGGREGATORS)}).', flag_values=f)
  flags.DEFINE_enum('model', None, list(models.MODELS), 'Model of the digits setup (default cnn).', flag_values=f)
  flags.DEFINE_integer('round_repetitions', None, 'Interleaved sweeps of the rounds section.', flag_values=f)
  flags.DEFINE_list('aggregation_sizes', None, 'Model sizes in floats, e.g. 10000,100000.', flag_values=f)
  flags.DEFINE_list('aggregation_clients', None, 'Clients of the aggregation probes, e.g. 10,100.', flag_values=f)
  flags.DEFINE_integer('aggregation_repetitions', None, 'Interleaved sweeps of the aggregation section.',
                       flag_values=f)
  flags.DEFINE_list('scaling_clients', None, 'Clients per round of the scaling section, e.g. 10,100,500.',
                    flag_values=f)
  flags.DEFINE_list('scaling_aggregators', None, 'Candidates of the scaling section (entries as --aggregators).',
                    flag_values=f)
  flags.DEFINE_integer('scaling_repetitions', None, 'Rounds per row of the scaling section.', flag_values=f)
  flags.DEFINE_list('client_execution_models', None, 'Models of the client_execution section (resnet18_gn: on '
                    'generated CIFAR-10-shaped examples; others: the digits), e.g. cnn,resnet18_gn.', flag_values=f)
  flags.DEFINE_integer('client_execution_clients', None, 'Clients of the client_execution section.', flag_values=f)
  flags.DEFINE_integer('client_execution_examples', None, 'Generated examples per client of the client_execution '
                       'section (smaller: faster).', flag_values=f)
  flags.DEFINE_integer('client_execution_repetitions', None, 'Interleaved sweeps of the client_execution section.',
                       flag_values=f)
  flags.DEFINE_list('profile', [], 'Round-section processes to profile with cProfile (the Python main thread: it '
                    'shows how long Python waits for the worker), e.g. rfa.', flag_values=f)
  flags.DEFINE_integer('seed', None, 'Seed of the partition, the initial model and the client order (default 0).',
                       flag_values=f)


def mode_from_flags(flag_values: flags.FlagValues = FLAGS) -> str:
  if flag_values.quick and flag_values.smoke:
    raise ValueError('--quick and --smoke exclude each other')
  return 'smoke' if flag_values.smoke else 'quick' if flag_values.quick else 'full'


def settings_from_flags(flag_values: flags.FlagValues = FLAGS) -> Settings:
  """The preset (full, --quick or --smoke) with the explicitly given flags on top; ValueError names a bad flag."""
  settings = MODES[mode_from_flags(flag_values)]
  overrides: dict[str, Any] = {}
  for name in ('sections', 'aggregators', 'scaling_aggregators', 'client_execution_models'):
    if flag_values[name].value is not None:
      overrides[name] = tuple(dict.fromkeys(flag_values[name].value))  # Repeated entries once.
  for name in _INT_LISTS:
    if flag_values[name].value is not None:
      try:
        overrides[name] = tuple(int(v) for v in flag_values[name].value)
      except ValueError:
        raise ValueError(f'--{name} must be positive integers, got {flag_values[name].value}') from None
  for name in ('model', 'seed') + _REPETITIONS:
    if flag_values[name].value is not None:
      overrides[name] = flag_values[name].value
  if 'aggregators' in overrides and BASELINE not in overrides['aggregators']:
    overrides['aggregators'] = (BASELINE,) + overrides['aggregators']
  settings = dataclasses.replace(settings, **overrides)
  for section in settings.sections:
    if section not in SECTIONS:
      raise ValueError(f'--sections: unknown section {section!r}; expected some of {SECTIONS}')
  for flag, entries in (('aggregators', settings.aggregators), ('scaling_aggregators', settings.scaling_aggregators)):
    for entry in entries:
      try:
        probe_factory(parse_candidate(entry), PROBE_VALUE_BOUND)  # Builds the factory: checks its settings.
      except ValueError as e:
        raise ValueError(f'--{flag}: {e}') from None
  for name in _REPETITIONS:
    if getattr(settings, name) < 1:
      raise ValueError(f'--{name} must be positive, got {getattr(settings, name)}')
  for name in settings.client_execution_models:
    if name not in models.MODELS or name == 'char_lstm':
      raise ValueError(f'--client_execution_models: unknown image model {name!r}; expected some of '
                       f'{[m for m in models.MODELS if m != "char_lstm"]}')
  for name in _INT_LISTS:
    values = getattr(settings, name)
    if not values or min(values) < 1:
      raise ValueError(f'--{name} must be positive integers, got {list(values)}')
  if max(settings.scaling_clients) > DIGITS_TRAIN_EXAMPLES:
    raise ValueError(f'--scaling_clients: the digits training split holds {DIGITS_TRAIN_EXAMPLES} examples, so at '
                     f'most {DIGITS_TRAIN_EXAMPLES} clients')
  for name in flag_values.profile:
    if name not in settings.aggregators + PIPELINE:
      raise ValueError(f'--profile: {name!r} is not a process of the rounds section '
                       f'({", ".join(settings.aggregators + PIPELINE)})')
  return settings


def run(settings: Settings, mode: str, profile: Sequence[str] = (), command: str = '') -> dict[str, Any]:
  worker = runtime.set_simulation_context()
  started = time.monotonic()
  result: dict[str, Any] = collections.OrderedDict(
      environment=collections.OrderedDict(
          mode=mode, date=datetime.datetime.now().isoformat(timespec='seconds'), command=command,
          cpus=os.cpu_count(), load_before=[round(x, 2) for x in os.getloadavg()], tff=tff.__version__,
          tensorflow=tf.__version__, settings=dataclasses.asdict(settings)),
      round_time_ratio={}, aggregation_time_ratio={}, scaling=[], details={})
  if 'rounds' in settings.sections:
    rounds = bench_rounds(settings, [worker.pid], profile)
    result['round_time_ratio'] = rounds['round_time_ratio']
    result['round_cpu_ratio'] = rounds['round_cpu_ratio']
    result['pipeline_throughput_ratio'] = rounds['pipeline_throughput_ratio']
    result['iterator_loop_speedup'] = rounds['iterator_loop_speedup']
    result['compile_seconds'] = {'rounds': rounds['compile_seconds']}
    result['details']['rounds'] = rounds
  if 'aggregation' in settings.sections:
    aggregation = bench_aggregation(settings, [worker.pid])
    result['aggregation_time_ratio'] = aggregation['aggregation_time_ratio']
    result.setdefault('compile_seconds', {})['aggregation'] = aggregation['compile_seconds']
    result['details']['aggregation'] = aggregation
  if 'scaling' in settings.sections:
    result['scaling'] = bench_scaling(settings, worker)
    result.setdefault('compile_seconds', {})['scaling'] = {
        row['aggregator']: row['compile_seconds'] for row in result['scaling']}
  if 'client_execution' in settings.sections:
    section = bench_client_execution(settings, [worker.pid])
    result['client_execution_time_ratio'] = section['client_execution_time_ratio']
    result['details']['client_execution'] = section
  result['targets'] = check_targets(result)
  result['environment']['load_after'] = [round(x, 2) for x in os.getloadavg()]
  result['environment']['seconds'] = time.monotonic() - started
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  try:
    mode = mode_from_flags()
    settings = settings_from_flags()
  except ValueError as e:
    raise app.UsageError(f'invalid flags: {e}') from None
  command = ' '.join([os.path.relpath(sys.executable, _ROOT), '-m', 'training.bench', *sys.argv[1:]])
  result = run(settings, mode, FLAGS.profile, command)
  directory = os.path.dirname(os.path.abspath(FLAGS.output))
  os.makedirs(directory, exist_ok=True)
  with open(FLAGS.output, 'w') as f:
    json.dump(result, f, indent=2, default=_json_default)
  markdown_path = os.path.join(directory, 'bench.md')
  with open(markdown_path, 'w') as f:
    f.write(to_markdown(result))
  for name, text in result['details'].get('rounds', {}).get('profiles', {}).items():
    with open(os.path.join(directory, f'profile_{name}.txt'), 'w') as f:
      f.write(text)
  print(to_markdown(result))
  _log(f'wrote {FLAGS.output} and {markdown_path} in {result["environment"]["seconds"]:.0f} s')


if __name__ == '__main__':
  define_flags()
  app.run(main)
