"""Compares finished runs: a table of the settings that differ and their accuracy, and one plot of their curves.

    python -m training.compare DIR [DIR ...] [--plot=PATH]

DIR: a run's --output_dir, or a `--seeds` directory of `seed_<s>` runs; runs differing only by seed form a group.
Groups, columns, plot, errors: docs/experiments.md#comparing-runs-and-seeds-trainingcompare---seeds"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any, Optional

from absl import app
from absl import flags
import numpy as np

from training import command_line
from training import config as config_lib
from training import safe_files
from training.runner import experiment

SEED_DIR = config_lib.SEED_DIR  # What `training.run --seeds` names each seed's run directory inside --output_dir.
_SEED_DIR = re.compile('^' + re.escape(SEED_DIR).replace(re.escape('{}'), r'(\d+)') + '$')
PLOT_NAME = 'compare.png'
# The PNG text chunk that marks a plot of this command: only such a file may be replaced by a new plot.
PLOT_SOFTWARE = 'training.compare'
_PLOT_MARK = b'tEXtSoftware\x00' + PLOT_SOFTWARE.encode()
_PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
_MAX_PLOT_BYTES = 16 << 20
# summary.json's accuracies (a number in [0, 1], or null).
_ACCURACY_KEYS = ('final_accuracy', 'best_accuracy', 'final_validation_accuracy', 'best_validation_accuracy')
# The settings in which the runs of one group may differ: the seed, and where a run's files and datasets were
# and how often it saved (they change nothing it computes: data_dir, workers, dataset_placement, client_loop,
# checkpoint_every).
_PER_RUN = ('seed', 'output_dir', 'data_dir', 'workers', 'dataset_placement', 'client_loop', 'checkpoint_every')


class CompareError(ValueError):
  """A directory given is not a finished run (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Run:
  """One finished run, read back from its directory."""
  path: str  # As given (or found under a --seeds directory).
  config: dict[str, Any]  # The completed settings.
  summary: dict[str, Any]
  rows: list[dict[str, float]]  # metrics.csv.

  @property
  def tuning(self) -> bool:
    return float(self.config.get('validation_fraction') or 0) > 0

  @property
  def accuracy_key(self) -> str:
    """metrics.csv's column of the accuracy this run reports."""
    return 'validation/accuracy' if self.tuning else 'test/accuracy'

  def accuracy(self, which: str) -> Optional[float]:
    """`final` or `best` accuracy from summary.json (the validation one for a tuning run); None if absent."""
    key = f'{which}_validation_accuracy' if self.tuning else f'{which}_accuracy'
    value = self.summary.get(key)
    return None if value is None else float(value)


@dataclasses.dataclass(frozen=True)
class Group:
  """Runs whose settings differ only by seed and output directory."""
  runs: tuple[Run, ...]

  @property
  def config(self) -> dict[str, Any]:
    return self.runs[0].config

  @property
  def seeds(self) -> list[int]:
    return [r.config['seed'] for r in self.runs]

  @property
  def label(self) -> str:
    """The --seeds directory when every run is one of its `seed_<s>` subdirectories, else the runs' paths."""
    parents = {os.path.dirname(os.path.normpath(r.path)) for r in self.runs}
    if len(parents) == 1 and all(_SEED_DIR.match(os.path.basename(os.path.normpath(r.path))) for r in self.runs):
      return parents.pop() or '.'
    return ', '.join(os.path.normpath(r.path) for r in self.runs)

  def accuracies(self, which: str) -> list[float]:
    return [a for a in (r.accuracy(which) for r in self.runs) if a is not None]

  def curve(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rounds, mean, std) of the accuracy over the group's runs, at the rounds every run evaluated."""
    series = [{r['round']: r[run.accuracy_key] for r in run.rows if run.accuracy_key in r and 'round' in r}
              for run in self.runs]
    rounds = sorted(set.intersection(*(set(s) for s in series))) if series else []
    values = np.array([[s[x] for x in rounds] for s in series], dtype=float).reshape(len(series), len(rounds))
    std = values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros(len(rounds))
    return np.array(rounds, dtype=float), values.mean(axis=0), std


def _type_problem(value: Any, kind: str) -> Optional[str]:
  """Why `value` (from JSON) is not of the type `kind` an `ExperimentConfig` field declares; None if it is."""
  optional = kind.startswith('Optional[')
  kind = kind.replace('Optional[', '').rstrip(']')
  if value is None:
    return None if optional else f'null, not {kind}'
  accepted = {'bool': (bool,), 'int': (int,), 'float': (int, float), 'str': (str,)}.get(kind)
  if accepted is None:
    return None
  if isinstance(value, bool) != (kind == 'bool') or not isinstance(value, accepted):
    return f'{json.dumps(value)[:40]}, not {kind}'
  if kind == 'float' and not math.isfinite(value):
    return f'{value}, not a finite number'
  return None


def _check_settings(saved: dict[str, Any], where: str) -> None:
  """`CompareError` when a setting of `ExperimentConfig` in `saved` has another type than its field's."""
  kinds = {f.name: str(f.type) for f in dataclasses.fields(config_lib.ExperimentConfig)}
  for name, value in saved.items():
    problem = _type_problem(value, kinds[name]) if name in kinds else None
    if problem is not None:
      raise CompareError(f'{where} is damaged (setting {name} is {problem})')


def _check_accuracy(value: Any, what: str, where: str) -> None:
  """`CompareError` unless `value` is None or a finite number in [0, 1]."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise CompareError(f'{where} is damaged ({what} is {json.dumps(value)[:40]}, not a number)')
  if not (math.isfinite(value) and 0 <= value <= 1):
    raise CompareError(f'{where} is damaged ({what} is {value}: an accuracy is a finite number in [0, 1])')


def _read_json(path: str) -> dict[str, Any]:
  try:
    return safe_files.read_json_object(path)
  except ValueError as e:
    raise CompareError(f'{path} is damaged ({e})') from None


def read_run(path: str) -> Run:
  """The finished run in `path`; `CompareError` naming the path (or the damaged file) when it is not one."""
  summary_path = os.path.join(path, 'summary.json')
  config_path = os.path.join(path, experiment.CONFIG_FILE)
  if not os.path.lexists(summary_path):
    if os.path.lexists(config_path):
      raise CompareError(f'{path}: the run has not finished (no summary.json); rerun its command to finish it, or '
                         f'leave it out')
    raise CompareError(f'{path} is not a run directory (no summary.json or {experiment.CONFIG_FILE})')
  summary = _read_json(summary_path)
  for key in _ACCURACY_KEYS:
    _check_accuracy(summary.get(key), key, summary_path)
  saved, where = summary.get('config'), summary_path
  if not isinstance(saved, dict) and os.path.lexists(config_path):
    saved, where = _read_json(config_path), config_path
  if not isinstance(saved, dict):
    raise CompareError(f'{path}: neither summary.json nor {experiment.CONFIG_FILE} holds the run\'s settings')
  _check_settings(saved, where)
  csv_path = os.path.join(path, 'metrics.csv')
  try:
    rows = experiment._read_rows(csv_path)  # pylint: disable=protected-access
  except ValueError as e:
    raise CompareError(f'{csv_path} is damaged ({e})') from None
  run = Run(path, experiment.completed_config(saved), summary, rows)
  for row in rows:
    if run.accuracy_key in row:
      where = f'round {row["round"]:g}' if 'round' in row else 'a row without a round'
      _check_accuracy(row[run.accuracy_key], f'{run.accuracy_key} of {where}', csv_path)
  return run


def run_directories(path: str) -> list[str]:
  """`path` if it is a run directory, else its `seed_<s>` run subdirectories in seed order; `CompareError` if
  neither."""
  if not os.path.exists(path):
    raise CompareError(f'{path}: no such directory')
  if not os.path.isdir(path):
    raise CompareError(f'{path} is not a directory')
  if any(os.path.lexists(os.path.join(path, n)) for n in ('summary.json', experiment.CONFIG_FILE)):
    return [path]
  seeds = sorted((int(m.group(1)), name) for name in os.listdir(path)
                 if (m := _SEED_DIR.match(name)) and os.path.isdir(os.path.join(path, name)))
  if not seeds:
    raise CompareError(f'{path} is not a run directory (no summary.json or {experiment.CONFIG_FILE}, and no '
                       f'{SEED_DIR.format("<s>")} runs in it)')
  return [os.path.join(path, name) for _, name in seeds]


def read_runs(paths: Sequence[str]) -> list[Run]:
  """Every run the paths name (each once, in the order given)."""
  runs, seen = [], set()
  for path in paths:
    for directory in run_directories(path):
      real = os.path.realpath(directory)
      if real not in seen:
        seen.add(real)
        runs.append(read_run(directory))
  return runs


def _group_key(config: dict[str, Any]) -> str:
  return json.dumps({k: v for k, v in config.items() if k not in _PER_RUN}, sort_keys=True, default=str)


def group_runs(runs: Sequence[Run]) -> list[Group]:
  """Runs that differ only by seed and output directory, grouped, in the order of their first run."""
  groups: dict[str, list[Run]] = {}
  for run in runs:
    groups.setdefault(_group_key(run.config), []).append(run)
  return [Group(tuple(members)) for members in groups.values()]


def differing_settings(groups: Sequence[Group]) -> list[str]:
  """The settings whose values differ across the groups, in the runner's flag order (then any others)."""
  order = [f.name for f in dataclasses.fields(config_lib.ExperimentConfig)]
  names = set().union(*(g.config for g in groups)) - set(_PER_RUN)
  differ = [n for n in names if len({json.dumps(g.config.get(n), default=str) for g in groups}) > 1]
  return sorted(differ, key=lambda n: (order.index(n) if n in order else len(order), n))


def _setting(value: Any) -> str:
  if isinstance(value, float):
    return f'{value:g}'
  return str(value)


def mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
  """Mean and sample standard deviation (n - 1; None for one value); (None, None) for none."""
  if not values:
    return None, None
  return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def _percent(values: Sequence[float]) -> str:
  mean, std = mean_std(values)
  if mean is None:
    return '-'
  return f'{100 * mean:.2f}' + ('' if std is None else f' ± {100 * std:.2f}')


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def table(groups: Sequence[Group]) -> str:
  """The Markdown comparison table: one row per group."""
  settings = differing_settings(groups)
  show_split = any(r.tuning for g in groups for r in g.runs)
  header = ['runs', *settings, *(['split'] if show_split else []), 'n', 'seeds', 'final accuracy (%)',
            'best accuracy (%)']
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for group in groups:
    split = sorted({'validation' if r.tuning else 'test' for r in group.runs})
    row = [group.label, *(_setting(group.config.get(s)) for s in settings), *(['/'.join(split)] if show_split else []),
           str(len(group.runs)), ','.join(str(s) for s in group.seeds), _percent(group.accuracies('final')),
           _percent(group.accuracies('best'))]
    lines.append('| ' + ' | '.join(_cell(c) for c in row) + ' |')
  return '\n'.join(lines)


def default_plot_path(paths: Sequence[str]) -> str:
  """`compare.png` in the first directory given (a run's own directory, or a `--seeds` directory): never in a
  directory above the ones given (the runs' common ancestor could be / for runs under /tmp and /var/tmp)."""
  return os.path.join(paths[0], PLOT_NAME)


def plot_target_problem(path: str) -> Optional[str]:
  """Why a plot must not be written at `path` (None: it may): a file is there that is not a plot of this command
  (a PNG with its 'Software' text chunk), e.g. a run's summary.json; a link or anything but a regular file."""
  if not os.path.lexists(path):
    return None
  refuse = f'--plot {path} exists and is not a plot of training.compare, which the plot would replace'
  if os.path.islink(path):
    return f'{refuse} (a symbolic link); give another --plot'
  try:
    data = safe_files.read_bytes(path, _MAX_PLOT_BYTES)
  except (OSError, ValueError) as e:
    return f'{refuse} ({getattr(e, "strerror", None) or e}); give another --plot'
  if data.startswith(_PNG_MAGIC) and _PLOT_MARK in data:
    return None
  return f'{refuse}; give another --plot (or remove it)'


def plot(groups: Sequence[Group], path: str) -> None:
  """One PNG: each group's mean accuracy curve (+- one standard deviation where it has several runs)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  settings = differing_settings(groups)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for group in groups:
    rounds, mean, std = group.curve()
    if not len(rounds):
      continue
    name = ', '.join(f'{s}={_setting(group.config.get(s))}' for s in settings) or group.label
    line, = ax.plot(rounds, 100 * mean, label=f'{name} (n={len(group.runs)})')
    if len(group.runs) > 1:
      ax.fill_between(rounds, 100 * (mean - std), 100 * (mean + std), color=line.get_color(), alpha=0.2)
  splits = sorted({r.accuracy_key for g in groups for r in g.runs})
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.set_xlabel('round')
  ax.set_ylabel(f'{" / ".join(s.split("/")[0] for s in splits)} accuracy (%)')
  ax.set_title('mean over seeds' + (' (band: ± 1 std)' if any(len(g.runs) > 1 for g in groups) else ''))
  ax.grid(alpha=0.3)
  if ax.get_lines():
    ax.legend(fontsize='small')
  fig.tight_layout()
  image = io.BytesIO()
  fig.savefig(image, format='png', dpi=100, metadata={'Software': PLOT_SOFTWARE})
  plt.close(fig)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  safe_files.write_atomic(path, image.getvalue())


flags.DEFINE_string('plot', None, f'Where to write the PNG of the accuracy curves (default: {PLOT_NAME} in the '
                    'first DIR given; empty: no plot). Never replaces a file that is not a plot of this command.')
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
  paths = argv[1:]
  if not paths:
    raise app.UsageError('usage: python -m training.compare DIR [DIR ...] [--plot=PATH] (DIR: a run\'s '
                         '--output_dir, or one holding seed_<s> runs)')
  try:
    runs = read_runs(paths)
  except CompareError as e:
    raise app.UsageError(f'error: {e}') from None
  plot_path = default_plot_path(paths) if FLAGS.plot is None else FLAGS.plot
  if plot_path:
    problem = safe_files.output_file_problem(plot_path, '--plot') or plot_target_problem(plot_path)
    if problem:
      raise app.UsageError(f'error: {problem}')
  groups = group_runs(runs)
  print(table(groups))
  if plot_path:
    plot(groups, plot_path)
    print(f'\nPlot: {plot_path}')


if __name__ == '__main__':
  command_line.run(main)
