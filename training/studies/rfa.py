"""The RFA robustness study on the embedded digits: accuracy against the corruption level (RFA paper, Sec. 5.2-5.3).

    python -m training.studies.rfa [--models=logistic,cnn] [--corruptions=...] [--fractions=...] [--aggregators=...]

An entry may carry settings (`rfa+rfa_init=zero+num_passes=5`); one runner run per cell, in shards (`--shard=i/n`);
writes results.md, results.json, results.png. Grid, defaults, flagfiles: docs/research/rfa_study.md"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import dataclasses  # pylint: disable=g-import-not-at-top
import itertools
import time
from typing import Any, NamedTuple, Optional

from absl import app
from absl import flags
from absl import logging
import numpy as np

from training import command_line
from training import config as config_lib
from training.engine import registry
from training.runner import experiment
from training.studies.shared import report
from training.studies.shared import study_runs

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_CONFIGS = {
    'logistic': os.path.join(_ROOT, 'configs', 'rfa_digits_linear.flags'),
    'cnn': os.path.join(_ROOT, 'configs', 'rfa_digits_cnn.flags'),
}
AGGREGATORS = registry.method_names(registry.RFA_STUDY)  # The registry's RFA_STUDY records, in its order.
CORRUPTIONS = ('data_negate', 'data_flip_labels', 'gaussian', 'omniscient')

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags (defined only when run as a script, so that importing this module defines none)."""
  flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (runs per cell).')
  flags.DEFINE_integer('rounds', 10, 'Rounds per run.')
  flags.DEFINE_integer('eval_every', 1, 'Evaluate every this many rounds (and at the last).')
  flags.DEFINE_integer('last_evals', 3, 'Final accuracy: mean over this many last evaluated rounds.')
  # 5, as the flagfiles: 10 rounds of 1 epoch (72 examples per client, batch 16) leave the models undertrained.
  flags.DEFINE_integer('local_epochs', 5, "Client epochs per round (0: the flagfile's).")
  flags.DEFINE_list('models', list(BASE_CONFIGS), f'Models, each with its base flagfile {BASE_CONFIGS}.')
  flags.DEFINE_list('corruptions', list(CORRUPTIONS), 'Corruptions.')
  flags.DEFINE_list('fractions', ['0', '0.1', '0.25', '0.4'], 'Corruption levels rho.')
  flags.DEFINE_list('aggregators', list(AGGREGATORS), 'Aggregators compared; NAME+setting=value+... sets runner '
                    'settings for that entry (e.g. rfa+rfa_init=zero+num_passes=5).')
  flags.DEFINE_list('clients_per_round', [], "Participation levels compared (default: the flagfile's).")
  flags.DEFINE_string('output_dir', 'outputs/reproduce_rfa', 'Where runs and results go.')
  flags.DEFINE_enum('client_execution', 'worker', ['worker', 'local'],
                    'Where every run\'s clients train (the runner\'s --client_execution; local refuses the update '
                    'corruptions gaussian and omniscient: pass --corruptions without them).')
  flags.DEFINE_string('shard', '0/1', 'i/n: run only every n-th cell from the i-th (0-based), so that n processes '
                      'share the grid; a last call without --shard collects their finished cells.')


def parse_setting(name: str, raw: str, where: str = 'setting') -> Any:
  """A runner setting's value from its flag text, typed as `ExperimentConfig`'s field."""
  fields = {f.name for f in dataclasses.fields(config_lib.ExperimentConfig)}
  if name not in fields:
    raise ValueError(f'{where}: unknown setting {name!r}')
  default = getattr(config_lib.ExperimentConfig(), name)
  if isinstance(default, bool):
    return raw.lower() in ('true', '1', '')
  if isinstance(default, int):
    return int(raw)
  if isinstance(default, float) or name == 'secure_bound':
    return float(raw)
  return raw


def read_flagfile(path: str) -> config_lib.ExperimentConfig:
  """An `ExperimentConfig` from a runner flagfile (`--name=value` lines; `#` comments)."""
  values: dict[str, Any] = {}
  with open(path) as f:
    for line in f:
      line = line.split('#', 1)[0].strip()
      if not line:
        continue
      name, _, raw = line.lstrip('-').partition('=')
      values[name] = parse_setting(name, raw, path)
  return config_lib.ExperimentConfig(**values)


def parse_aggregator(entry: str) -> tuple[str, dict[str, Any]]:
  """'rfa+rfa_init=zero+num_passes=5' -> ('rfa', {'rfa_init': 'zero', 'num_passes': 5})."""
  name, *settings = entry.split('+')
  overrides = {}
  for setting in settings:
    key, sep, raw = setting.partition('=')
    if not sep or key in ('aggregator', 'seed', 'model', 'corruption', 'corrupt_fraction', 'clients_per_round'):
      raise ValueError(f'aggregators: {entry!r}: expected NAME+setting=value+..., with a setting the study does '
                       f'not vary itself, got {setting!r}')
    overrides[key] = parse_setting(key, raw, f'aggregators: {entry!r}')
  return name, overrides


class Cell(NamedTuple):
  model: str
  corruption: str
  rho: float
  aggregator: str  # An entry of --aggregators (its label).
  seed: int
  clients_per_round: Optional[int] = None  # None: the flagfile's.


def cells(models, corruptions, fractions, aggregators, seeds, participation=(None,)) -> list[Cell]:
  """The runs: rho = 0 once per (model, aggregator, seed, participation) as corruption 'none'.

  Aggregator-major, so that a study stopped early has whole columns of the first aggregators.
  """
  out = []
  for aggregator, model, seed, clients in itertools.product(aggregators, models, seeds, participation):
    if any(rho == 0 for rho in fractions):
      out.append(Cell(model, 'none', 0.0, aggregator, seed, clients))
    out.extend(Cell(model, c, rho, aggregator, seed, clients) for c in corruptions for rho in fractions if rho > 0)
  return out


def cell_config(cell: Cell, rounds: int, eval_every: int, output_dir: str,
                local_epochs: Optional[int] = None, client_execution: str = 'worker') -> config_lib.ExperimentConfig:
  base = read_flagfile(BASE_CONFIGS[cell.model])
  epochs = base.local_epochs if local_epochs is None else local_epochs
  name, overrides = parse_aggregator(cell.aggregator)
  clients = base.clients_per_round if cell.clients_per_round is None else cell.clients_per_round
  run_name = f'{cell.model}-{cell.corruption}-rho{cell.rho:g}-{cell.aggregator}-seed{cell.seed}-e{epochs}'
  if clients != base.clients_per_round:
    run_name += f'-k{clients}'
  return dataclasses.replace(
      base, model=cell.model, corruption=cell.corruption, corrupt_fraction=cell.rho, aggregator=name,
      seed=cell.seed, rounds=rounds, eval_every=eval_every, local_epochs=epochs, clients_per_round=clients,
      output_dir=os.path.join(output_dir, 'runs', run_name), client_execution=client_execution, **overrides)


def setting_label(config: config_lib.ExperimentConfig) -> str:
  """The group a run's tables are in: model and participation."""
  return f'{config.model}, {config.clients_per_round} of {config.num_clients} per round'


def final_accuracy(output_dir: str, last_evals: int) -> float:
  """Mean test accuracy over the run's last `last_evals` evaluated rounds (from its metrics.csv)."""
  return float(np.mean(study_runs.curve(output_dir, 'test/accuracy')[-last_evals:]))


def _group(record: dict) -> str:
  """The table group of a result: its setting (model and participation), or its model in older results."""
  return record.get('setting', record['model'])


def _groups(results: list[dict]) -> list[str]:
  return list(dict.fromkeys(_group(r) for r in results))


def _accuracy(results, group, corruption, rho, aggregator, by_seed=False):
  """Final accuracies (%) of a cell over seeds; rho = 0 reads the shared uncorrupted runs.

  With `by_seed`, a {seed: accuracy} dict instead of a list.
  """
  wanted = 'none' if rho == 0 else corruption
  chosen = [r for r in results
            if (_group(r), r['corruption'], r['rho'], r['aggregator']) == (group, wanted, rho, aggregator)]
  if by_seed:
    return {r['seed']: 100 * r['final_accuracy'] for r in chosen}
  return [100 * r['final_accuracy'] for r in chosen]


def summarize(results: list[dict], fractions: list[float]) -> str:
  """Markdown: one table per (model, corruption), rows aggregators, columns rho."""
  lines = []
  models = _groups(results)
  corruptions = list(dict.fromkeys(r['corruption'] for r in results if r['corruption'] != 'none')) or ['none']
  aggregators = list(dict.fromkeys(r['aggregator'] for r in results))
  for model, corruption in itertools.product(models, corruptions):
    lines += [f'**{model}, {corruption}** (final test accuracy %, mean +- std over seeds)', '',
              '| aggregator | ' + ' | '.join(f'rho={rho:g}' for rho in fractions) + ' |',
              '|---|' + '---|' * len(fractions)]
    for aggregator in aggregators:
      cells_ = []
      for rho in fractions:
        values = _accuracy(results, model, corruption, rho, aggregator)
        cells_.append(f'{np.mean(values):.1f} +- {np.std(values):.1f}' if values else '-')
      lines.append(f'| {aggregator} | ' + ' | '.join(cells_) + ' |')
    lines.append('')
  return '\n'.join(lines)


def summarize_at(results: list[dict], rho: float) -> str:
  """Markdown: every corruption at one level rho side by side, rows aggregators, columns (model, corruption)."""
  models = _groups(results)
  corruptions = list(dict.fromkeys(r['corruption'] for r in results if r['corruption'] != 'none'))
  aggregators = list(dict.fromkeys(r['aggregator'] for r in results))
  columns = list(itertools.product(models, corruptions))
  lines = [f'**All corruptions at rho={rho:g}** (final test accuracy %, mean over seeds)', '',
           '| aggregator | ' + ' | '.join(f'{m}, {c}' for m, c in columns) + ' |',
           '|---|' + '---|' * len(columns)]
  for aggregator in aggregators:
    values = [_accuracy(results, m, c, rho, aggregator) for m, c in columns]
    lines.append(f'| {aggregator} | ' + ' | '.join(f'{np.mean(v):.1f}' if v else '-' for v in values) + ' |')
  return '\n'.join(lines) + '\n'


def _mean_or_none(values):
  return float(np.mean(values)) if values else None


def check_claims(results: list[dict], fractions: list[float]) -> list[str]:
  """The RFA paper's qualitative claims, each with the numbers it rests on and whether it holds here."""
  out = []
  positive = [rho for rho in fractions if rho > 0]
  for model in _groups(results):
    acc = lambda c, rho, a, m=model: _mean_or_none(_accuracy(results, m, c, rho, a))
    clean_mean, clean_rfa = acc('none', 0.0, 'mean'), acc('none', 0.0, 'rfa')
    if clean_mean is not None and clean_rfa is not None:
      gap = clean_mean - clean_rfa
      verdict = 'holds' if gap <= 2.0 else 'does not hold'
      out.append(f'- {model}, no corruption: mean {clean_mean:.1f}%, RFA {clean_rfa:.1f}% (mean - RFA = {gap:+.1f} '
                 f'points). "RFA within a point or two of the mean": {verdict}.')
    curves = {a: [acc('omniscient', rho, a) for rho in fractions] for a in ('mean', 'rfa', 'rfa_one_step')}
    average = {a: _mean_or_none([v for rho, v in zip(fractions, c) if rho > 0 and v is not None])
               for a, c in curves.items()}
    curve = lambda c: ', '.join('-' if v is None else f'{v:.1f}' for v in c)
    levels = ', '.join(f'{r:g}' for r in fractions)
    if positive and average['mean'] is not None and average['rfa'] is not None:
      collapse = all(v is not None and v < 20 for rho, v in zip(fractions, curves['mean']) if rho > 0)
      graceful = average['rfa'] >= average['mean'] + 20
      out.append(f'- {model}, omniscient, rho = {levels}: mean [{curve(curves["mean"])}], RFA '
                 f'[{curve(curves["rfa"])}]. "The mean collapses (< 20% at every rho > 0)": '
                 f'{"holds" if collapse else "does not hold"}; "RFA degrades gracefully (over rho > 0, on average '
                 f'at least 20 points above the mean; here {average["rfa"] - average["mean"]:+.1f})": '
                 f'{"holds" if graceful else "does not hold"}.')
    if positive and None not in average.values():
      gain = average['rfa'] - average['mean']
      kept = (average['rfa_one_step'] - average['mean']) / gain if gain > 1e-9 else float('nan')
      verdict = 'holds' if kept == kept and kept >= 0.5 else 'does not hold'
      out.append(f'- {model}, omniscient: one-step RFA [{curve(curves["rfa_one_step"])}] keeps '
                 f'{"n/a" if kept != kept else f"{100 * kept:.0f}%"} of RFA\'s average gain over the mean '
                 f'(rho > 0). "One-step RFA keeps most of RFA\'s robustness (>= 50%)": {verdict}.')
  return out


def check_start_goals(results: list[dict], fractions: list[float], baseline: str = 'median',
                      tolerance: float = 5.0) -> list[str]:
  """The goals of the Weiszfeld-start comparison (a start the attack cannot place), per RFA entry and seed.

  With full participation: accuracy at rho = 0.25 and 0.4 within `tolerance` points of the same seed's
  uncorrupted accuracy. With partial participation: at every rho > 0, no seed below the `baseline` aggregator's
  accuracy for that seed. Omniscient corruption only.
  """
  out = []
  entries = [a for a in dict.fromkeys(r['aggregator'] for r in results)
             if a.split('+')[0] == 'rfa']
  for group in _groups(results):
    records = [r for r in results if _group(r) == group]
    full = all(r.get('clients_per_round') == r.get('num_clients') for r in records) and \
        'num_clients' in records[0]
    for entry in entries:
      failures, compared = [], 0
      if full:
        clean = _accuracy(results, group, 'none', 0.0, entry, by_seed=True)
        levels = [rho for rho in (0.25, 0.4) if rho in fractions]
        for rho in levels:
          corrupted = _accuracy(results, group, 'omniscient', rho, entry, by_seed=True)
          compared += len(set(corrupted) & set(clean))
          failures += [f'rho={rho:g} seed {s}: {corrupted[s]:.1f} vs {clean[s]:.1f}'
                       for s in corrupted if s in clean and corrupted[s] < clean[s] - tolerance]
        goal = (f'within {tolerance:g} points of its uncorrupted accuracy at rho = '
                f'{", ".join(f"{r:g}" for r in levels)} for every seed')
      else:
        for rho in (r for r in fractions if r > 0):
          ours = _accuracy(results, group, 'omniscient', rho, entry, by_seed=True)
          base = _accuracy(results, group, 'omniscient', rho, baseline, by_seed=True)
          compared += len(set(ours) & set(base))
          failures += [f'rho={rho:g} seed {s}: {ours[s]:.1f} vs {base[s]:.1f}'
                       for s in ours if s in base and ours[s] < base[s]]
        goal = f'no seed below {baseline} at any rho > 0'
      if not compared:  # Nothing to judge it on (e.g. the baseline did not run).
        continue
      verdict = 'holds' if not failures else f'does not hold ({"; ".join(failures)})'
      out.append(f'- {group}, omniscient, {entry}: "{goal}": {verdict}.')
  return out


def plot(results: list[dict], fractions: list[float], path: str) -> None:
  plt = report.pyplot()
  models = _groups(results)
  corruptions = list(dict.fromkeys(r['corruption'] for r in results if r['corruption'] != 'none')) or ['none']
  aggregators = list(dict.fromkeys(r['aggregator'] for r in results))
  fig, axes = plt.subplots(len(models), len(corruptions), figsize=(3.6 * len(corruptions), 3.0 * len(models)),
                           squeeze=False, sharey=True)
  for (i, model), (j, corruption) in itertools.product(enumerate(models), enumerate(corruptions)):
    ax = axes[i][j]
    for k, aggregator in enumerate(aggregators):
      points = [(rho, np.mean(v), np.std(v)) for rho in fractions
                if (v := _accuracy(results, model, corruption, rho, aggregator))]
      if points:
        rho, mean, std = map(np.array, zip(*points))
        ax.errorbar(rho, mean, yerr=std, marker='o', ms=3, capsize=2, label=aggregator,
                    linestyle='--' if aggregator in ('median', 'trimmed_mean', 'krum') else '-', color=f'C{k}')
    ax.set_title(f'{model}, {corruption}', fontsize=9)
    ax.set_xlabel('corruption level rho')
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    if j == 0:
      ax.set_ylabel('test accuracy (%)')
  axes[0][-1].legend(fontsize=6, loc='lower left')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_results(results: list[dict], fractions: list[float], output_dir: str,
                  header: str) -> tuple[str, list[str]]:
  """Writes results.md (header, tables, claims) and results.json; returns the tables and the claims."""
  table = summarize(results, fractions)
  if max(fractions) > 0:
    table = summarize_at(results, max(fractions)) + '\n' + table
  claims = check_claims(results, fractions)
  if any(r['corruption'] == 'omniscient' for r in results):
    claims += check_start_goals(results, fractions)
  markdown = (header + '\n\n' + table + '\n' + '## The RFA paper\'s qualitative claims here\n\n' + '\n'.join(claims)
              + '\n')
  report.write_report(output_dir, markdown, results, indent=2)
  return table, claims


def header(base: config_lib.ExperimentConfig, rounds: int, seeds: list[int], last_evals: int,
           eval_every: int) -> str:
  return (f'Digits ({base.partition}), {base.num_clients} clients, {base.clients_per_round} per round, FedAvg '
          f'(client lr {base.client_lr}, momentum {base.client_momentum}, batch {base.batch_size}, '
          f'{base.local_epochs} local epoch(s)), {rounds} rounds, seeds {seeds}; RFA with {base.num_passes} passes. '
          f'Final accuracy = mean test accuracy over the last {last_evals} evaluated rounds (every {eval_every}). '
          f'rho = 0: no corruption. median, trimmed_mean and krum are NOT private (every update at the server); '
          f'trimmed_mean and krum know rho.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  for name in FLAGS.models:
    if name not in BASE_CONFIGS:
      raise app.UsageError(f'models: unknown model {name!r}; expected some of {list(BASE_CONFIGS)}')
  try:
    seeds = [int(s) for s in FLAGS.seeds]
    fractions = sorted(float(f) for f in FLAGS.fractions)
    participation = [int(k) for k in FLAGS.clients_per_round] or [None]
    shard, num_shards = study_runs.parse_shard(FLAGS.shard)
  except ValueError as e:
    raise app.UsageError(f'invalid study settings: {e}') from e
  # Every n-th cell: the grid is aggregator-major, so each shard gets a like share of the slow aggregators.
  grid = cells(FLAGS.models, FLAGS.corruptions, fractions, FLAGS.aggregators, seeds, participation)
  todo = grid[shard::num_shards]
  local_epochs = FLAGS.local_epochs or None
  if FLAGS.last_evals < 1:
    raise app.UsageError(f'last_evals must be a positive integer, got {FLAGS.last_evals}')
  configure = lambda cell: cell_config(cell, FLAGS.rounds, FLAGS.eval_every, FLAGS.output_dir, local_epochs,
                                      FLAGS.client_execution)
  for cell in todo:  # Every setting is checked before anything runs.
    try:
      experiment.validate(configure(cell))
    except ValueError as e:
      raise app.UsageError(f'invalid study settings: {e}') from e
  command_line.start_simulation()
  text = header(configure(grid[0]), FLAGS.rounds, seeds, FLAGS.last_evals, FLAGS.eval_every)
  results = []
  started = time.monotonic()
  for i, cell in enumerate(todo, 1):
    config = configure(cell)
    summary = study_runs.finished_summary(config) or experiment.run(config, show_progress=False).summary
    results.append({'model': cell.model, 'setting': setting_label(config), 'corruption': cell.corruption,
                    'rho': cell.rho, 'aggregator': cell.aggregator, 'seed': cell.seed,
                    'clients_per_round': config.clients_per_round, 'num_clients': config.num_clients,
                    'final_accuracy': final_accuracy(config.output_dir, FLAGS.last_evals),
                    'best_accuracy': summary['best_accuracy']})
    print(f'[{i}/{len(todo)}, {time.monotonic() - started:.0f}s] {setting_label(config)} {cell.corruption} '
          f'rho={cell.rho:g} {cell.aggregator} seed {cell.seed}: {100 * results[-1]["final_accuracy"]:.1f}%',
          flush=True)
    # After every run: a stopped study keeps its table.
    table, claims = write_results(results, fractions, FLAGS.output_dir, text)
    if i == len(todo) or todo[i].aggregator != cell.aggregator:  # And the figure after each aggregator's runs.
      plot(results, fractions, os.path.join(FLAGS.output_dir, 'results.png'))
  print(table)
  print('\n'.join(claims))
  print(f'Results: {os.path.abspath(FLAGS.output_dir)}/results.md')


if __name__ == '__main__':
  define_flags()
  command_line.run(main, command_line.STUDY_RESUMES)
