"""The benchmark's settings, its entries (candidates of the method registry) and its four sections.

* `rounds`: a round of every candidate, interleaved, as ratios to the mean (and TFF's stock FedAvg);
* `aggregation`: the aggregation process alone, on values generated in the worker;
* `client_execution`: clients trained in the TFF worker vs in this process;
* `scaling`: round time and memory against clients per round;
* `floor`: a FedAvg round of the project (datasets built in the worker, and sent), TFF's stock FedAvg and the
  in-graph floor (`training.bench.floor`: the same arithmetic as plain TF in this process), as ratios to the floor.

Two more, `breakdown` and `peers` (a small round's time per TFF invocation; the round against plain TF), are in
`training.bench.small_rounds`, with this module's settings.

`training.bench.cli` runs them, checks the targets and writes JSON and Markdown; `training.bench.timing` has the
timing tools. See `training.bench.cli` for the command line.
"""

from __future__ import annotations

import collections
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma import runtime
from tff_gma.data import client_data as client_data_lib
from tff_gma.data import loaders
from training import config as config_lib
from training.bench import floor as floor_lib
from training.bench import timing
from training.engine import client_execution
from training.engine import fedavg_family
from training.engine import methods
from training.engine import registry
from training.engine import worker_datasets
from training.runner import round_loop

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = 'mean'
# Parameter variants benchmarked by default besides every aggregator of `registry.AGGREGATORS` (the targets
# concern secure GMA and RFA's number of passes).
VARIANTS = ('gma+secure', 'gma_binary+secure', 'rfa+num_passes=1', 'rfa+num_passes=5')
AGGREGATORS = tuple(registry.AGGREGATORS) + VARIANTS
PIPELINE = ('stock_fedavg', 'stock_fedavg_iterator', 'project_pipeline')
SECTIONS = ('rounds', 'aggregation', 'scaling', 'client_execution', 'floor', 'breakdown', 'peers', 'runner')
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
  # floor: models, each on its data shape (FLOOR_SHAPES), clients x generated examples, the batch, sweeps.
  floor_models: tuple[str, ...] = ('cnn', 'lenet')
  floor_clients: int = 10
  floor_examples: tuple[int, ...] = (144, 600)  # Per model: the digits' 1,437 / 10; Fashion-MNIST's 6,000 / 10.
  floor_batch_size: int = 16
  floor_repetitions: int = 7
  # breakdown and peers (`training.bench.small_rounds`): (model, generated examples per client) cases, on the floor's
  # shapes and batch; clients; sweeps.
  breakdown_cases: tuple[tuple[str, int], ...] = (('lenet', 120), ('cnn', 144))
  peers_cases: tuple[tuple[str, int], ...] = (('lenet', 120), ('lenet', 600), ('cnn', 144))
  small_rounds_clients: int = 10
  breakdown_repetitions: int = 9
  peers_repetitions: int = 7
  # runner (`training.bench.runner_runs`): `python -m training.run` at its defaults for `runner_default_rounds`,
  # and shaped as the label500 study cell for `runner_study_rounds`, beside that many floor rounds; repetitions;
  # smoke: the digits and a logistic model instead of Fashion-MNIST and LeNet.
  runner_default_rounds: int = 30
  runner_study_rounds: int = 150
  runner_repetitions: int = 2
  runner_smoke: bool = False
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
    floor_repetitions=3,
    breakdown_repetitions=5,
    peers_repetitions=5,
    runner_repetitions=1,
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
    floor_models=('logistic',),
    floor_clients=2,
    floor_examples=(20,),
    floor_repetitions=1,
    breakdown_cases=(('logistic', 20),),
    peers_cases=(('logistic', 20),),
    small_rounds_clients=2,
    breakdown_repetitions=1,
    peers_repetitions=1,
    runner_default_rounds=2,
    runner_study_rounds=3,
    runner_repetitions=1,
    runner_smoke=True,
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
  try:
    candidate = Candidate(entry, algorithm, aggregator, config_lib.AggregatorParams(**overrides['aggregator']),
                          config_lib.MethodParams(**overrides['method']))
    # A setting the method does not read is refused, as by the runner (`registry.check_settings`).
    registry.check_settings(algorithm, aggregator, registry.settings_of(
        ALGORITHM_CONFIG, candidate.aggregator_params, candidate.method_params))
  except ValueError as e:
    raise ValueError(f'{entry!r}: {e}') from None
  return candidate


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
    return registry.probe(candidate.aggregator, params, candidate.method_params)
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
# Section: a round against its in-graph floor.

FLOOR_SHAPES = {'cnn': (8, 8, 1), 'logistic': (8, 8, 1), 'lenet': (28, 28, 1)}  # The digits' and Fashion-MNIST's.
FLOOR_TARGET = 1.5  # Issue 26: a round within 1.5x its in-graph floor.
LOOP_SPEEDUP_TARGET = 2.0  # and twice the throughput of the loop before (datasets sent every round, TFF's loop).
FLOOR_ENTRIES = ('floor', 'floor_in_worker', 'project_worker_datasets', 'project_default_threads',
                 'project_iterator', 'project_sent_datasets_iterator', 'stock_fedavg_iterator', 'project_one_batch')
# On a second worker with TensorFlow's default intra-op threads (one per core), as every worker ran before
# 2026-11-24 (runtime.DEFAULT_INTRA_OP_THREADS): project_default_threads (the default round otherwise) and the loop
# before. The others run on the bench's worker (runtime's default, one thread).
_DEFAULT_THREADS_ENTRIES = ('project_default_threads', 'project_sent_datasets_iterator')
# floor_in_worker: the floor's graph as one TFF computation run by the worker (what the worker's way of running TF
# costs apart from any round). project_worker_datasets: the runner's default (datasets built in the worker, the
# in-graph client loop); project_iterator: the same with TFF's iterator loop; project_sent_datasets_iterator: the
# loop before (datasets sent every round, TFF's iterator loop, the worker's default threads).
# project_one_batch: the project's round with each client holding one batch of examples: what a round costs beyond
# its clients' epochs (state to and from the worker, broadcast, aggregation, the server update, metrics, dataset
# set-up), so that `round - one batch` is the part that grows with the examples, comparable to the floor.


def _in_context(context, fn: Callable[[], Any]) -> Callable[[], Any]:
  """`fn` run with `context` as TFF's context (e.g. on another worker)."""
  def call():
    with tff.framework.get_context_stack().install(context):
      return fn()
  return call


def bench_floor(settings: Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  """Per model: a FedAvg/mean round of `floor_clients` clients of generated examples, one local epoch, interleaved:
  the floor (in this process and in the worker), the runner's round as it runs by default, on a worker with
  TensorFlow's default threads, with the iterator loop, and as it ran before (sent datasets, iterator loop, default
  threads), TFF's stock iterator FedAvg and a one-batch round; each as a
  ratio to the floor (`round_to_floor`), and the default's speed-up over the loop before (`loop_before_speedup`)."""
  if len(settings.floor_examples) != len(settings.floor_models):
    raise ValueError('floor_examples needs one count per floor model')
  config = ALGORITHM_CONFIG
  out = collections.OrderedDict(round_to_floor={}, loop_before_speedup={}, models={})
  for model, examples in zip(settings.floor_models, settings.floor_examples):
    shape, rng = FLOOR_SHAPES[model], np.random.default_rng(settings.seed)
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
    initial = None
    calls, compile_seconds = {}, {}
    default_threads = runtime.WorkerProcess(intra_op_threads=0)
    try:
      default_threads_context = runtime.create_simulation_context(default_threads.start())
      pids = (*worker_pids, default_threads.pid)
      for name in FLOOR_ENTRIES[2:]:
        if name == 'stock_fedavg_iterator':
          method, round_inputs = methods.Method(_stock_process(name, model_fn)), lambda _: (ids, stock_datasets)
        else:
          files = {'project_worker_datasets': placement, 'project_default_threads': placement,
                   'project_iterator': placement, 'project_one_batch': one_batch_placement}.get(name)
          loop_config = dataclasses.replace(config, client_loop='iterator' if name.endswith('iterator') else 'in_graph')
          method = methods.build(model_fn, 'fedavg', BASELINE, algorithm_config=loop_config,
                                 client_sources=None if files is None else files.client_sources)
          if files is not None:
            method.place_datasets_in_worker(files)
          round_inputs = one_batch_inputs if name == 'project_one_batch' else inputs
        state = round_loop.seeded_initial_state(method.process, build_keras, settings.seed)
        if initial is None:
          initial = method.process.get_model_weights(state)
        loop = round_loop.RoundLoop(method, method.process.set_model_weights(state, initial), round_inputs)
        step = _in_context(default_threads_context, loop.step) if name in _DEFAULT_THREADS_ENTRIES else loop.step
        _log(f'floor {model}: building and compiling {name}')
        _, first = timing.timed_call(step, pids)
        calls[name], compile_seconds[name] = step, first.wall
      for name, build in (('floor', floor_lib.build_floor), ('floor_in_worker', floor_lib.build_floor_in_worker)):
        calls[name] = build(
            build_keras, input_spec, list(arrays.values()), batch_size=settings.floor_batch_size,
            client_lr=config.client_lr, momentum=config.client_momentum, initial_weights=list(initial.trainable))
        _, first = timing.timed_call(calls[name], pids)
        compile_seconds[name] = first.wall
      _log(f'floor {model}: {settings.floor_repetitions} interleaved sweeps')
      samples = timing.interleaved_times({n: calls[n] for n in FLOOR_ENTRIES}, settings.floor_repetitions,
                                         worker_pids=pids)
    finally:
      default_threads.stop()
      placement.close()
      one_batch_placement.close()
    timings = {n: timing.summarize(s) for n, s in samples.items()}
    floor_seconds = timings['floor']['seconds']
    out['round_to_floor'][model] = {n: timings[n]['seconds'] / floor_seconds for n in FLOOR_ENTRIES[1:]}
    # The part of the project's round that grows with the examples, over the floor's.
    out['round_to_floor'][model]['project_beyond_one_batch'] = (
        timings['project_worker_datasets']['seconds'] - timings['project_one_batch']['seconds']) / floor_seconds
    out['loop_before_speedup'][model] = (timings['project_sent_datasets_iterator']['seconds']
                                         / timings['project_worker_datasets']['seconds'])
    out['models'][model] = collections.OrderedDict(
        setup=dict(data=f'generated {list(shape)}, 10 classes', clients=len(ids), examples_per_client=examples,
                   batch_size=settings.floor_batch_size, local_epochs=1, aggregator=BASELINE,
                   repetitions=settings.floor_repetitions),
        timings=timings, compile_seconds=compile_seconds,
        samples={n: [dataclasses.asdict(x) for x in ss] for n, ss in samples.items()})
  return out
