"""training.compare: runs grouped by everything but the seed, the table's numbers against NumPy, one plot, and
bad input in one line. The run directories are written here with known numbers (a real --seeds run: run_test.py).
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import tests
from training import command_line
from training import compare
from training import config as config_lib
from training import safe_files

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
  lines = [line for line in text.splitlines() if line.startswith('|')]
  cells = [[c.strip() for c in line.strip('|').split('|')] for line in lines]
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
  # By default the plot goes into the first directory given, never above it.
  assert process.stdout.rstrip().endswith(f'Plot: {root / "mean" / "compare.png"}')
  assert (root / 'mean' / 'compare.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert not (root / 'compare.png').exists()
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
    # Issue 40: wrongly typed, nested, non-UTF-8, over-long rows, FIFOs, devices, oversized files, NaN and Inf.
    (lambda root: _edit_summary(root, final_accuracy='high'),
     'error: {path}/summary.json is damaged (final_accuracy is "high", not a number)'),
    (lambda root: _edit_summary(root, best_accuracy=[0.5]),
     'error: {path}/summary.json is damaged (best_accuracy is [0.5], not a number)'),
    (lambda root: _edit_summary(root, final_accuracy=float('nan')),
     'error: {path}/summary.json is damaged (final_accuracy is nan: an accuracy is a finite number in [0, 1])'),
    (lambda root: _edit_summary(root, best_accuracy=float('inf')),
     'error: {path}/summary.json is damaged (best_accuracy is inf: an accuracy is a finite number in [0, 1])'),
    (lambda root: _edit_summary(root, final_accuracy=3),
     'error: {path}/summary.json is damaged (final_accuracy is 3: an accuracy is a finite number in [0, 1])'),
    (lambda root: (root / 'gma_3' / 'summary.json').write_text('[' * 100000) and root / 'gma_3',
     'error: {path}/summary.json is damaged (JSON nested too deeply to read)'),
    (lambda root: (root / 'gma_3' / 'summary.json').write_text('[1]') and root / 'gma_3',
     'error: {path}/summary.json is damaged (not a JSON object but a JSON list)'),
    (lambda root: _edit_summary(root, config={'seed': 'abc'}),
     'error: {path}/summary.json is damaged (setting seed is "abc", not int)'),
    (lambda root: _edit_config(root / 'gma_5', validation_fraction=[1]),
     'error: {path}/config.json is damaged (setting validation_fraction is [1], not float)'),
    (lambda root: _edit_config(root / 'gma_5', seed=True),
     'error: {path}/config.json is damaged (setting seed is true, not int)'),
    (lambda root: _append_csv(root, b'13,0.5,0.7,extra\n'),
     'error: {path}/metrics.csv is damaged (line 14 has 4 fields, more than the header\'s 3)'),
    (lambda root: _append_csv(root, b'13,0.5,0.7\xff\n'),
     'error: {path}/metrics.csv is damaged (not UTF-8 text: byte 0xff at offset'),
    (lambda root: _append_csv(root, b'13,0.5,nan\n'),
     'error: {path}/metrics.csv is damaged (test/accuracy of round 13 is nan: an accuracy is a finite number'),
    (lambda root: _append_csv(root, b'abc,0.5,0.7\n'),
     "error: {path}/metrics.csv is damaged (line 14: round 'abc' is not a number)"),
    (lambda root: _replace_csv(root, os.mkfifo), 'error: {path}/metrics.csv is damaged (a FIFO, not a regular file)'),
    (lambda root: _replace_csv(root, lambda p: os.symlink('/dev/zero', p)),
     'error: {path}/metrics.csv is damaged (a character device, not a regular file)'),
    (lambda root: _replace_csv(root, _sparse(safe_files.MAX_CSV_BYTES + 1)),
     f'error: {{path}}/metrics.csv is damaged ({safe_files.MAX_CSV_BYTES + 1} bytes, more than the '
     f'{safe_files.MAX_CSV_BYTES} such a file may hold)'),
    (lambda root: _replace_summary(root, os.mkfifo),
     'error: {path}/summary.json is damaged (a FIFO, not a regular file)'),
], ids=['missing', 'file', 'not_a_run', 'unfinished', 'damaged', 'string_accuracy', 'list_accuracy', 'nan_accuracy',
        'inf_accuracy', 'accuracy_above_1', 'deep_json', 'json_list', 'string_seed', 'list_setting', 'bool_seed',
        'extra_csv_field', 'non_utf8_csv', 'nan_in_csv', 'round_abc', 'fifo_csv', 'dev_zero_csv', 'huge_csv',
        'fifo_summary'])
def test_bad_input_is_one_line_exit_1_and_nothing_written(runs, capsys, make, message):
  root, _ = runs
  path = make(root)
  began = time.monotonic()
  with pytest.raises(SystemExit) as exited:
    compare_main([str(root / 'tune'), str(path)])
  assert exited.value.code == 1
  assert time.monotonic() - began < 30  # A FIFO or /dev/zero is refused, not read.
  captured = capsys.readouterr()
  assert captured.out == '' and captured.err.count('\n') == 1, captured
  assert captured.err.startswith(message.format(path=path, root=root)), captured.err
  assert not list(root.rglob('*.png'))


def _edit_summary(root, **changes):
  path = root / 'gma_3' / 'summary.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
  return root / 'gma_3'


def _edit_config(run, **changes):
  path = run / 'config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
  return run


def _append_csv(root, data: bytes):
  with open(root / 'gma_3' / 'metrics.csv', 'ab') as f:
    f.write(data)
  return root / 'gma_3'


def _replace_csv(root, make):
  os.remove(root / 'gma_3' / 'metrics.csv')
  make(str(root / 'gma_3' / 'metrics.csv'))
  return root / 'gma_3'


def _replace_summary(root, make):
  os.remove(root / 'gma_3' / 'summary.json')
  make(str(root / 'gma_3' / 'summary.json'))
  return root / 'gma_3'


def _sparse(size):
  def make(path):
    with open(path, 'wb') as f:
      f.truncate(size)
  return make


def test_the_default_plot_is_never_above_the_first_directory(tmp_path, capsys):
  """Issue 40: runs in two trees (as /tmp and /var/tmp) wrote their common ancestor's compare.png (there: /)."""
  _write_run(tmp_path / 'one' / 'a', curve=[0.5, 0.6])
  _write_run(tmp_path / 'two' / 'b', seed=1, curve=[0.4, 0.7])
  compare_main([str(tmp_path / 'one' / 'a'), str(tmp_path / 'two' / 'b')])
  assert capsys.readouterr().out.rstrip().endswith(f'Plot: {tmp_path / "one" / "a" / "compare.png"}')
  assert [p.relative_to(tmp_path) for p in tmp_path.rglob('*.png')] == [pathlib.Path('one/a/compare.png')]
  compare_main([str(tmp_path / 'one' / 'a')])  # A plot of this command is replaced.
  assert (tmp_path / 'one' / 'a' / 'compare.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.parametrize('target', ['summary.json', 'metrics.csv', 'config.json', 'compare.png', 'photo.png'])
def test_a_plot_never_replaces_another_file(runs, capsys, target):
  """`--plot=RUN/summary.json` overwrote the run's own summary; a PNG not written by compare is kept too."""
  root, _ = runs
  path = root / 'gma_3' / target
  if not path.exists():
    path.write_bytes(b'\x89PNG\r\n\x1a\n not a plot of compare')
  before = path.read_bytes()
  args = {'plot': str(path)} if target != 'compare.png' else {}  # compare.png: the default path.
  with pytest.raises(SystemExit) as exited:
    compare_main([str(root / 'gma_3')], **args)
  assert exited.value.code == 1
  captured = capsys.readouterr()
  assert captured.out == '' and captured.err == (f'error: --plot {path} exists and is not a plot of training.compare, '
                                                 f'which the plot would replace; give another --plot (or remove it)\n')
  assert path.read_bytes() == before


def test_no_directory_and_an_unwritable_plot_are_one_line(runs, capsys):
  root, _ = runs
  with pytest.raises(SystemExit) as exited:
    compare_main([])
  assert exited.value.code == 1 and capsys.readouterr().err.startswith('usage: python -m training.compare DIR')
  (root / 'afile').write_text('')
  with pytest.raises(SystemExit) as exited:
    compare_main([str(root / 'mean')], plot=str(root / 'afile' / 'x.png'))
  err = capsys.readouterr().err
  assert exited.value.code == 1 and err == (
      f'error: --plot {root}/afile/x.png: {root}/afile is a file, not a directory\n')


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
  process = subprocess.run([sys.executable, '-m', 'training.compare', str(tmp_path / 'nowhere')], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 1
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert lines == [f'error: {tmp_path}/nowhere: no such directory'], process.stderr[-3000:]
