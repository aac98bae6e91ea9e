"""Aggregator overhead and client scaling in TFF's runtime, as ratios to TFF's `MeanFactory` in the same run.

    .venv/bin/python scripts/bench.py --quick          # about 2-3 minutes
    .venv/bin/python scripts/bench.py                  # the full benchmark (run it on a quiet machine)

Three sections, each written into the JSON (`--output`, default outputs/bench/bench.json) and a Markdown table
beside it (`bench.md`):

* `rounds`: one round of `tff.learning.algorithms.build_weighted_fed_avg` on the digits CNN with TFF's
  `MeanFactory` (`mean`) and with each project aggregator (`elastic`: `tff_gma.learning.build_elastic_fed_avg`),
  on the same client datasets, as `round_time_ratio` (median round time / median of `mean`). Also the
  project's mean pipeline (the experiment runner's process, `simulation.build_learning_process` with the
  registry's `mean`, and its per-round client sampling and dataset construction) against TFF's stock
  `build_weighted_fed_avg` with the same optimizers and plain batched datasets: `pipeline_throughput_ratio` =
  stock round time / project round time (> 1: the project's pipeline is faster). And TFF's stock FedAvg with
  `loop_implementation=DATASET_ITERATOR` (`stock_fedavg_iterator`, same weights after a round): the client
  training loop as a `tf.while_loop` over an iterator instead of `tf.data.Dataset.reduce`, whose per-batch
  function calls dominate the worker's time for small models (`iterator_loop_speedup`).
* `aggregation`: the aggregation process alone, for models of 1e4, 1e5, 1e6 floats and 10 / 100 clients, with
  the client values generated inside the TFF worker (`tff_gma.benchmarks.aggregation_probe`):
  `aggregation_time_ratio[config][aggregator]`. The generation of the client values is the same for every
  aggregator of a config (Elastic's values are twice as many: an update and a sensitivity) and is timed on its
  own (`generation_vector`, `generation_update_and_sensitivity`); `aggregation_extra_seconds` is what each
  aggregator adds to a call of the mean (the mean being a sum, its cost is of the order of the generation's).
* `scaling`: round time and peak resident memory (this process and the TFF worker) against clients per round
  (10, 50, 100, 500) of the digits set split over 500 clients (about 3 examples each).

Method: everything is compiled first (the first call of each computation, timed and reported as
`compile_seconds`), then the candidates run in interleaved sweeps (order rotated each sweep) on the same
inputs, and the medians are compared. Each sample also records the CPU seconds of this Python process and of
the TFF worker (from /proc), which splits a round's time into the worker's work, Python's (tracing,
serialization, gRPC) and waiting; `round_cpu_ratio` is the ratio of those CPU seconds, steadier than wall time
when other work shares the machine. `--profile NAME` adds a cProfile of the Python side of NAME's rounds
(`profile_NAME.txt`).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import collections
import cProfile
import dataclasses
import datetime
import io
import json
import pstats
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import benchmarks
from tff_gma import learning
from tff_gma import models
from tff_gma import runtime
from tff_gma import simulation
from tff_gma.data import loaders
from training import registry

BASELINE = 'mean'
AGGREGATORS = ('mean', 'federated_mean', 'gma_soft', 'gma_binary', 'gma_soft_secure', 'gma_binary_secure',
               'rfa_1', 'rfa_3', 'rfa_5', 'rfa_one_step', 'elastic')
PIPELINE = ('stock_fedavg', 'stock_fedavg_iterator', 'project_pipeline')
SECTIONS = ('rounds', 'aggregation', 'scaling')
GIB = 1024**3
MEMORY_LIMIT_GIB = 24.0
# Targets of issue 8 (ratios to `mean` in the same run); `None` in a row means the quantity is a throughput.
ROUND_TARGETS = (('gma_', 1.10), ('rfa_3', 1.5), ('elastic', 1.3))
PIPELINE_TARGET = 0.95

# Hyperparameters of the digits setup (the runner's defaults).
CLIENT_LR = 0.05
BATCH_SIZE = 16
SECURE_VALUE_BOUND = 1.0  # Per-coordinate bound of a model update for the secure variants (digits CNN: |d| << 1).
PROBE_VALUE_BOUND = 4.0  # The probe's values are standard normal.
PROBE_WEIGHT_BOUND = 5.0  # The probe's weights are 1..5 (`benchmarks.client_weight`).


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one run measures; `--quick` and `--smoke` pick smaller ones."""
  sections: tuple[str, ...] = SECTIONS
  aggregators: tuple[str, ...] = AGGREGATORS
  model: str = 'cnn'
  loop: str = 'reduce'  # TFF's client training loop for the FedAvg processes: 'reduce' (TFF's default), 'iterator'.
  round_clients: int = 10
  round_repetitions: int = 7
  aggregation_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
  aggregation_clients: tuple[int, ...] = (10, 100)
  aggregation_repetitions: int = 5
  scaling_clients: tuple[int, ...] = (10, 50, 100, 500)
  scaling_aggregators: tuple[str, ...] = ('mean', 'gma_soft', 'rfa_3')
  scaling_repetitions: int = 3
  seed: int = 0


QUICK = Settings(
    round_repetitions=3,
    aggregation_sizes=(10_000, 1_000_000),
    aggregation_clients=(10,),
    aggregation_repetitions=3,
    scaling_clients=(10, 100, 500),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
)
# For the test: every section and key, on sizes that take seconds.
SMOKE = Settings(
    aggregators=('mean', 'gma_soft'),
    model='logistic',
    round_clients=3,
    round_repetitions=1,
    aggregation_sizes=(1000,),
    aggregation_clients=(3,),
    aggregation_repetitions=1,
    scaling_clients=(2, 4),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
)


def _log(message: str) -> None:
  print(f'[bench {time.strftime("%H:%M:%S")}] {message}', file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Aggregators.


def weighted_factory(name: str, value_bound: float, weight_bound: float) -> tff.aggregators.WeightedAggregationFactory:
  """The aggregation factory called `name` (one of `AGGREGATORS`); bounds for the secure variants."""
  if name == 'mean':
    return tff.aggregators.MeanFactory()
  if name == 'federated_mean':
    return aggregators.FederatedMeanFactory()
  if name.startswith('gma_'):
    mask = name.split('_')[1]
    secure = name.endswith('_secure')
    return aggregators.GradientMaskedFactory(
        tau=0.4, mask=mask, secure=secure, value_bound=value_bound if secure else None, weight_bound=weight_bound)
  if name == 'rfa_one_step':
    return aggregators.GeometricMedianFactory(one_step=True)
  if name.startswith('rfa_'):
    return aggregators.GeometricMedianFactory(num_passes=int(name.split('_')[1]))
  if name == 'elastic':
    return aggregators.ElasticFactory(tau=0.5)
  raise ValueError(f'aggregators: unknown aggregator {name!r}; expected one of {AGGREGATORS}')


LOOPS = {'reduce': tff.learning.LoopImplementation.DATASET_REDUCE,
         'iterator': tff.learning.LoopImplementation.DATASET_ITERATOR}


def learning_process(name: str, model_fn, weight_bound: float,
                     loop: str = 'reduce') -> tff.learning.templates.LearningProcess:
  """FedAvg (client SGD with momentum, server SGD at 1) with aggregator `name`; Elastic's own composed process.

  `loop` picks TFF's client training loop for the FedAvg processes (Elastic has its own client work; the
  `stock_*` and `project_pipeline` processes keep what they are defined with).
  """
  client_optimizer = tff.learning.optimizers.build_sgdm(CLIENT_LR, momentum=simulation.CLIENT_MOMENTUM)
  server_optimizer = tff.learning.optimizers.build_sgdm(1.0)
  if name == 'elastic':
    return learning.build_elastic_fed_avg(model_fn, client_optimizer, server_optimizer, tau=0.5)
  if name == 'stock_fedavg':  # TFF as a user gets it: default aggregator (MeanFactory) and server optimizer.
    return tff.learning.algorithms.build_weighted_fed_avg(model_fn, client_optimizer_fn=client_optimizer)
  if name == 'stock_fedavg_iterator':  # The same with TFF's other client training loop (see the module doc).
    return tff.learning.algorithms.build_weighted_fed_avg(
        model_fn, client_optimizer_fn=client_optimizer,
        loop_implementation=tff.learning.LoopImplementation.DATASET_ITERATOR)
  if name == 'project_pipeline':  # What the experiment runner builds for --aggregator=mean.
    return simulation.build_learning_process(model_fn, simulation.AlgorithmConfig(), registry.build('mean'))
  return tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=client_optimizer, server_optimizer_fn=server_optimizer,
      model_aggregator=weighted_factory(name, SECURE_VALUE_BOUND, weight_bound), loop_implementation=LOOPS[loop])


# ----------------------------------------------------------------------------------------------------------------
# Section: rounds.


@dataclasses.dataclass
class _Candidate:
  """A learning process with its own (advancing) state and a way to make the round's client datasets."""
  process: Any
  state: Any
  datasets: Callable[[int], list]
  round_num: int = 0

  def run_round(self):
    self.round_num += 1
    output = self.process.next(self.state, self.datasets(self.round_num))
    self.state = output.state
    return output


def _digits_setup(settings: Settings, num_clients: int):
  data = loaders.load_federated_data('digits', 'iid', num_clients, settings.seed)
  build_keras = models.keras_builder(settings.model, data.input_shape, data.num_classes)
  return data, build_keras, models.model_fn(build_keras, data.input_spec)


def _compile_candidates(names: Sequence[str], make: Callable[[str], _Candidate], worker_pids: Sequence[int]):
  """Builds each candidate and runs its first round; returns candidates and the timings of both steps."""
  candidates, build_seconds, compile_seconds = {}, {}, {}
  for name in names:
    _log(f'building and compiling {name}')
    candidate, build = benchmarks.timed_call(lambda: make(name), worker_pids)
    _, first = benchmarks.timed_call(candidate.run_round, worker_pids)
    candidates[name] = candidate
    build_seconds[name] = build.wall
    compile_seconds[name] = first.wall
  return candidates, build_seconds, compile_seconds


def _profile_rounds(candidate: _Candidate, rounds: int, top: int = 25) -> str:
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(rounds):
    candidate.run_round()
  profiler.disable()
  out = io.StringIO()
  pstats.Stats(profiler, stream=out).sort_stats('cumulative').print_stats(top)
  return out.getvalue()


def bench_rounds(settings: Settings, worker_pids: Sequence[int], profile: Sequence[str]) -> dict[str, Any]:
  data, build_keras, model_fn = _digits_setup(settings, settings.round_clients)
  ids = data.train.client_ids
  weight_bound = float(max(data.train.num_examples(c) for c in ids))

  def project_datasets(round_num: int) -> list:
    # The runner's per-round work: seeded client sampling, then shuffled, repeated, batched datasets.
    participants = simulation.sample_clients(ids, len(ids), settings.seed, round_num)
    return [simulation.client_dataset(data.train, c, local_epochs=1, batch_size=BATCH_SIZE, seed=settings.seed,
                                      round_num=round_num) for c in participants]

  def stock_datasets(round_num: int) -> list:
    del round_num
    return [data.train.create_tf_dataset_for_client(c).batch(BATCH_SIZE) for c in ids]

  # The aggregator comparison uses one fixed list of datasets (the same inputs for every candidate).
  fixed = project_datasets(1)
  initial_weights = None

  def make(name: str) -> _Candidate:
    nonlocal initial_weights
    process = learning_process(name, model_fn, weight_bound, settings.loop)
    state = simulation.seeded_initial_state(process, build_keras, settings.seed)
    if initial_weights is None:
      initial_weights = process.get_model_weights(state)
    state = process.set_model_weights(state, initial_weights)  # Every candidate starts from the same model.
    if name.startswith('stock_fedavg'):
      return _Candidate(process, state, stock_datasets)
    if name == 'project_pipeline':
      return _Candidate(process, state, project_datasets)
    return _Candidate(process, state, lambda _: fixed)

  names = list(settings.aggregators) + list(PIPELINE)
  candidates, build_seconds, compile_seconds = _compile_candidates(names, make, worker_pids)
  _log(f'rounds: {settings.round_repetitions} interleaved sweeps over {len(names)} processes')
  samples = benchmarks.interleaved_times(
      {name: c.run_round for name, c in candidates.items()}, settings.round_repetitions, worker_pids=worker_pids)
  summaries = {name: benchmarks.summarize(s) for name, s in samples.items()}
  medians = {name: summaries[name]['seconds'] for name in settings.aggregators}
  cpu_medians = {name: summaries[name]['cpu_seconds'] for name in settings.aggregators}
  profiles = {}
  for name in profile:
    if name in candidates:
      _log(f'profiling {name}')
      profiles[name] = _profile_rounds(candidates[name], max(2, settings.round_repetitions))
  stock, project = summaries['stock_fedavg']['seconds'], summaries['project_pipeline']['seconds']
  return collections.OrderedDict(
      setup=dict(dataset='digits', partition='iid', model=settings.model, clients=len(ids),
                 examples=int(sum(data.train.num_examples(c) for c in ids)), batch_size=BATCH_SIZE,
                 local_epochs=1, repetitions=settings.round_repetitions, loop=settings.loop),
      round_time_ratio=benchmarks.ratios_to(BASELINE, medians),
      round_cpu_ratio=benchmarks.ratios_to(BASELINE, cpu_medians),
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


def _probe_value(name: str, size: int) -> tuple[str, Any, Callable[[tf.Tensor], Any]]:
  """(kind, value type, client value generator) of aggregator `name`'s probe for a model of `size` floats."""
  vector = tff.TensorType(np.float32, [size])
  if name == 'elastic':  # An update and a (non-negative) sensitivity of the model's size each.
    return 'update_and_sensitivity', collections.OrderedDict(update=vector, sensitivity=vector), (
        lambda seed: collections.OrderedDict(
            update=benchmarks.random_client_value(vector, seed),
            sensitivity=benchmarks.random_client_value(vector, seed + 1, nonnegative=True)))
  return 'vector', vector, lambda seed: benchmarks.random_client_value(vector, seed)


def bench_aggregation(settings: Settings, worker_pids: Sequence[int]) -> dict[str, Any]:
  ratio, extra, timings, compile_seconds = {}, {}, {}, {}
  for size in settings.aggregation_sizes:
    for clients in settings.aggregation_clients:
      key = f'{size}x{clients}'
      seeds = list(range(settings.seed, settings.seed + clients))
      _log(f'aggregation {key}: compiling {len(settings.aggregators)} probes')
      probes, generators, kinds = {}, {}, {}
      for name in settings.aggregators:
        kinds[name], value_type, make_value = _probe_value(name, size)
        factory = weighted_factory(name, PROBE_VALUE_BOUND, PROBE_WEIGHT_BOUND)
        probes[name] = benchmarks.aggregation_probe(factory, value_type, make_value=make_value)
        if f'generation_{kinds[name]}' not in generators:
          generators[f'generation_{kinds[name]}'] = benchmarks.generation_probe(value_type, make_value=make_value)
      probes.update(generators)
      calls = {name: (lambda p=p: p(seeds)) for name, p in probes.items()}
      compile_seconds[key] = {name: benchmarks.timed_call(call, worker_pids)[1].wall for name, call in calls.items()}
      samples = benchmarks.interleaved_times(calls, settings.aggregation_repetitions, worker_pids=worker_pids)
      timings[key] = {name: benchmarks.summarize(s) for name, s in samples.items()}
      medians = {name: timings[key][name]['seconds'] for name in settings.aggregators}
      ratio[key] = benchmarks.ratios_to(BASELINE, medians)
      # What each aggregator adds to a call of the mean, in seconds. (A ratio of times net of the generation
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
# Section: scaling with clients per round.


def bench_scaling(settings: Settings, worker: runtime.WorkerProcess) -> list[dict[str, Any]]:
  total_clients = max(settings.scaling_clients)
  data, build_keras, model_fn = _digits_setup(settings, total_clients)
  ids = data.train.client_ids
  weight_bound = float(max(data.train.num_examples(c) for c in ids))
  pids = {'python': os.getpid(), 'worker': worker.pid}
  rows = []
  for name in settings.scaling_aggregators:

    def datasets_for(clients: int) -> Callable[[int], list]:
      def datasets(round_num: int) -> list:
        participants = simulation.sample_clients(ids, clients, settings.seed, round_num)
        return [simulation.client_dataset(data.train, c, local_epochs=1, batch_size=BATCH_SIZE,
                                          seed=settings.seed, round_num=round_num) for c in participants]
      return datasets

    process = learning_process(name, model_fn, weight_bound, settings.loop)
    candidate = _Candidate(process, simulation.seeded_initial_state(process, build_keras, settings.seed),
                           datasets_for(min(settings.scaling_clients)))
    # Compile on the smallest round: one computation serves every number of clients (the cardinality is an
    # argument of the call, not of the compiled computation).
    _log(f'scaling {name}: compiling')
    _, first = benchmarks.timed_call(candidate.run_round, [worker.pid])
    for clients in sorted(settings.scaling_clients):
      _log(f'scaling {name}: {clients} clients per round')
      candidate.datasets = datasets_for(clients)
      with benchmarks.PeakMemory(pids) as memory:
        samples = [benchmarks.timed_call(candidate.run_round, [worker.pid])[1]
                   for _ in range(settings.scaling_repetitions)]
      summary = benchmarks.summarize(samples)
      rows.append(collections.OrderedDict(
          aggregator=name,
          clients_per_round=clients,
          total_clients=total_clients,
          examples_per_round=int(sum(data.train.num_examples(c) for c in
                                     simulation.sample_clients(ids, clients, settings.seed, 1))),
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
    for prefix, limit in ROUND_TARGETS:
      if name.startswith(prefix) and (prefix.endswith('_') or name == prefix):
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
    lines += [f'## Round time (`build_weighted_fed_avg`, digits, model {setup["model"]}, {setup["loop"]} loop)', '',
              f'{setup["clients"]} clients, {setup["examples"]} examples, batch {setup["batch_size"]}, '
              f'{setup["repetitions"]} interleaved repetitions; medians. CPU columns: seconds of CPU per round in '
              'this Python process and in the TFF worker.', '',
              '| process | round s | ratio to mean | CPU ratio to mean | Python CPU s | worker CPU s | build s | '
              'first call s |', '|---' * 8 + '|']
    for name, timing in rounds['timings'].items():
      ratio, cpu_ratio = result['round_time_ratio'].get(name), result['round_cpu_ratio'].get(name)
      lines.append(f'| {name} | {_fmt(timing["seconds"])} | {_fmt(ratio, 2) if ratio is not None else "-"} | '
                   f'{_fmt(cpu_ratio, 2) if cpu_ratio is not None else "-"} | '
                   f'{_fmt(timing["python_cpu_seconds"])} | {_fmt(timing["worker_cpu_seconds"])} | '
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


def _csv(kind: Callable[[str], Any]):
  return lambda text: tuple(kind(part) for part in text.split(',') if part)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='smaller run, under 3 minutes')
  parser.add_argument('--smoke', action='store_true', help='tiny run of every section (for the tests)')
  parser.add_argument('--output', default=os.path.join(_ROOT, 'outputs', 'bench', 'bench.json'),
                      help='JSON path; the Markdown table goes beside it as bench.md')
  parser.add_argument('--sections', type=_csv(str), help=f'subset of {",".join(SECTIONS)}')
  parser.add_argument('--aggregators', type=_csv(str), help=f'subset of {",".join(AGGREGATORS)} (mean is kept)')
  parser.add_argument('--model', choices=models.MODELS, help='model of the digits setup (default cnn)')
  parser.add_argument('--loop', choices=sorted(LOOPS),
                      help="TFF's client training loop for the FedAvg processes (default reduce, TFF's default)")
  parser.add_argument('--round-repetitions', type=int)
  parser.add_argument('--aggregation-sizes', type=_csv(int), help='model sizes in floats, e.g. 10000,100000')
  parser.add_argument('--aggregation-clients', type=_csv(int))
  parser.add_argument('--aggregation-repetitions', type=int)
  parser.add_argument('--scaling-clients', type=_csv(int))
  parser.add_argument('--scaling-aggregators', type=_csv(str))
  parser.add_argument('--scaling-repetitions', type=int)
  parser.add_argument('--profile', type=_csv(str), default=(),
                      help='round-section processes to profile with cProfile (the Python main thread: it shows '
                           'how long Python waits for the worker), e.g. rfa_3')
  parser.add_argument('--seed', type=int)
  return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
  """The preset (full, --quick or --smoke) with the explicitly given flags on top; validates them."""
  if args.quick and args.smoke:
    raise ValueError('--quick and --smoke exclude each other')
  settings = SMOKE if args.smoke else QUICK if args.quick else Settings()
  overrides = {field: getattr(args, field) for field in (
      'sections', 'aggregators', 'model', 'loop', 'round_repetitions', 'aggregation_sizes', 'aggregation_clients',
      'aggregation_repetitions', 'scaling_clients', 'scaling_aggregators', 'scaling_repetitions', 'seed')
      if getattr(args, field) is not None}
  if 'aggregators' in overrides and BASELINE not in overrides['aggregators']:
    overrides['aggregators'] = (BASELINE,) + overrides['aggregators']
  settings = dataclasses.replace(settings, **overrides)
  for section in settings.sections:
    if section not in SECTIONS:
      raise ValueError(f'--sections: unknown section {section!r}; expected some of {SECTIONS}')
  for name in settings.aggregators + settings.scaling_aggregators:
    if name not in AGGREGATORS:
      raise ValueError(f'--aggregators: unknown aggregator {name!r}; expected some of {AGGREGATORS}')
  for field in ('round_repetitions', 'aggregation_repetitions', 'scaling_repetitions'):
    if getattr(settings, field) < 1:
      raise ValueError(f'--{field.replace("_", "-")} must be positive, got {getattr(settings, field)}')
  for field in ('aggregation_sizes', 'aggregation_clients', 'scaling_clients'):
    values = getattr(settings, field)
    if not values or min(values) < 1:
      raise ValueError(f'--{field.replace("_", "-")} must be positive integers, got {values}')
  if max(settings.scaling_clients) > 1437:
    raise ValueError('--scaling-clients: the digits training split holds 1437 examples, so at most 1437 clients')
  return settings


def run(settings: Settings, mode: str, profile: Sequence[str] = ()) -> dict[str, Any]:
  worker = runtime.set_simulation_context()
  started = time.monotonic()
  result: dict[str, Any] = collections.OrderedDict(
      environment=collections.OrderedDict(
          mode=mode, date=datetime.datetime.now().isoformat(timespec='seconds'),
          command=' '.join([os.path.relpath(sys.executable, _ROOT), *sys.argv]),
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
  result['targets'] = check_targets(result)
  result['environment']['load_after'] = [round(x, 2) for x in os.getloadavg()]
  result['environment']['seconds'] = time.monotonic() - started
  return result


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  try:
    settings = settings_from_args(args)
  except ValueError as e:
    _parser().error(str(e))
  for name in args.profile:
    if name not in settings.aggregators + PIPELINE:
      _parser().error(f'--profile: {name!r} is not a process of the rounds section '
                      f'({", ".join(settings.aggregators + PIPELINE)})')
  mode = 'smoke' if args.smoke else 'quick' if args.quick else 'full'
  result = run(settings, mode, args.profile)
  os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
  with open(args.output, 'w') as f:
    json.dump(result, f, indent=2, default=_json_default)
  markdown_path = os.path.join(os.path.dirname(os.path.abspath(args.output)), 'bench.md')
  with open(markdown_path, 'w') as f:
    f.write(to_markdown(result))
  for name, text in result['details'].get('rounds', {}).get('profiles', {}).items():
    with open(os.path.join(os.path.dirname(os.path.abspath(args.output)), f'profile_{name}.txt'), 'w') as f:
      f.write(text)
  print(to_markdown(result))
  _log(f'wrote {args.output} and {markdown_path} in {result["environment"]["seconds"]:.0f} s')
  return 0


if __name__ == '__main__':
  sys.exit(main())
