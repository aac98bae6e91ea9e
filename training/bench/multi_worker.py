"""Several TFF workers per round (`tff_gma.runtime.multi_worker`): a round on 1, 2 and 4 workers, each pinned to a core.

`bench_multi_worker`: per case, the runner's default FedAvg/mean round (datasets built in the workers) on one worker
as the runner runs it, and through the multi-worker context on each worker count, interleaved; the parallel efficiency
and where each round's time goes (the context's stages, each worker's CPU, the driver's). Method and reading:
docs/research/benchmark.md#several-workers-per-round
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import runtime
from tff_gma.runtime import multi_worker as multi_worker_lib
from training.bench import presets
from training.bench import small_rounds
from training.bench import timing

ONE_WORKER = 'one_worker'  # The runner without --workers: TFF's plain context on one worker (the baseline).
# `_MergeableContext.last_stages`' keys, in the order they run ('invoke': the whole call).
STAGES = ('split', 'up_to_merge', 'merge_and_after_merge', 'result_containers', 'invoke')
EFFICIENCY_TARGET = 0.85


def entry_name(workers: int) -> str:
  return f'workers_{workers}'


@contextlib.contextmanager
def _affinity(cpus: set[int]):
  """This process confined to `cpus` for the block: a process started in it inherits them (as under `taskset`, so
  TensorFlow sizes its thread pools by them)."""
  before = os.sched_getaffinity(0)
  os.sched_setaffinity(0, cpus)
  try:
    yield
  finally:
    os.sched_setaffinity(0, before)


def start_pinned_workers(count: int, cpus: Sequence[int]) -> list[runtime.WorkerProcess]:
  """`count` owned workers, worker i confined to core `cpus[i % len(cpus)]` from its start."""
  workers = []
  try:
    for i in range(count):
      with _affinity({cpus[i % len(cpus)]}):
        workers.append(runtime.WorkerProcess().start())
  except BaseException:
    for worker in workers:
      worker.stop()
    raise
  return workers


def _weights(output) -> list[np.ndarray]:
  state, _ = output
  return [np.asarray(w) for w in tf.nest.flatten(state.global_model_weights.trainable)]


def _case(settings: presets.Settings, model: str, clients: int, examples: int, workers: list[runtime.WorkerProcess],
          cpus: Sequence[int]) -> dict[str, Any]:
  name = small_rounds.case_name(model, clients, examples)
  setup = small_rounds.build_generated_round(model, clients, examples, batch_size=settings.floor_batch_size,
                                             seed=settings.seed)
  try:
    state, ids, method = setup.loop.state, setup.client_ids, setup.method
    entries = {ONE_WORKER: (runtime.create_simulation_context(workers[0]), workers[:1])}
    for count in settings.multi_worker_counts:
      entries[entry_name(count)] = (multi_worker_lib.create_context([w.target for w in workers[:count]]),
                                    workers[:count])

    def round_on(context):
      def call():
        with tff.framework.get_context_stack().install(context):
          return method.run_round(state, ids, [], 1)  # Round 1 from the same state: the same work every call.
      return call

    calls = {entry: round_on(context) for entry, (context, _) in entries.items()}
    pids = {entry: [w.pid for w in used] for entry, (_, used) in entries.items()}
    compile_seconds, differences, reference = {}, {}, None
    for entry, call in calls.items():
      presets.log(f'multi_worker {name}: compiling {entry}')
      output, sample = timing.timed_call(call, pids[entry])
      compile_seconds[entry] = sample.wall
      weights = _weights(output)
      reference = weights if reference is None else reference
      differences[entry] = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
    presets.log(f'multi_worker {name}: {settings.multi_worker_repetitions} interleaved sweeps')
    samples = {entry: [] for entry in calls}
    worker_cpu = {entry: [] for entry in calls}
    stages = {entry: [] for entry in calls}
    names = list(calls)
    for sweep in range(settings.multi_worker_repetitions):
      shift = sweep % len(names)
      for entry in names[shift:] + names[:shift]:
        context, used = entries[entry]
        before = [timing.process_cpu_seconds(w.pid) for w in used]
        samples[entry].append(timing.timed_call(calls[entry], pids[entry])[1])
        worker_cpu[entry].append([timing.process_cpu_seconds(w.pid) - b for w, b in zip(used, before)])
        stages[entry].append(dict(getattr(context, 'last_stages', {})))
  finally:
    setup.close()
  timings = {entry: timing.summarize(s) for entry, s in samples.items()}
  one = timings[ONE_WORKER]['seconds']
  cores = len(cpus)
  efficiency = collections.OrderedDict(
      (entry_name(n), one / (min(n, cores) * timings[entry_name(n)]['seconds'])) for n in settings.multi_worker_counts)
  # What the split alone allows, from CPU seconds (steadier than wall time on a loaded machine): one worker's CPU over
  # min(N, cores) x the busiest core's (the sum of its workers'), i.e. the efficiency with no serial part at all.
  split_efficiency = collections.OrderedDict()
  for n in settings.multi_worker_counts:
    each = [timing.median(list(c)) for c in zip(*worker_cpu[entry_name(n)])]
    busiest = max(sum(c for i, c in enumerate(each) if i % cores == core) for core in range(min(n, cores)))
    split_efficiency[entry_name(n)] = (timings[ONE_WORKER]['worker_cpu_seconds'] / (min(n, cores) * busiest)
                                       if busiest > 0 else None)  # CPU is read in clock ticks (10 ms here).
  breakdown = collections.OrderedDict()
  for entry in calls:
    row = collections.OrderedDict(round_seconds=timings[entry]['seconds'],
                                  driver_cpu_seconds=timings[entry]['python_cpu_seconds'],
                                  workers_cpu_seconds=timings[entry]['worker_cpu_seconds'],
                                  each_worker_cpu_seconds=[timing.median(list(c)) for c in zip(*worker_cpu[entry])])
    if stages[entry][0]:
      row['stage_seconds'] = collections.OrderedDict(
          (stage, timing.median([s.get(stage, 0.0) for s in stages[entry]])) for stage in STAGES)
      row['outside_the_context_seconds'] = timings[entry]['seconds'] - row['stage_seconds']['invoke']
    breakdown[entry] = row
  return collections.OrderedDict(
      setup=dict(model=model, data=f'generated {list(presets.FLOOR_SHAPES[model])}, {small_rounds.NUM_CLASSES} '
                 'classes', clients=clients, examples_per_client=examples, batch_size=settings.floor_batch_size,
                 local_epochs=1, aggregator=presets.BASELINE, datasets='built in the workers (client sources)',
                 repetitions=settings.multi_worker_repetitions, cores=list(cpus),
                 pinning={entry: [cpus[i % cores] for i in range(len(used))] for entry, (_, used) in entries.items()},
                 driver='not pinned (all the cores above)'),
      efficiency=efficiency, split_cpu_efficiency=split_efficiency, timings=timings, breakdown=breakdown,
      compile_seconds=compile_seconds,
      max_abs_difference_to_one_worker=differences,
      samples={entry: [dataclasses.asdict(x) for x in ss] for entry, ss in samples.items()})


def bench_multi_worker(settings: presets.Settings) -> dict[str, Any]:
  """Per case of `settings.multi_worker_cases` (model, clients, examples per client): the round on one worker
  (`one_worker`) and through the multi-worker context on each count of `settings.multi_worker_counts` (`workers_N`),
  interleaved; `multi_worker_efficiency[case][workers_N]` = one worker's median round time / (min(N, cores) x the
  N workers' median). Worker i runs on core i mod cores of this process's cores (taken from its affinity); this
  process is not pinned."""
  cpus = sorted(os.sched_getaffinity(0))
  workers = start_pinned_workers(max(settings.multi_worker_counts), cpus)
  out = collections.OrderedDict(multi_worker_efficiency={}, cases={})
  try:
    for model, clients, examples in settings.multi_worker_cases:
      case = _case(settings, model, clients, examples, workers, cpus)
      name = small_rounds.case_name(model, clients, examples)
      out['multi_worker_efficiency'][name] = case['efficiency']
      out['cases'][name] = case
  finally:
    for worker in workers:
      worker.stop()
  return out


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  """Two workers on two cores at >= `EFFICIENCY_TARGET` parallel efficiency, per case measured (never asserted)."""
  targets = []
  for name, efficiency in result.get('multi_worker_efficiency', {}).items():
    if entry_name(2) in efficiency:
      value = efficiency[entry_name(2)]
      targets.append(dict(target=f'two workers ({name}) at >= {EFFICIENCY_TARGET:.2f} parallel efficiency',
                          value=value, met=value >= EFFICIENCY_TARGET))
  return targets


def _ms(seconds: float) -> str:
  return f'{1000 * seconds:.0f}'


def markdown(result: dict[str, Any]) -> list[str]:
  section = result.get('details', {}).get('multi_worker')
  if not section:
    return []
  lines = ['## Several workers per round (`training.bench.multi_worker`)', '',
           'FedAvg/mean round, datasets built in the workers; worker i pinned to core i mod cores, the driver not '
           'pinned. Medians of interleaved sweeps, milliseconds. Efficiency: one worker\'s round / (min(N, cores) x '
           'the round on N workers); the split\'s CPU efficiency: one worker\'s CPU / (min(N, cores) x the busiest '
           'core\'s workers\' CPU), what the split allows with no serial part.', '']
  for name, case in section['cases'].items():
    stage_names = STAGES[:-1]
    lines += [f'### {name}, batch {case["setup"]["batch_size"]}', '',
              '| entry | round | efficiency | split\'s CPU efficiency | driver CPU | workers\' CPU | '
              'each worker\'s CPU | ' + ' | '.join(stage_names)
              + ' | outside the context | max abs difference to one worker |',
              '|---' * (9 + len(stage_names)) + '|']
    for entry, row in case['breakdown'].items():
      efficiency, split = case['efficiency'].get(entry), case['split_cpu_efficiency'].get(entry)
      stages = row.get('stage_seconds')
      cells = [_ms(stages[s]) for s in stage_names] if stages else ['-'] * len(stage_names)
      lines.append(f'| {entry} | {_ms(row["round_seconds"])} | '
                   f'{f"**{efficiency:.2f}**" if efficiency is not None else "-"} | '
                   f'{f"{split:.2f}" if split is not None else "-"} | {_ms(row["driver_cpu_seconds"])} | '
                   f'{_ms(row["workers_cpu_seconds"])} | {", ".join(_ms(c) for c in row["each_worker_cpu_seconds"])} | '
                   + ' | '.join(cells) + f' | {_ms(row["outside_the_context_seconds"]) if stages else "-"} | '
                   f'{case["max_abs_difference_to_one_worker"][entry]:.1e} |')
    lines.append('')
  return lines
