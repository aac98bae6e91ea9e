"""The GMA study on the paper's own data: Fashion-MNIST and LeNet, side by side with the paper's Table 2.

    python -m training.studies.gma_fmnist [--stage=all|tune|final|collect] [--settings=...] [--shard=i/n]

Learning rates tuned on two partitions with the edge rule, then tau; paired 95% t intervals of GMA - AVG over
`FINAL_SEEDS`; writes results.md/json/png under --output_dir. Protocol: docs/research/gma_fmnist_study.md"""

from __future__ import annotations

import collections
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from collections.abc import Sequence  # pylint: disable=g-import-not-at-top
from typing import Any, NamedTuple, Optional

from absl import app
from absl import flags
from absl import logging
import numpy as np

from training import command_line
from training import config as config_lib
from training.engine import client_execution
from training.runner import experiment
from training.studies.shared import fmnist_protocol
from training.studies.shared import gma_protocol
from training.studies.shared import intervals
from training.studies.shared import report
from training.studies.shared import study_runs

Run = gma_protocol.Run  # The study's cell.
SETTINGS = fmnist_protocol.SETTINGS  # The study's cells.
# Read by the figure only: kept out of results.json, which holds what the tables read.
_PLOT_ONLY = ('curves', 'curve_rounds')


class Point(NamedTuple):
  client_lr: float
  server_lr: float
  tau: float


class Study(fmnist_protocol.PartitionTuning):
  """The study's runs and what is known of them (finished runs read back from their directories)."""

  def __init__(self, settings: Sequence[str], methods: Sequence[str], tune_seeds: Sequence[int],
               final_seeds: Sequence[int], output_dir: str, rounds: Optional[int] = None,
               execution: str = client_execution.WORKER):
    self.settings, self.tune_seeds, self.seeds = list(settings), tuple(tune_seeds), tuple(final_seeds)
    self.methods = {s: [m for m in SETTINGS[s].methods if not methods or f'{m[0]}/{m[1]}' in methods]
                    for s in settings}
    self.output_dir, self.rounds, self.execution = output_dir, rounds, execution

  def config(self, run: Run) -> config_lib.ExperimentConfig:
    setting = SETTINGS[run.setting]
    return config_lib.ExperimentConfig(
        **setting.config, algorithm=run.algorithm, aggregator=run.aggregator, client_lr=run.client_lr,
        server_lr=run.server_lr, tau=run.tau, seed=run.seed, rounds=self.rounds or setting.rounds,
        validation_fraction=fmnist_protocol.VALIDATION_FRACTION if run.tuning else 0.0,
        client_execution=self.execution, adaptive_optimizer=gma_protocol.adaptive_optimizer(run.algorithm),
        output_dir=os.path.join(self.output_dir, 'runs', run.name))

  def tuning_runs(self, setting: str, method: tuple[str, str], point: Point) -> list[Run]:
    return [Run(setting, method[0], method[1], point.client_lr, point.server_lr, point.tau, seed, True)
            for seed in self.tune_seeds]

  def tuned(self, setting: str, method: tuple[str, str]) -> tuple[list[Point], Optional[Point], dict[str, Any]]:
    """(the points known so far, the chosen point or None while tuning is incomplete, what the tuning found)."""
    client_lrs, server_lrs = fmnist_protocol.grid(method[0])
    points = [Point(c, s, fmnist_protocol.STAGE1_TAU) for c in client_lrs for s in server_lrs]
    best = self.best(setting, method, points)
    if best is None:
      return points, None, {}
    extension = fmnist_protocol.edge_extension(best, client_lrs, server_lrs)
    points += extension
    lr_best = self.best(setting, method, [best] + extension)
    if lr_best is None:
      return points, None, {}
    found = {'grid_winner': best._asdict(), 'extension': [p._asdict() for p in extension],
             'edge': lr_best in extension}
    if not gma_protocol.is_gma(method[1]):
      return points, lr_best, found
    taus = [lr_best._replace(tau=t) for t in fmnist_protocol.TAUS]
    points += taus
    chosen = self.best(setting, method, [lr_best] + taus)
    return points, chosen, found

  def runnable(self, stages: str) -> tuple[list[Run], int]:
    """(runs whose inputs are known, number of (setting, method) cells still blocked on unfinished tuning)."""
    runs, blocked = [], 0
    for setting in self.settings:
      for method in self.methods[setting]:
        points, chosen, _ = self.tuned(setting, method)
        if stages in ('all', 'tune'):
          runs += [r for p in points for r in self.tuning_runs(setting, method, p)]
        if chosen is None:
          blocked += 1
        elif stages in ('all', 'final'):
          runs += self.final_runs(setting, method, chosen)
    return list(dict.fromkeys(runs)), blocked

  def final_runs(self, setting: str, method: tuple[str, str], point: Point) -> list[Run]:
    return [Run(setting, method[0], method[1], point.client_lr, point.server_lr, point.tau, seed, False)
            for seed in self.seeds]


# ----------------------------------------------------------------------------------------------------------------
# Results.


def collect(study: Study) -> list[dict[str, Any]]:
  """One record per (setting, method), for the settings whose methods' final runs all finished: a cell is reported
  whole or not at all, so a report taken while a cell runs (the end of a shard, a look mid-study) shows no part of
  it."""
  records = []
  for setting in study.settings:
    cell = []
    for method in study.methods[setting]:
      points, chosen, found = study.tuned(setting, method)
      if chosen is None:
        break
      finals = study.final_runs(setting, method, chosen)
      if any(study.summary(r) is None for r in finals):
        break
      tested = [study_runs.curves_with_rounds(study.config(r).output_dir, ['test/accuracy'])['test/accuracy']
                for r in finals]
      curves = [values for _, values in tested]
      last10 = [float(np.mean(c[-gma_protocol.LAST_EVALS:])) for c in curves]
      winner_curves = [study_runs.curve(study.config(r).output_dir, 'validation/accuracy')
                       for r in study.tuning_runs(setting, method, chosen)]
      cell.append({
          'setting': setting, 'algorithm': method[0], 'aggregator': method[1],
          'client_lr': chosen.client_lr, 'server_lr': chosen.server_lr,
          'tau': chosen.tau if gma_protocol.is_gma(method[1]) else None,
          'tuning_points': len(points), 'tuning_runs': len(points) * len(study.tune_seeds),
          'validation_score': study.score(setting, method, chosen), 'edge': found['edge'],
          'validation_converged': all(gma_protocol.converged(c) for c in winner_curves),
          'rounds': study.config(finals[0]).rounds, 'evaluations': len(curves[0]), 'seeds': list(study.seeds),
          'best': [float(np.max(c)) for c in curves],
          'last10': last10,
          'collapsed': [gma_protocol.at_chance(value) for value in last10],
          'masked_fraction': _mean_or_none([study_runs.mean_of(study.config(r).output_dir, 'masked_fraction')
                                            for r in finals]),
          'curves': curves,
          'curve_rounds': [rounds for rounds, _ in tested],
      })
    else:  # No method stopped short: the cell is whole.
      records += cell
  return records


def _mean_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
  known = [v for v in values if v is not None]
  return float(np.mean(known)) if known else None


def comparisons(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """GMA variant vs AVG per (setting, algorithm): paired per-seed differences (points) with 95% t intervals."""
  by = {(r['setting'], r['algorithm'], r['aggregator']): r for r in records}
  out = []
  for (setting, algorithm, aggregator), r in by.items():
    avg = by.get((setting, algorithm, 'mean'))
    if aggregator == 'mean' or avg is None:
      continue
    row = {'setting': setting, 'algorithm': algorithm, 'aggregator': aggregator}
    for metric in ('last10', 'best'):
      row[metric] = intervals.paired_comparison(r[metric], avg[metric])
    paper = fmnist_protocol.PAPER_TABLE2.get(SETTINGS[setting].paper_row or '', {}).get(algorithm)
    row['paper'] = None if paper is None else {'avg': paper[0], 'gma': paper[1], 'gap': paper[1] - paper[0]}
    out.append(row)
  return out


def table(records: list[dict[str, Any]], setting: str) -> str:
  lines = ['| algorithm | aggregator | best test % | last-10 % | final runs at chance | client lr | server lr | tau | '
           'masked fraction | tuning runs | validation converged |', '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in records:
    if r['setting'] == setting:
      tau = '-' if r['tau'] is None else f"{r['tau']:g}"
      masked = '-' if r['masked_fraction'] is None else f"{r['masked_fraction']:.3f}"
      lr = f"{r['client_lr']:g} | {r['server_lr']:g}" + (' (edge)' if r['edge'] else '')
      lines.append(f"| {r['algorithm']} | {r['aggregator']} | {report.mean_pm_std(r['best'])} | "
                   f"{report.mean_pm_std(r['last10'])} | "
                   f"{sum(r['collapsed'])} of {len(r['collapsed'])} | {lr} | {tau} | {masked} | {r['tuning_runs']} | "
                   f"{'yes' if r['validation_converged'] else 'NO'} |")
  return '\n'.join(lines)


def side_by_side(rows: list[dict[str, Any]], setting: str) -> str:
  lines = ['| algorithm | GMA variant | paper AVG -> GMA (gap), best | ours AVG -> GMA, best | '
           'GMA - AVG best, 95% CI | verdict (best) | ours AVG -> GMA, last-10 | GMA - AVG last-10, 95% CI | '
           'verdict (last-10) |',
           '|---|---|---|---|---|---|---|---|---|']
  for c in rows:
    if c['setting'] != setting:
      continue
    p = c['paper']
    paper = '-' if p is None else f"{p['avg']:.2f} -> {p['gma']:.2f} ({p['gap']:+.2f})"
    best, last = c['best'], c['last10']
    lines.append(
        f"| {c['algorithm']} | {c['aggregator']} | {paper} | {best['avg']:.2f} -> {best['gma']:.2f} | "
        f"{best['mean']:+.2f} [{best['low']:+.2f}, {best['high']:+.2f}] | {best['verdict']} | "
        f"{last['avg']:.2f} -> {last['gma']:.2f} | "
        f"{last['mean']:+.2f} [{last['low']:+.2f}, {last['high']:+.2f}] | {last['verdict']} |")
  return '\n'.join(lines)


def equal_lr_pairs(study: Study, setting: str) -> list[tuple[str, str, Point, tuple[float, float]]]:
  """The paper's App. D.6 / Table 10 question on one cell's tuning runs: at each starting-grid point (tau 0.4) where
  AVG and a GMA variant both finished, (algorithm, variant, point, (AVG's, GMA's score)); a score is the mean best
  validation accuracy over the tuning partitions."""
  out = []
  for algorithm in dict.fromkeys(a for a, _ in study.methods[setting]):
    if (algorithm, 'mean') not in study.methods[setting]:
      continue
    client_lrs, server_lrs = fmnist_protocol.grid(algorithm)
    for variant in [g for a, g in study.methods[setting] if a == algorithm and gma_protocol.is_gma(g)]:
      for point in (Point(c, s, fmnist_protocol.STAGE1_TAU) for c in client_lrs for s in server_lrs):
        scores = tuple(study.score(setting, (algorithm, g), point) for g in ('mean', variant))
        if None not in scores:
          out.append((algorithm, variant, point, scores))
  return out


def claims(study: Study, records: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
  """The paper's claims, each read from the intervals of the cells that finished; a claim whose cells did not run
  says so."""
  out = []
  for setting in study.settings:
    cell = [c for c in rows if c['setting'] == setting]
    if not cell:
      continue
    parts = []
    for metric, name in (('last10', 'last-10 (primary)'), ('best', 'best (the paper\'s)')):
      parts.append(f'{name}: ' + intervals.verdict_counts([c[metric]['verdict'] for c in cell]))
    with_paper = [c for c in cell if c['paper'] is not None]
    inside = sum(c['best']['low'] <= c['paper']['gap'] <= c['best']['high'] for c in with_paper)
    parts.append(f"the paper's gap lies inside our best-accuracy interval in {inside} of {len(with_paper)}")
    out.append(f'- "GMA outperforms AVG", {setting}: ' + '; '.join(parts) + '.')
    ended = collections.Counter()  # (AVG|GMA, collapsed|runs) -> count
    for r in records:
      if r['setting'] == setting:
        kind = 'AVG' if r['aggregator'] == 'mean' else 'GMA'
        ended[kind, 'collapsed'] += sum(r['collapsed'])
        ended[kind, 'runs'] += len(r['collapsed'])
    out.append(f"- Final runs that ended at chance (last-10 within {gma_protocol.CHANCE_POINTS:g} point of "
               f"{100 * gma_protocol.CHANCE_ACCURACY:g}%), {setting}: AVG {ended['AVG', 'collapsed']} of "
               f"{ended['AVG', 'runs']}, GMA (all variants) {ended['GMA', 'collapsed']} of "
               f"{ended['GMA', 'runs']}.")
  by = {(r['setting'], r['algorithm'], r['aggregator']): r for r in records}
  non_iid, iid = 'fmnist_label100', 'fmnist_iid100'
  pairs = []
  for algorithm in dict.fromkeys(r['algorithm'] for r in records):
    cells = [(by.get((s, algorithm, 'gma')), by.get((s, algorithm, 'mean'))) for s in (non_iid, iid)]
    if all(g is not None and a is not None for g, a in cells):
      gaps = [[100 * (x - y) for x, y in zip(g['best'], a['best'])] for g, a in cells]
      pairs.append(f'{algorithm} ' + '{:+.2f} [{:+.2f}, {:+.2f}]'.format(*intervals.welch_interval(*gaps)))
  if pairs:
    out.append(f'- "More so when non-iid" (GMA - AVG best-accuracy gap, {non_iid} minus {iid}; 95% Welch interval '
               f'over the seeds of the two cells): ' + ', '.join(pairs) + '.')
  else:
    out.append(f'- "More so when non-iid": not tested: it needs {non_iid} and {iid} both complete.')
  out.append('- "More so with more local epochs" (Table 9): not tested: the local-epoch axis (10 clients, full '
             'participation) is not among the settings run.')
  for setting in study.settings:
    pairs = equal_lr_pairs(study, setting) if any(r['setting'] == setting for r in records) else []
    if pairs:  # Only a cell whose runs all finished: no partial cell is reported.
      out.append(gma_protocol.equal_lr_line(
          [scores for *_, scores in pairs], f'{setting}, the tuning runs at equal learning rates (tau '
          f'{fmnist_protocol.STAGE1_TAU:g}, mean best validation accuracy over the tuning partitions)'))
  return out


def plot(records: list[dict[str, Any]], path: str) -> None:
  """Test accuracy over rounds: a row per setting, a panel per algorithm; each aggregator's mean over seeds (bold)
  and its seeds (thin), so a collapsed seed shows."""
  settings = list(dict.fromkeys(r['setting'] for r in records))
  algorithms = list(dict.fromkeys(r['algorithm'] for r in records))
  if not settings:
    return
  colors = {'mean': 'tab:blue', 'gma': 'tab:red', 'gma_dropin': 'tab:green'}
  def panel(setting, algorithm):
    return report.Panel(f'{setting}: {algorithm}', 'test accuracy %', [
        report.Series(r['aggregator'], colors.get(r['aggregator'], 'tab:gray'), r['curve_rounds'], r['curves'])
        for r in records if (r['setting'], r['algorithm']) == (setting, algorithm)])
  report.curves_figure([[panel(s, a) for a in algorithms] for s in settings], path)


def write_results(study: Study, records: list[dict[str, Any]]) -> str:
  rows = comparisons(records)
  claim_lines = claims(study, records, rows) if records else []
  cost = study_runs.cost_table(study_runs.cost_rows(study.settings, study.runnable('all')[0], study.summary))
  text = [f'GMA study on Fashion-MNIST with LeNet (`training.studies.gma_fmnist`). Tuning: mean best validation '
          f'accuracy over partitions {list(study.tune_seeds)} (20% of each client held out); finals: seeds '
          f'{list(study.seeds)} on all training examples. Accuracy % mean +- std over seeds; "best" = best test '
          f'accuracy over the evaluated rounds (our reading of Table 2\'s '
          f'"average best test performance"), "last-10" = mean of the last 10 rounds. '
          f'Intervals: paired per-seed GMA - AVG, 95% t.', '']
  for setting in study.settings:
    if any(r['setting'] == setting for r in records):
      rounds = next(r['rounds'] for r in records if r['setting'] == setting)
      text += [f'**{setting}: {SETTINGS[setting].label}, {rounds} rounds**', '',
               side_by_side(rows, setting), '', table(records, setting), '']
  if claim_lines:
    text += ['**The paper\'s claims here**', ''] + claim_lines + ['']
  text += ['**Where a round\'s time goes** (medians over the finished runs)', '', cost, '']
  markdown = '\n'.join(text) + '\n'
  # Every number of the report: the tables' inputs, and the lines read from runs the records do not hold (the
  # tuning runs behind the equal-learning-rate claim, the timings behind the cost table).
  report.write_report(study.output_dir, markdown, {
      'records': [{k: v for k, v in r.items() if k not in _PLOT_ONLY} for r in records],
      'comparisons': rows, 'claims': claim_lines, 'cost_table': cost})
  plot(records, os.path.join(study.output_dir, 'results.png'))
  return markdown


FLAGS = flags.FLAGS


def define_flags() -> None:
  gma_protocol.define_study_flags(SETTINGS, 'outputs/gma_fmnist_study')
  flags.DEFINE_list('tune_seeds', [str(s) for s in fmnist_protocol.TUNE_SEEDS], 'Tuning partitions (seeds).')
  flags.DEFINE_list('seeds', [str(s) for s in fmnist_protocol.FINAL_SEEDS], 'Seeds of the final runs.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  try:
    shard, num_shards = gma_protocol.checked_settings_and_shard(SETTINGS)
    study = Study(FLAGS.settings, FLAGS.methods, [int(s) for s in FLAGS.tune_seeds], [int(s) for s in FLAGS.seeds],
                  FLAGS.output_dir, FLAGS.rounds or None, FLAGS.client_execution)
    for setting in study.settings:  # Every setting is checked before anything runs.
      for method in study.methods[setting]:
        for point in study.tuned(setting, method)[0][:1]:
          for run in study.tuning_runs(setting, method, point):
            experiment.validate(study.config(run))
  except ValueError as e:
    raise app.UsageError(f'invalid study settings: {e}') from e
  if FLAGS.stage != 'collect':
    command_line.start_simulation()
    study_runs.run_all(study, FLAGS.stage, shard, num_shards)
  print(write_results(study, collect(study)))
  print(f'Results: {os.path.abspath(study.output_dir)}/results.md')


if __name__ == '__main__':
  define_flags()
  command_line.run(main, command_line.STUDY_RESUMES)
