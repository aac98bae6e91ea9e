"""training.compare: runs grouped by everything but the seed, the table's numbers against NumPy, one plot, and
bad input in one line. The run directories are written here with known numbers (a real --seeds run: run_test.py).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tests
from training import command_line
from training import compare
from training import config as config_lib

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: compare reads files only (no TFF worker)."""
  yield None


def _write_run(path, *, curve, seed=0, summary_config=True, **settings):
  """A finished run in `path`: config.json, metrics.csv with `curve` as the evaluated accuracy of rounds 1.., and
  summary.json with the final (mean of the last 10) and best accuracy the runner would write."""
  config = dataclasses.asdict(config_lib.ExperimentConfig(seed=seed, output_dir=str(path), **settings))
  tuning = config['validation_fraction'] > 0
  key = 'validation/accuracy' if tuning else 'test/accuracy'
  os.makedirs(path)
  (path / 'config.json').write_text(json.dumps(config))
  with open(path / 'metrics.csv', 'w') as f:
    f.write(f'round,train/loss,{key}\n')
    for number, value in enumerate(curve, start=1):
      f.write(f'{number},0.5,{value!r}\n')
  final, best = float(np.mean(curve[-10:])), float(np.max(curve))
  summary = {'final_accuracy': None if tuning else final, 'best_accuracy': None if tuning else best,
             'rounds_completed': len(curve)}
  if tuning:
    summary.update(final_validation_accuracy=final, best_validation_accuracy=best)
  if summary_config:
    summary['config'] = config
  (path / 'summary.json').write_text(json.dumps(summary))
  return final, best


def _rows(text):
  """The Markdown table's rows as dicts by column (the header first)."""
  lines = [l for l in text.splitlines() if l.startswith('|')]
  cells = [[c.strip() for c in l.strip('|').split('|')] for l in lines]
  header = cells[0]
  assert set(lines[1]) <= {'|', '-'}
  return [dict(zip(header, row)) for row in cells[2:]]


def _expected(values):
  mean = f'{100 * np.mean(values):.2f}'
  return mean if len(values) == 1 else f'{mean} ± {100 * np.std(values, ddof=1):.2f}'


@pytest.fixture
def runs(tmp_path):
  """Three groups: mean with seeds 0-2 (a --seeds directory), GMA with seeds 3 and 5 (two directories given one
  by one, one of them an old run whose summary lacks its config), and one tuning run."""
  rng = np.random.default_rng(0)
  made = {'mean': [], 'gma': [], 'tuning': []}
  for seed in (0, 1, 2):
    made['mean'].append(_write_run(tmp_path / 'mean' / f'seed_{seed}', seed=seed, rounds=12,
                                   curve=list(rng.uniform(0.5, 0.9, 12))))
  for seed, summary_config in ((3, True), (5, False)):
    made['gma'].append(_write_run(tmp_path / f'gma_{seed}', seed=seed, rounds=12, aggregator='gma', tau=0.4,
                                  summary_config=summary_config, curve=list(rng.uniform(0.5, 0.9, 12))))
  made['tuning'].append(_write_run(tmp_path / 'tune', aggregator='gma', tau=0.2, rounds=12, validation_fraction=0.2,
                                   curve=list(rng.uniform(0.5, 0.9, 12))))
  return tmp_path, made


def test_table_groups_by_everything_but_the_seed_and_matches_numpy(runs):
  root, made = runs
  paths = [str(root / 'mean'), str(root / 'gma_3'), str(root / 'gma_5'), str(root / 'tune')]
  groups = compare.group_runs(compare.read_runs(paths))
  assert [g.seeds for g in groups] == [[0, 1, 2], [3, 5], [0]]
  rows = _rows(compare.table(groups))
  # Only the settings that differ across the groups (seed and output_dir never), in the runner's flag order.
  assert list(rows[0]) == ['runs', 'aggregator', 'tau', 'validation_fraction', 'split', 'n', 'seeds',
                           'final accuracy (%)', 'best accuracy (%)']
  assert [r['runs'] for r in rows] == [str(root / 'mean'), f'{root / "gma_3"}, {root / "gma_5"}', str(root / 'tune')]
  assert [(r['aggregator'], r['tau'], r['split'], r['n'], r['seeds']) for r in rows] == [
      ('mean', '0.4', 'test', '3', '0,1,2'), ('gma', '0.4', 'test', '2', '3,5'), ('gma', '0.2', 'validation', '1', '0')]
  for row, name in zip(rows, ('mean', 'gma', 'tuning')):
    finals, bests = zip(*made[name])
    assert row['final accuracy (%)'] == _expected(finals), name
    assert row['best accuracy (%)'] == _expected(bests), name
  assert re.fullmatch(r'\d+\.\d\d ± \d+\.\d\d', rows[0]['final accuracy (%)'])


def test_mean_curve_is_the_mean_over_seeds(runs):
  root, _ = runs
  (group,) = compare.group_runs(compare.read_runs([str(root / 'mean')]))
  curves = np.array([[r['test/accuracy'] for r in run.rows] for run in group.runs])
  rounds, mean, std = group.curve()
  np.testing.assert_array_equal(rounds, np.arange(1, 13))
  np.testing.assert_allclose(mean, curves.mean(axis=0))
  np.testing.assert_allclose(std, curves.std(axis=0, ddof=1))


def test_one_group_and_a_single_run(runs):
  root, made = runs
  rows = _rows(compare.table(compare.group_runs(compare.read_runs([str(root / 'gma_3')]))))
  assert rows == [{'runs': str(root / 'gma_3'), 'n': '1', 'seeds': '3',
                   'final accuracy (%)': _expected([made['gma'][0][0]]),
                   'best accuracy (%)': _expected([made['gma'][0][1]])}]


def test_the_command_prints_the_table_and_writes_one_plot(runs):
  root, _ = runs
  process = subprocess.run([sys.executable, '-m', 'training.compare', str(root / 'mean'), str(root / 'gma_3'),
                            str(root / 'gma_5')], cwd=tests.ROOT, capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 0, process.stderr[-3000:]
  groups = compare.group_runs(compare.read_runs([str(root / 'mean'), str(root / 'gma_3'), str(root / 'gma_5')]))
  assert compare.table(groups) in process.stdout
  # By default the plot goes to the deepest directory holding every run.
  assert process.stdout.rstrip().endswith(f'Plot: {root / "compare.png"}')
  assert (root / 'compare.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  # --plot elsewhere (its directory created); --plot= none.
  elsewhere = root / 'plots' / 'mean.png'
  compare_main([str(root / 'mean')], plot=str(elsewhere))
  assert elsewhere.read_bytes()[:4] == b'\x89PNG'
  (root / 'mean' / 'compare.png').unlink(missing_ok=True)
  compare_main([str(root / 'mean')], plot='')
  assert not (root / 'mean' / 'compare.png').exists()


def compare_main(paths, plot=None):
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.FLAGS(['compare', *([] if plot is None else [f'--plot={plot}'])])
  try:
    command_line.one_line_usage_errors(compare.main)(['compare', *paths])
  finally:
    flags.FLAGS.unparse_flags()


@pytest.mark.parametrize('make, message', [
    (lambda root: root / 'nowhere', 'error: {path}: no such directory'),
    (lambda root: ((root / 'afile').write_text(''), root / 'afile')[1], 'error: {path} is not a directory'),
    (lambda root: (root / 'empty').mkdir() or root / 'empty',
     'error: {path} is not a run directory (no summary.json or config.json, and no seed_<s> runs in it)'),
    (lambda root: (root / 'mean' / 'seed_1' / 'summary.json').unlink() or root / 'mean',
     'error: {root}/mean/seed_1: the run has not finished (no summary.json)'),
    (lambda root: (root / 'gma_3' / 'summary.json').write_text('{"final_accuracy": 0.') and root / 'gma_3',
     'error: {path}/summary.json is damaged ('),
], ids=['missing', 'file', 'not_a_run', 'unfinished', 'damaged'])
def test_bad_input_is_one_line_exit_1_and_nothing_written(runs, capsys, make, message):
  root, _ = runs
  path = make(root)
  with pytest.raises(SystemExit) as exited:
    compare_main([str(root / 'tune'), str(path)])
  assert exited.value.code == 1
  captured = capsys.readouterr()
  assert captured.out == '' and captured.err.count('\n') == 1, captured
  assert captured.err.startswith(message.format(path=path, root=root)), captured.err
  assert not list(root.rglob('*.png'))


def test_no_directory_and_an_unwritable_plot_are_one_line(runs, capsys):
  root, _ = runs
  with pytest.raises(SystemExit) as exited:
    compare_main([])
  assert exited.value.code == 1 and capsys.readouterr().err.startswith('usage: python -m training.compare DIR')
  (root / 'afile').write_text('')
  with pytest.raises(SystemExit) as exited:
    compare_main([str(root / 'mean')], plot=str(root / 'afile' / 'x.png'))
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err == f'error: --plot {root}/afile/x.png: {root}/afile is a file, not a directory\n'


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
  process = subprocess.run([sys.executable, '-m', 'training.compare', str(tmp_path / 'nowhere')], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 1
  lines = [l for l in process.stderr.splitlines() if l.strip() and 'TensorRT' not in l]
  assert lines == [f'error: {tmp_path}/nowhere: no such directory'], process.stderr[-3000:]
