"""The benchmark's command line: its flags, the sections run in order, the targets checked, JSON and Markdown written.

    python -m training.bench [--quick | --smoke] [--sections=...] [--aggregators=mean,gma+secure,rfa+num_passes=5]

--quick: a few minutes; none: the full benchmark (a quiet machine); --smoke: every key on tiny sizes. Writes
--output (outputs/bench/bench.json) and bench.md. Entries, sections, keys: docs/research/benchmark.md"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import collections  # pylint: disable=g-import-not-at-top
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from training import command_line
from training.bench import candidates
from training.bench import multi_worker
from training.bench import presets
from training.bench import runner_runs
from training.bench import sections
from training.bench import small_rounds

# ----------------------------------------------------------------------------------------------------------------
# Targets, JSON and Markdown.


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  targets = []
  for name, ratio in result.get('round_time_ratio', {}).items():
    limit = candidates.round_target(candidates.parse_candidate(name))
    if limit is not None:
      targets.append(dict(target=f'{name} round time <= {limit:.2f}x mean', value=ratio, met=ratio <= limit,
                          cpu_value=result.get('round_cpu_ratio', {}).get(name)))
  if 'pipeline_throughput_ratio' in result:
    value = result['pipeline_throughput_ratio']
    targets.append(dict(target=f'project mean pipeline throughput >= {presets.PIPELINE_TARGET:.2f}x stock FedAvg',
                        value=value, met=value >= presets.PIPELINE_TARGET))
  for row in result.get('scaling', []):
    if row['clients_per_round'] == 500:
      targets.append(dict(target=f'500 clients per round ({row["aggregator"]}) within '
                                 f'{presets.MEMORY_LIMIT_GIB:.0f} GiB',
                          value=row['peak_total_gib'], met=row['peak_total_gib'] <= presets.MEMORY_LIMIT_GIB))
  for model, ratios in result.get('round_to_floor', {}).items():
    value = ratios['project_worker_datasets']
    targets.append(dict(target=f'project round ({model}) <= {sections.FLOOR_TARGET:.1f}x the in-graph floor',
                        value=value, met=value <= sections.FLOOR_TARGET))
  for model, value in result.get('loop_before_speedup', {}).items():
    targets.append(dict(target=f'project round ({model}) >= {sections.LOOP_SPEEDUP_TARGET:.1f}x the throughput of '
                        'the loop before (sent datasets, iterator loop)', value=value,
                        met=value >= sections.LOOP_SPEEDUP_TARGET))
  targets += small_rounds.check_targets(result)
  targets += runner_runs.check_targets(result)
  targets += multi_worker.check_targets(result)
  return targets


def _fmt(value: float, digits: int = 3) -> str:
  return f'{value:.{digits}f}'


def _floor_markdown(result: dict[str, Any]) -> list[str]:
  lines = ['## A round against its in-graph floor (`training.bench.floor`)', '',
           '| model | clients x examples, batch | floor s | floor in the worker | project (default: worker '
           'datasets, in-graph loop, 1 intra-op thread) | project, worker with TF\'s default threads | project, '
           'iterator loop | the loop before (sent datasets, iterator loop, default threads) | '
           'stock FedAvg (iterator) | project, one batch a client | project minus one batch |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for model, detail in result['details']['floor']['models'].items():
    setup, ratios = detail['setup'], result['round_to_floor'][model]
    lines.append(f'| {model} | {setup["clients"]} x {setup["examples_per_client"]}, {setup["batch_size"]} | '
                 f'{_fmt(detail["timings"]["floor"]["seconds"])} | '
                 + ' | '.join(f'{_fmt(ratios[n], 2)}x' for n in (*sections.FLOOR_ENTRIES[1:],
                                                                 'project_beyond_one_batch')) + ' |')
  return lines + ['', 'Ratios: median round time over the floor\'s, interleaved in one run.', '']


def _rounds_markdown(result: dict[str, Any]) -> list[str]:
  rounds = result['details']['rounds']
  setup = rounds['setup']
  lines = [f'## Round time (`training.engine.methods`, digits, model {setup["model"]}, {setup["loop"]} loop)', '',
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
  return lines + ['', f'Project mean pipeline throughput / stock FedAvg: '
                  f'**{_fmt(result["pipeline_throughput_ratio"], 3)}**. Stock FedAvg with '
                  f'`loop_implementation=DATASET_ITERATOR` / with the default `DATASET_REDUCE`: '
                  f'**{_fmt(result["iterator_loop_speedup"], 2)}x** the throughput.', '']


def _aggregation_markdown(result: dict[str, Any]) -> list[str]:
  agg = result['details']['aggregation']
  names = list(next(iter(result['aggregation_time_ratio'].values())).keys())
  lines = ['## Aggregation process alone (values generated in the worker)', '',
           'Ratio of median call time to `mean` (TFF `MeanFactory`); in brackets the milliseconds it adds to '
           'a call of the mean. `gen s`: generating the client values alone. Config: floats x clients.', '',
           '| config | mean s | gen s | ' + ' | '.join(n for n in names if n != presets.BASELINE) + ' |',
           '|---' * (len(names) + 2) + '|']
  for key, ratios in result['aggregation_time_ratio'].items():
    cells = [f'{_fmt(ratios[n], 2)} ({1000 * agg["aggregation_extra_seconds"][key][n]:+.0f})'
             for n in names if n != presets.BASELINE]
    lines.append(f'| {key} | {_fmt(agg["timings"][key][presets.BASELINE]["seconds"])} | '
                 f'{_fmt(agg["timings"][key]["generation_vector"]["seconds"])} | ' + ' | '.join(cells) + ' |')
  return lines + ['']


def _scaling_markdown(result: dict[str, Any]) -> list[str]:
  lines = [f'## Scaling with clients per round (digits over {result["scaling"][0]["total_clients"]} clients)', '',
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
  return lines + ['']


def _client_execution_markdown(result: dict[str, Any]) -> list[str]:
  section = result['details']['client_execution']
  lines = ['## Where the clients train: TFF worker vs this process (`--client_execution`)', '',
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
  return lines + ['']


def _targets_markdown(result: dict[str, Any]) -> list[str]:
  lines = ['## Targets', '', 'Wall-time ratios decide; the CPU-time ratio (Python + worker) is shown beside them '
           'because it is less disturbed by other work on the machine.', '',
           '| target | value | met | CPU ratio |', '|---|---|---|---|']
  lines += [f'| {t["target"]} | {_fmt(t["value"])} | {"yes" if t["met"] else "**no**"} | '
            f'{_fmt(t["cpu_value"]) if t.get("cpu_value") is not None else "-"} |' for t in result['targets']]
  return lines + ['']


def to_markdown(result: dict[str, Any]) -> str:
  """The run's report: its environment, then a table per section it ran, then the targets."""
  environment = result['environment']
  lines = [f'# Benchmark ({environment["mode"]}, {environment["date"]})', '',
           f'Command: `{environment["command"]}`  ',
           f'Machine: {environment["cpus"]} CPUs, load average {environment["load_before"]} '
           f'before, {environment["load_after"]} after; TFF {environment["tff"]}.', '']
  details = result['details']
  lines += _floor_markdown(result) if 'floor' in details else []
  lines += _rounds_markdown(result) if 'rounds' in details else []
  lines += _aggregation_markdown(result) if 'aggregation' in details else []
  lines += _scaling_markdown(result) if result.get('scaling') else []
  lines += _client_execution_markdown(result) if 'client_execution' in details else []
  lines += small_rounds.markdown(result)
  lines += runner_runs.markdown(result)
  lines += multi_worker.markdown(result)
  lines += _targets_markdown(result) if result['targets'] else []
  return '\n'.join(lines)


def _json_default(value):
  if isinstance(value, (np.floating, np.integer)):
    return value.item()
  raise TypeError(f'not JSON serializable: {type(value)}')


# ----------------------------------------------------------------------------------------------------------------
# Command line.

FLAGS = flags.FLAGS
_INT_LISTS = ('aggregation_sizes', 'aggregation_clients', 'scaling_clients', 'multi_worker_counts')
_REPETITIONS = ('round_repetitions', 'aggregation_repetitions', 'scaling_repetitions',
                'client_execution_repetitions', 'client_execution_clients', 'client_execution_examples',
                'breakdown_repetitions', 'peers_repetitions', 'multi_worker_repetitions')


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The program's flags (defined when it runs, or into a test's `FlagValues`: importing defines none)."""
  f = flag_values
  flags.DEFINE_bool('quick', False, 'Smaller run: a few minutes.', flag_values=f)
  flags.DEFINE_bool('smoke', False, 'Tiny run of every section and key (for the tests).', flag_values=f)
  flags.DEFINE_string('output', os.path.join(presets.ROOT, 'outputs', 'bench', 'bench.json'),
                      'JSON path; the Markdown table goes beside it as bench.md (and profile_NAME.txt).',
                      flag_values=f)
  flags.DEFINE_list('sections', None, f'Subset of {",".join(presets.SECTIONS)} (default: all).', flag_values=f)
  flags.DEFINE_list('aggregators', None,
                    'Candidates: training.engine.methods names, each optionally NAME+setting=value+... '
                    f'(mean is always kept; default: {",".join(presets.AGGREGATORS)}).', flag_values=f)
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
  flags.DEFINE_integer('breakdown_repetitions', None, 'Interleaved sweeps of the breakdown section.', flag_values=f)
  flags.DEFINE_integer('peers_repetitions', None, 'Interleaved sweeps of the peers section.', flag_values=f)
  flags.DEFINE_integer('multi_worker_repetitions', None, 'Interleaved sweeps of the multi_worker section.',
                       flag_values=f)
  flags.DEFINE_list('multi_worker_counts', None, 'Worker counts of the multi_worker section, e.g. 1,2,4.',
                    flag_values=f)
  flags.DEFINE_list('profile', [], 'Round-section processes to profile with cProfile (the Python main thread: it '
                    'shows how long Python waits for the worker), e.g. rfa.', flag_values=f)
  flags.DEFINE_integer('seed', None, 'Seed of the partition, the initial model and the client order (default 0).',
                       flag_values=f)


def mode_from_flags(flag_values: flags.FlagValues = FLAGS) -> str:
  if flag_values.quick and flag_values.smoke:
    raise ValueError('--quick and --smoke exclude each other')
  return 'smoke' if flag_values.smoke else 'quick' if flag_values.quick else 'full'


def settings_from_flags(flag_values: flags.FlagValues = FLAGS) -> presets.Settings:
  """The preset (full, --quick or --smoke) with the explicitly given flags on top; ValueError names a bad flag."""
  settings = presets.MODES[mode_from_flags(flag_values)]
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
  if 'aggregators' in overrides and presets.BASELINE not in overrides['aggregators']:
    overrides['aggregators'] = (presets.BASELINE,) + overrides['aggregators']
  settings = dataclasses.replace(settings, **overrides)
  for section in settings.sections:
    if section not in presets.SECTIONS:
      raise ValueError(f'--sections: unknown section {section!r}; expected some of {presets.SECTIONS}')
  for flag, entries in (('aggregators', settings.aggregators), ('scaling_aggregators', settings.scaling_aggregators)):
    for entry in entries:
      try:
        # Builds the factory: checks its settings.
        candidates.probe_factory(candidates.parse_candidate(entry), presets.PROBE_VALUE_BOUND)
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
  if max(settings.scaling_clients) > presets.DIGITS_TRAIN_EXAMPLES:
    raise ValueError(f'--scaling_clients: the digits training split holds {presets.DIGITS_TRAIN_EXAMPLES} '
                     f'examples, so at most {presets.DIGITS_TRAIN_EXAMPLES} clients')
  for name in flag_values.profile:
    if name not in settings.aggregators + presets.PIPELINE:
      raise ValueError(f'--profile: {name!r} is not a process of the rounds section '
                       f'({", ".join(settings.aggregators + presets.PIPELINE)})')
  return settings


def run(settings: presets.Settings, mode: str, profile: Sequence[str] = (), command: str = '') -> dict[str, Any]:
  worker = command_line.start_simulation()
  started = time.monotonic()
  result: dict[str, Any] = collections.OrderedDict(
      environment=collections.OrderedDict(
          mode=mode, date=datetime.datetime.now().isoformat(timespec='seconds'), command=command,
          cpus=os.cpu_count(), load_before=[round(x, 2) for x in os.getloadavg()], tff=tff.__version__,
          tensorflow=tf.__version__, settings=dataclasses.asdict(settings)),
      round_time_ratio={}, aggregation_time_ratio={}, scaling=[], details={})
  if 'rounds' in settings.sections:
    rounds = sections.bench_rounds(settings, [worker.pid], profile)
    result['round_time_ratio'] = rounds['round_time_ratio']
    result['round_cpu_ratio'] = rounds['round_cpu_ratio']
    result['pipeline_throughput_ratio'] = rounds['pipeline_throughput_ratio']
    result['iterator_loop_speedup'] = rounds['iterator_loop_speedup']
    result['compile_seconds'] = {'rounds': rounds['compile_seconds']}
    result['details']['rounds'] = rounds
  if 'aggregation' in settings.sections:
    aggregation = sections.bench_aggregation(settings, [worker.pid])
    result['aggregation_time_ratio'] = aggregation['aggregation_time_ratio']
    result.setdefault('compile_seconds', {})['aggregation'] = aggregation['compile_seconds']
    result['details']['aggregation'] = aggregation
  if 'scaling' in settings.sections:
    result['scaling'] = sections.bench_scaling(settings, worker)
    result.setdefault('compile_seconds', {})['scaling'] = {
        row['aggregator']: row['compile_seconds'] for row in result['scaling']}
  if 'client_execution' in settings.sections:
    section = sections.bench_client_execution(settings, [worker.pid])
    result['client_execution_time_ratio'] = section['client_execution_time_ratio']
    result['details']['client_execution'] = section
  if 'floor' in settings.sections:
    section = sections.bench_floor(settings, [worker.pid])
    result['round_to_floor'] = section['round_to_floor']
    result['loop_before_speedup'] = section['loop_before_speedup']
    result['details']['floor'] = section
  if 'breakdown' in settings.sections:
    section = small_rounds.bench_breakdown(settings, [worker.pid])
    result['round_parts'] = section['round_parts']
    result['details']['breakdown'] = section
  if 'peers' in settings.sections:
    section = small_rounds.bench_peers(settings, [worker.pid])
    result['peer_ratios'] = section['peer_ratios']
    result['details']['peers'] = section
  if 'runner' in settings.sections:
    section = runner_runs.bench_runner(settings)
    result['runner_ratios'] = section.get('runner_ratios')
    result['details']['runner'] = section
  if 'multi_worker' in settings.sections:
    section = multi_worker.bench_multi_worker(settings)
    result['multi_worker_efficiency'] = section['multi_worker_efficiency']
    result['details']['multi_worker'] = section
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
  command_line.check_output_file(FLAGS.output, 'output')  # Before the benchmark, not after it.
  command = ' '.join([os.path.relpath(sys.executable, presets.ROOT), '-m', 'training.bench', *sys.argv[1:]])
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
  presets.log(f'wrote {FLAGS.output} and {markdown_path} in {result["environment"]["seconds"]:.0f} s')


if __name__ == '__main__':
  define_flags()
  command_line.run(main)
