"""The GMA claims study's report (`gma_fmnist_claims --stage=collect`), from its records: results.md, results.json.

Per finished cell: GMA - AVG beside the paper, convergence, the re-runs against the archived rows, a figure; then the
claims and the cost table. Apart from the study for its size: the study describes its cells (`Cell`), so no study is
imported here. The same records and runs give the same files, byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from training.studies.shared import gma_protocol
from training.studies.shared import intervals
from training.studies.shared import report
from training.studies.shared import study_runs

NAMES = {'test': 'test split', 'ood': 'OOD test clients'}  # A record's accuracies (its fields' prefixes).
_COLORS = {'mean': 'tab:blue', 'gma': 'tab:red', 'gma_dropin': 'tab:green', 'gma@tau0.4': 'tab:orange'}
_CLAIMS = {'table2': '"GMA outperforms AVG" (Table 2)', 'table9': '"GMA ahead of AVG" (Table 9, at this E)',
           'table3': '"in almost all cases gradient masking outperforms naive averaging" (Sec. 5.3, Table 3)'}


class Beside(NamedTuple):
  """Items 4 and 5: a cell that changes one thing of other cells' runs (the horizon, the batch size), whose GMA - AVG
  it is set beside."""
  sources: dict[str, tuple[str, str]]  # Algorithm -> ('archived', the archived study's cell) or ('study', a cell).
  differs: str  # What the other cells' runs had, e.g. '100 rounds'.


class Cell(NamedTuple):
  """What the report needs to know of a cell besides its records."""
  label: str
  accuracies: tuple[str, ...]  # Its accuracies, the primary first: ('ood', 'test') for a coloured cell.
  paper_table: Optional[str]  # 'table2', 'table3' or 'table9'.
  paper: dict[str, Optional[tuple[float, float]]]  # Algorithm -> the paper's (AVG, GMA), where it gives them.
  epochs: int  # Local epochs (Table 9's axis).
  archived: Optional[str] = None  # The archived study's cell that this cell re-runs.
  note: str = ''  # How the cell differs from the paper's, printed under its heading (e.g. the subset's local steps).
  beside: Optional[Beside] = None


def paper_method(algorithm: str, methods: Collection[str]) -> str:
  """The method set beside the paper's number of `algorithm` in the claims' counts, once per algorithm: GMA at the
  paper's tau 0.4 where the cell's `methods` have that variant (Tables 3 and 9; App. D.1: "we have maintained tau =
  0.4"), else GMA with tau tuned (Algorithm 2 for the adaptive servers, not the drop-in)."""
  fixed = f'{algorithm}/gma@tau0.4'
  return fixed if fixed in methods else f'{algorithm}/gma'


def comparisons(records: list[dict[str, Any]], cells: Mapping[str, Cell]) -> list[dict[str, Any]]:
  """Each GMA method against its algorithm's AVG in its cell: paired per-seed differences (points), 95% t interval
  and verdict, on each of the cell's accuracies (the primary first), with the paper's (AVG, GMA) beside."""
  by = {(r['setting'], r['method']): r for r in records}
  out = []
  for r in records:
    avg = by.get((r['setting'], f"{r['algorithm']}/mean"))
    if r['aggregator'] == 'mean' or avg is None:
      continue
    cell = cells[r['setting']]
    row = {'setting': r['setting'], 'method': r['method'], 'paper': cell.paper.get(r['algorithm'])}
    for prefix in cell.accuracies:
      for metric in ('best', 'last10'):
        row[f'{prefix}_{metric}'] = intervals.paired_comparison(r[f'{prefix}_{metric}'], avg[f'{prefix}_{metric}'])
    if 'ood' in cell.accuracies:
      row['ood_drop'] = ood_drop(r, avg)
    out.append(row)
  return out


def ood_drop(gma: Mapping[str, Any], avg: Mapping[str, Any]) -> dict[str, Any]:
  """Table 3's mechanism, GMA's motivation: the AND-mask should keep a model off what only some clients' data say
  (the colour), so its OOD clients should fall less far below the in-distribution test split than AVG's. Each arm's
  drop (in-distribution best - OOD best, points, mean over seeds) and GMA's drop - AVG's, paired by seed, with its
  95% t interval (no verdict: a smaller drop is GMA's claim here, not 'GMA ahead')."""
  drops = [[100 * (t - o) for t, o in zip(r['test_best'], r['ood_best'])] for r in (gma, avg)]
  mean, low, high = intervals.paired_interval([g - a for g, a in zip(*drops)])
  return {'avg': float(np.mean(drops[1])), 'gma': float(np.mean(drops[0])), 'mean': mean, 'low': low, 'high': high}


def ood_drop_table(rows: list[dict[str, Any]], setting: str) -> str:
  lines = ['| method | in distribution - OOD, best, points: AVG -> GMA | GMA - AVG, 95% CI |', '|---|---|---|']
  for c in rows:
    if c['setting'] == setting and 'ood_drop' in c:
      m = c['ood_drop']
      lines.append(f"| {c['method']} | {m['avg']:.2f} -> {m['gma']:.2f} | {_ci(m)} |")
  return '\n'.join(lines)


def side_by_side(rows: list[dict[str, Any]], setting: str, cell: Cell) -> str:
  """A cell's comparisons beside the paper's numbers (Table 3: best; Table 9: last-10; Table 2: best)."""
  prefix = cell.accuracies[0]
  beside = ' in distribution: AVG -> GMA, best; last-10 |' if prefix == 'ood' else ''
  lines = [f'| method | paper AVG -> GMA | ours AVG -> GMA, best ({prefix}) | GMA - AVG best, 95% CI | verdict | '
           f'ours AVG -> GMA, last-10 ({prefix}) | GMA - AVG last-10, 95% CI | verdict |' + beside,
           '|---|---|---|---|---|---|---|---|' + ('---|' if beside else '')]
  for c in rows:
    if c['setting'] != setting:
      continue
    paper = '-' if c['paper'] is None else f"{c['paper'][0]:.2f} -> {c['paper'][1]:.2f}"
    cells = [f"{m['avg']:.2f} -> {m['gma']:.2f} | {_ci(m)} | "
             f"{m['verdict']}" for m in (c[f'{prefix}_best'], c[f'{prefix}_last10'])]
    if beside:
      cells.append(f"{c['test_best']['avg']:.2f} -> {c['test_best']['gma']:.2f}; "
                   f"{c['test_last10']['avg']:.2f} -> {c['test_last10']['gma']:.2f}")
    lines.append(f"| {c['method']} | {paper} | " + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def convergence_table(records: list[dict[str, Any]], setting: str, cell: Cell) -> str:
  """A cell's final runs by the convergence rule (`gma_protocol.converged`, on each accuracy's evaluations):
  per method, how many converged, and the rise (last 10 evaluations' mean minus the 10 before's, mean over seeds);
  beside, the runs that ended badly: stopped early (non-finite updates; scored on the rounds they ran) and at chance
  over their last 10 evaluations (`gma_protocol.at_chance`: collapsed), each of which weighs on an interval."""
  lines = ['| method | rounds | stopped early | ' + ' | '.join(
      f'converged ({p}) | rise ({p}), points | last-10 at chance ({p})' for p in cell.accuracies) + ' |',
           '|---|---|---|' + '---|---|---|' * len(cell.accuracies)]
  for r in records:
    if r['setting'] == setting:
      parts = [_of(r['stopped'])]
      for p in cell.accuracies:
        rises = [x for x in r[f'{p}_rise'] if x is not None]
        parts += [_of(r[f'{p}_converged']), f'{np.mean(rises):+.2f}' if rises else '-', _of(r[f'{p}_collapsed'])]
      lines.append(f"| {r['method']} | {r['rounds']} | " + ' | '.join(parts) + ' |')
  return '\n'.join(lines)


def _of(flags: Sequence[bool]) -> str:
  return f'{sum(flags)} of {len(flags)}'


def against_archived(records: list[dict[str, Any]], rows: list[dict[str, Any]], cells: Mapping[str, Cell],
                     archived: dict[str, Any]) -> list[dict[str, Any]]:
  """Each re-run row beside the archived study's row of its cell and method (`archived`: that study's
  results.json): test accuracy, re-run - archived per metric (`intervals.change`), and for a GMA method its verdict
  against AVG in the archived study and in the re-run."""
  old = {(r['setting'], r['algorithm'], r['aggregator']): r for r in archived['records']}
  old_rows = {(c['setting'], c['algorithm'], c['aggregator']): c for c in archived['comparisons']}
  new_rows = {(c['setting'], c['method']): c for c in rows}
  out = []
  for r in records:
    key = (cells[r['setting']].archived, r['algorithm'], r['aggregator'])
    if key not in old or r['variant']:
      continue
    row = {'setting': r['setting'], 'archived_setting': key[0], 'method': r['method']}
    for metric in ('best', 'last10'):
      row[metric] = intervals.change(r[f'test_{metric}'], old[key][metric], r['seeds'] == old[key]['seeds'])
    new = new_rows.get((r['setting'], r['method']))
    if key in old_rows and new is not None:
      row['verdicts'] = {m: [old_rows[key][m]['verdict'], new[f'test_{m}']['verdict']] for m in ('best', 'last10')}
    out.append(row)
  return out


def beside_rows(rows: list[dict[str, Any]], cells: Mapping[str, Cell],
                archived: dict[str, Any]) -> list[dict[str, Any]]:
  """Items 4 and 5: each GMA row of a cell with `beside` and the same method's GMA - AVG in its source cell (the
  archived study's `archived` results.json, or this study's `rows`, where that cell was collected): interval and
  verdict there and here, per metric, on the test split."""
  old = {(c['setting'], c['algorithm'], c['aggregator']): c for c in archived.get('comparisons', [])}
  ours = {(c['setting'], c['method']): c for c in rows}
  out = []
  for c in rows:
    beside = cells[c['setting']].beside
    algorithm, aggregator = c['method'].split('/')
    if beside is None or algorithm not in beside.sources:
      continue
    kind, source = beside.sources[algorithm]
    if kind == 'archived':
      there = old.get((source, algorithm, aggregator))
      there = None if there is None else {m: there[m] for m in ('best', 'last10')}
    else:
      there = ours.get((source, c['method']))
      there = None if there is None else {m: there[f'test_{m}'] for m in ('best', 'last10')}
    if there is not None:
      out.append({'setting': c['setting'], 'method': c['method'], 'source': f'{kind} {source}',
                  'there': there, 'here': {m: c[f'test_{m}'] for m in ('best', 'last10')}})
  return out


def beside_table(compared: list[dict[str, Any]], setting: str) -> str:
  header = '| method | beside | GMA - AVG best, 95% CI: there -> here | verdict | the same, last-10 | verdict |'
  lines = [header, '|---|---|---|---|---|---|']
  for c in [c for c in compared if c['setting'] == setting]:
    there, here = c['there'], c['here']
    parts = [f"{_ci(there[m])} -> {_ci(here[m])} | {there[m]['verdict']} -> {here[m]['verdict']}"
             for m in ('best', 'last10')]
    lines.append(f"| {c['method']} | {c['source']} | " + ' | '.join(parts) + ' |')
  return '\n'.join(lines)


def _ci(m: Mapping[str, Any]) -> str:
  """An interval's mean and its 95% bounds, in points."""
  return f"{m['mean']:+.2f} [{m['low']:+.2f}, {m['high']:+.2f}]"


def archived_table(rows: list[dict[str, Any]], setting: str) -> str:
  lines = ['| method | best %: archived -> re-run | re-run - archived, 95% CI | last-10 %: archived -> re-run | '
           're-run - archived, 95% CI | GMA - AVG verdict, best: archived -> re-run | the same, last-10 |',
           '|---|---|---|---|---|---|---|']
  for c in rows:
    if c['setting'] == setting:
      parts = [f"{m['old']:.2f} -> {m['new']:.2f} | {_ci(m)}"
               + ('' if m['paired'] else ' (Welch)') for m in (c['best'], c['last10'])]
      parts += [' -> '.join(c['verdicts'][m]) if 'verdicts' in c else '-' for m in ('best', 'last10')]
      lines.append(f"| {c['method']} | " + ' | '.join(parts) + ' |')
  return '\n'.join(lines)


def claims(settings: Sequence[str], records: list[dict[str, Any]], rows: list[dict[str, Any]],
           cells: Mapping[str, Cell]) -> list[str]:
  """The paper's claims, each read from the intervals of the cells that finished, on a cell's primary accuracy,
  with the paper's gap against our interval of the metric it reports (Table 9: last-10, else best); per cell, how
  many final runs converged by the rule; Table 9's trend."""
  out = []
  for setting in [s for s in settings if any(r['setting'] == s for r in records)]:
    cell, prefix = cells[setting], cells[setting].accuracies[0]
    compared = [c for c in rows if c['setting'] == setting]
    if compared:
      parts = [f'{name}: ' + intervals.verdict_counts([c[f'{prefix}_{m}']['verdict'] for c in compared])
               for m, name in (('best', 'best'), ('last10', 'last-10'))]
      metric = 'last10' if cell.paper_table == 'table9' else 'best'
      methods = {c['method'] for c in compared}
      beside = [c for c in compared if c['paper'] is not None
                and c['method'] == paper_method(c['method'].split('/')[0], methods)]
      paper = [(c['paper'][1] - c['paper'][0], c[f'{prefix}_{metric}']) for c in beside]
      parts.append(f"the paper's gap inside our {metric.replace('last10', 'last-10')} interval (GMA "
                   f"{'at tau 0.4' if any('@tau0.4' in c['method'] for c in beside) else 'with tau tuned'}) in "
                   f"{sum(m['low'] <= gap <= m['high'] for gap, m in paper)} of {len(paper)}" if paper
                   else 'the paper gives no number here')
      out.append(f'- {_claim(cell)}, {setting} ({prefix}): ' + '; '.join(parts) + '.')
    ran = {kind: [r for r in records if r['setting'] == setting and (r['aggregator'] == 'mean') == (kind == 'AVG')]
           for kind in ('AVG', 'GMA')}
    counts = {kind: [sum((r[key] for r in v), []) for key in (f'{prefix}_converged', 'stopped', f'{prefix}_collapsed')]
              for kind, v in ran.items()}
    out.append(f'- Converged by the rule ({prefix} accuracy: the last 10 evaluations\' mean under '
               f'{gma_protocol.PLATEAU_POINTS:g} point above the 10 before\'s), {setting}: '
               + ', '.join(f'{kind} {_of(c[0])}' for kind, c in counts.items()) + ' final runs; stopped early: '
               + ', '.join(f'{kind} {sum(c[1])}' for kind, c in counts.items()) + '; last-10 at chance: '
               + ', '.join(f'{kind} {sum(c[2])}' for kind, c in counts.items()) + '.')
  if any(cells[s].paper_table == 'table9' for s in settings):
    out += epochs_line(rows, cells)
  return out if records else []


def _claim(cell: Cell) -> str:
  """The claim a cell tests; Table 3's with the range of the paper's own GMA - AVG gaps in the cell's row (its
  mixed-skew rows gain 1.5 to 3.6 points, the feature-skew rows 0.0 to 1.5)."""
  claim = _CLAIMS.get(cell.paper_table, _CLAIMS['table2'])
  gaps = [gma - avg for avg, gma in (p for p in cell.paper.values() if p is not None)]
  if cell.paper_table == 'table3' and gaps:
    claim += f"; the paper's GMA - AVG in this row {min(gaps):+.2f} to {max(gaps):+.2f} points"
  return claim


def epochs_line(rows: list[dict[str, Any]], cells: Mapping[str, Cell]) -> list[str]:
  """Table 9's "the gain grows with the local epochs", a line per GMA arm (tau 0.4, the paper's, first; then tau
  tuned): FedAvg GMA - AVG, last-10, per finished E beside the paper's gap, and the Welch interval of the largest
  finished E's gap minus the smallest's."""
  return [_epochs_arm(rows, cells, method, name) for method, name in
          (('fedavg/gma@tau0.4', 'GMA at tau 0.4'), ('fedavg/gma', 'GMA with tau tuned'))]


def _epochs_arm(rows: list[dict[str, Any]], cells: Mapping[str, Cell], method: str, name: str) -> str:
  gaps = {cells[c['setting']].epochs: (c['test_last10'], c['paper']) for c in rows
          if cells[c['setting']].paper_table == 'table9' and c['method'] == method}
  claim = f'- "More so with more local epochs" (Table 9; FedAvg, {name} - AVG, last-10, points)'
  if len(gaps) < 2:
    return f'{claim}: not tested: it needs two of the local-epoch cells complete ({len(gaps)} is).'
  each = [f"E={e} {_ci(g)}"
          + ('' if paper is None else f' (paper {paper[1] - paper[0]:+.2f})') for e, (g, paper) in sorted(gaps.items())]
  low, high = min(gaps), max(gaps)
  trend = intervals.welch_interval(gaps[high][0]['differences'], gaps[low][0]['differences'])
  return (f'{claim}: ' + ', '.join(each) + f'; E={high} minus E={low}: '
          + '{:+.2f} [{:+.2f}, {:+.2f}] (95% Welch).'.format(*trend))


def plot(records: list[dict[str, Any]], setting: str, cell: Cell, path: str) -> None:
  """A finished cell's accuracy over rounds: a panel per algorithm, a row per accuracy (the primary first); each
  method's mean over the final seeds (bold) and its seeds (thin)."""
  ours = [r for r in records if r['setting'] == setting]

  def panel(prefix, algorithm):
    series = []
    for r in [r for r in ours if r['algorithm'] == algorithm]:
      label = r['method'].split('/', 1)[1]
      rounds, values = zip(*r[f'{prefix}_curves'])
      series.append(report.Series(label, _COLORS.get(label, 'tab:gray'), rounds, values))
    return report.Panel(f'{setting}: {algorithm}', f'{NAMES[prefix]} accuracy %', series)
  algorithms = list(dict.fromkeys(r['algorithm'] for r in ours))
  report.curves_figure([[panel(p, a) for a in algorithms] for p in cell.accuracies], path)


def tuning_check(records: list[dict[str, Any]], setting: str) -> list[str]:
  """A cell that takes another's learning rates and checks them (Table 9's E = 10 and 20): per method, the point that
  scores best on this cell's validation split among the source's choice and its client-lr neighbours."""
  checked = [r for r in records if r['setting'] == setting and r['tuning'].get('check')]
  if not checked:
    return []
  lines = [f"The learning rates come from `{checked[0]['tuning']['from']}`; checked here (tau 0.4, on this cell's "
           'validation split, among that choice and its client-lr neighbours):', '',
           '| method | client lr, server lr taken | this cell\'s winner: client lr, server lr | the same |',
           '|---|---|---|---|']
  for r in checked:
    own = r['tuning']['check']['own_winner']
    lines.append(f"| {r['method']} | {r['client_lr']:g}, {r['server_lr']:g} | {own['client_lr']:g}, "
                 f"{own['server_lr']:g} | {'yes' if r['tuning']['check']['same_learning_rates'] else 'no'} |")
  return lines + ['']


def _cell_section(setting: str, records: list[dict[str, Any]], rows: list[dict[str, Any]], cell: Cell,
                  archived: list[dict[str, Any]], compared: list[dict[str, Any]]) -> list[str]:
  first = next(r for r in records if r['setting'] == setting)
  text = [f"**{setting}: {cell.label}, {first['rounds']} rounds, final seeds {first['seeds']}**", '']
  text += [cell.note, ''] if cell.note else []
  text += [side_by_side(rows, setting, cell), '']
  text += tuning_check(records, setting)
  if 'ood' in cell.accuracies:
    text += ['How far the OOD test clients fall below the in-distribution test split (the colour\'s bite; GMA\'s '
             'invariance would make its drop the smaller):', '', ood_drop_table(rows, setting), '']
  text += ['Convergence of the final runs (the rule: `gma_protocol.converged`):', '',
           convergence_table(records, setting, cell), '']
  if cell.archived:
    text += [f'Test accuracy against the archived `{cell.archived}` rows (docs/research/gma_fmnist_study.json; '
             'intervals paired by seed):', '', archived_table(archived, setting), '']
  if cell.beside:
    text += [f'GMA - AVG here beside the same methods\' in the cells whose runs had {cell.beside.differs} (test split; '
             'a source cell not collected here is left out):', '', beside_table(compared, setting), '']
  return text + [f'![{setting}](curves_{setting}.png)', '']


def write(output_dir: str, settings: Sequence[str], records: list[dict[str, Any]], cells: Mapping[str, Cell],
          cost: list[dict[str, Any]], archived_path: str, unscored: Sequence[str] = ()) -> str:
  """results.md, results.json (every number of the report) and a figure per finished cell (curves_<setting>.png)
  under `output_dir`; `cost`: `study_runs.cost_rows`; `archived_path`: the archived study's results.json;
  `unscored`: final runs that finished without an evaluation (stopped early), whose cells are left out."""
  rows = comparisons(records, cells)
  archived, compared = [], []
  if any(cells[r['setting']].archived or cells[r['setting']].beside for r in records):
    with open(archived_path) as f:
      old = json.load(f)
    archived, compared = against_archived(records, rows, cells, old), beside_rows(rows, cells, old)
  finished = [s for s in settings if any(r['setting'] == s for r in records)]
  text = ['GMA where the paper says it helps most (`training.studies.gma_fmnist_claims`): paired per-seed GMA - AVG, '
          '95% t intervals, in points. Coloured cells: primary accuracy on the OOD test clients.', '']
  if not finished:
    text += ['No cell is complete yet: a cell is reported once every final run of every method in it finished.', '']
  if unscored:
    text += ['Left out: a final run that stopped (non-finite updates) before its first evaluation has no accuracy to '
             'score, so its cell is not reported: ' + ', '.join(f'`{name}`' for name in unscored) + '.', '']
  for setting in finished:
    text += _cell_section(setting, records, rows, cells[setting], archived, compared)
  claim_lines = claims(settings, records, rows, cells)
  if claim_lines:
    text += ['**The paper\'s claims here**', ''] + claim_lines + ['']
  text += ['**Where a round\'s time goes** (medians over every finished run of the settings, tuning runs and cells '
           'not yet complete included; evaluation, release and checkpoint run beside the next round\'s training where '
           'they may, `training.runner.background`: such a round takes about its training plus `waited`)', '',
           study_runs.cost_table(cost), '']
  markdown = '\n'.join(text) + '\n'
  report.write_report(output_dir, markdown, {
      'records': [{k: v for k, v in r.items() if not k.endswith('_curves')} for r in records],
      'comparisons': rows, 'against_archived': archived, 'beside': compared, 'claims': claim_lines, 'cost': cost,
      'unscored': list(unscored)})
  for setting in finished:
    plot(records, setting, cells[setting], os.path.join(output_dir, f'curves_{setting}.png'))
  return markdown
