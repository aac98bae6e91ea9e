"""The runner's resume reads a run's files within bounds (issue 40): a damaged metrics.csv, config.json or
`checkpoints` path ends in one line naming the file, before anything is written, and nothing in the directory
changes. The directory is a finished one-round run, copied and damaged for each case."""

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time

import pytest

import tests
from training import config as config_lib
from training.runner import checkpoints
from training.runner import experiment

_TOY = config_lib.ExperimentConfig(dataset='digits', partition='iid', num_clients=3, clients_per_round=3, rounds=1,
                                   model='logistic', batch_size=32, eval_every=1)


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A finished one-round run (trained once for the module)."""
  out = tmp_path_factory.mktemp('finished') / 'run'
  experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False)
  return out


def _snapshot(directory):
  """Every entry under `directory`: its kind, and a regular file's content hash (FIFOs and devices not read)."""
  entries = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      if os.path.islink(path):
        entries[path] = ('link', os.readlink(path))
      elif os.path.isfile(path):
        with open(path, 'rb') as f:
          entries[path] = ('file', hashlib.sha256(f.read()).hexdigest())
      else:
        entries[path] = ('other', os.stat(path).st_mode)
  return entries


def _replace(path, make):
  os.remove(path)
  make(str(path))


def _edit_csv(out, old, new):
  path = out / 'metrics.csv'
  data = path.read_bytes()
  assert old in data
  path.write_bytes(data.replace(old, new, 1))


def _round_abc(out):
  _edit_csv(out, b'\n1,', b'\nabc,')


def _non_utf8(out):
  _edit_csv(out, b'\n1,', b'\n1\xff,')


def _extra_field(out):
  path = out / 'metrics.csv'
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(b''.join(lines[:-1]) + lines[-1].rstrip(b'\r\n') + b',extra\r\n')


def _checkpoints_a_file(out):
  shutil.rmtree(out / 'checkpoints')
  (out / 'checkpoints').write_text('not a directory')


_CSV_DAMAGED = 'is damaged ({}'  # The reason's start; the line goes on with what to do.


@pytest.mark.parametrize('damage, error, message', [
    (_round_abc, experiment.CheckpointError, "{out}/metrics.csv " + _CSV_DAMAGED.format(
        "line 2: round 'abc' is not a round number): the run cannot resume with it")),
    (_non_utf8, experiment.CheckpointError, '{out}/metrics.csv ' + _CSV_DAMAGED.format(
        'not UTF-8 text: byte 0xff at offset')),
    (_extra_field, experiment.CheckpointError, '{out}/metrics.csv ' + _CSV_DAMAGED.format('line 2 has ')),
    (lambda out: _replace(out / 'metrics.csv', os.mkfifo), experiment.CheckpointError,
     '{out}/metrics.csv ' + _CSV_DAMAGED.format('a FIFO, not a regular file')),
    # A link at a name the run writes is refused before its target is read (safe_files.check_output_dir).
    (lambda out: _replace(out / 'metrics.csv', lambda p: os.symlink('/dev/zero', p)), experiment.UnsafeOutputError,
     '{out}/metrics.csv is a symbolic link (to /dev/zero)'),
    (_checkpoints_a_file, experiment.CheckpointError,
     '{out}/checkpoints is not a directory: a run keeps its checkpoints in that directory'),
    (lambda out: (out / 'config.json').write_text('[' * 100000), experiment.ConfigError,
     '{out}/config.json is damaged (JSON nested too deeply to read)'),
    (lambda out: _replace(out / 'config.json', os.mkfifo), experiment.ConfigError,
     '{out}/config.json is damaged (a FIFO, not a regular file)'),
    (lambda out: _replace(out / 'config.json', lambda p: os.symlink('/dev/zero', p)), experiment.UnsafeOutputError,
     '{out}/config.json is a symbolic link (to /dev/zero)'),
], ids=['round_abc', 'non_utf8', 'extra_field', 'fifo_csv', 'dev_zero_csv', 'checkpoints_file', 'deep_config',
        'fifo_config', 'dev_zero_config'])
def test_a_damaged_run_file_refuses_the_resume_in_one_line_and_nothing_changes(finished, tmp_path, damage, error,
                                                                             message):
  out = tmp_path / 'run'
  shutil.copytree(finished, out, symlinks=True)
  damage(out)
  before = _snapshot(out)
  began = time.monotonic()
  with pytest.raises(error) as raised:
    experiment.run(dataclasses.replace(_TOY, output_dir=str(out), rounds=2), show_progress=False)
  assert time.monotonic() - began < 60  # Refused, not read (a FIFO blocked, /dev/zero read until memory ran out).
  text = str(raised.value)
  assert '\n' not in text and text.startswith(message.format(out=out)), text
  assert _snapshot(out) == before


def test_the_cut_last_row_a_crash_leaves_still_resumes(tmp_path):
  """The bounded reading keeps what resuming allowed: a last row cut while written is dropped, not refused."""
  out = tmp_path / 'run'
  (out / 'checkpoints').mkdir(parents=True)
  (out / 'metrics.csv').write_text('round,a\r\n1,0.5\r\n2,0.')
  checkpoints.check_resume_files(str(out))
  assert checkpoints.drop_partial_row(str(out / 'metrics.csv'))
  assert (out / 'metrics.csv').read_bytes() == b'round,a\r\n1,0.5\r\n'
  assert checkpoints.truncate_rows(str(out / 'metrics.csv'), 'round', 0) == 1


def test_the_runner_says_it_in_one_line(finished, tmp_path):
  """`python -m training.run` on a run whose metrics.csv has a round of `abc`: one line, exit 1, no traceback."""
  out = tmp_path / 'run'
  shutil.copytree(finished, out, symlinks=True)
  _round_abc(out)
  before = _snapshot(out)
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', f'--output_dir={out}', '--rounds=2', '--dataset=digits',
       '--partition=iid', '--num_clients=3', '--clients_per_round=3', '--model=logistic', '--batch_size=32'],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert process.returncode == 1, process.stderr[-2000:]
  lines = [line for line in process.stderr.splitlines() if line.strip()]
  assert lines == [f"error: {out}/metrics.csv is damaged (line 2: round 'abc' is not a round number): the run "
                   f'cannot resume with it. Repair it, move it away to resume without the rows of the rounds trained '
                   f'so far, or use another --output_dir'], process.stderr[-2000:]
  assert _snapshot(out) == before
