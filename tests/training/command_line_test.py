"""training.command_line: every command's usage errors and file-system errors are one line, no help, no traceback."""

import os
import subprocess
import sys

from absl import app
import pytest

import tests
from training import command_line

_ENV = {'TF_CPP_MIN_LOG_LEVEL': '3', 'PATH': '/usr/bin:/bin'}


def test_wrapper_turns_usage_and_os_errors_into_one_line(capsys):
  def usage(argv):
    raise app.UsageError('invalid flags: x must be positive')

  def disk_full(argv):
    raise OSError(28, 'No space left on device', '/data/run/summary.json')

  with pytest.raises(SystemExit) as exited:
    command_line.one_line_usage_errors(usage)(['prog'])
  assert exited.value.code == 1 and capsys.readouterr().err == 'invalid flags: x must be positive\n'
  with pytest.raises(SystemExit) as exited:
    command_line.one_line_usage_errors(disk_full, command_line.STUDY_RESUMES)(['prog'])
  assert exited.value.code == 1
  assert capsys.readouterr().err == ('error: No space left on device: /data/run/summary.json (the study resumes from '
                                     'its finished runs when the same command runs again)\n')


def test_wrapper_says_the_runs_refusals_in_one_line_and_lets_bugs_through(capsys):
  from training.runner import experiment  # pylint: disable=g-import-not-at-top

  def raising(error):
    def main(argv):
      raise error
    return command_line.one_line_usage_errors(main, command_line.STUDY_RESUMES)

  with pytest.raises(SystemExit) as exited:
    raising(experiment.ConfigError('num_clients=5000 exceeds the number of examples (1438)'))(['prog'])
  assert exited.value.code == 1  # A setting: no resume hint (the same command is refused again).
  assert capsys.readouterr().err == 'error: num_clients=5000 exceeds the number of examples (1438)\n'
  with pytest.raises(SystemExit) as exited:
    raising(experiment.TrainingStopped('stopped after round 5 of 9: the server update was non-finite'))(['prog'])
  assert exited.value.code == 1
  assert capsys.readouterr().err == ('error: stopped after round 5 of 9: the server update was non-finite (the '
                                     'study resumes from its finished runs when the same command runs again)\n')
  with pytest.raises(SystemExit):
    raising(command_line.CommandError("TFF_GMA_WORKER_CONFINEMENT='x': expected one of require, auto, off"))(['p'])
  assert capsys.readouterr().err.startswith("error: TFF_GMA_WORKER_CONFINEMENT='x'")
  for bug in (ValueError('a bug'), RuntimeError('another')):  # Not a refusal: the traceback a bug needs.
    with pytest.raises(type(bug)):
      raising(bug)(['prog'])


@pytest.mark.slow
@pytest.mark.parametrize('module, flags, message', [
    ('training.demo', ['--rounds=1', '--aggregators=mean', '--corrupt_fraction=0', '--output_dir={file}'],
     'invalid flags: output_dir {file} is a file, not a directory'),
    ('training.demo', ['--aggregators=nonsense'], '--aggregators: unknown method'),
    ('training.studies.gma', ['--settings=label10', '--rounds=1', '--client_lrs=0.05', '--taus=', '--seeds=0',
                              '--methods=fedavg/mean', '--output_dir={file}'],
     'invalid study settings: output_dir {file}/runs/'),
    ('training.studies.gma', ['--settings=nonsense'], 'invalid study settings: settings: unknown setting'),
    # A value absl cannot parse, an unknown flag: one line, not absl's 'FATAL Flags parsing error' and its hint.
    ('training.run', ['--rounds=abc'],
     "invalid flags: flag --rounds=abc: invalid literal for int() with base 10: 'abc' (--helpshort lists the flags)"),
    ('training.demo', ['--nonsense=1'], "invalid flags: Unknown command line flag 'nonsense'"),
    ('training.bench', ['--model=nope'], 'invalid flags: flag --model=nope: value should be one of'),
    ('training.bench', ['--smoke', '--aggregators=gma,nope'], "invalid flags: --aggregators: 'nope': unknown method"),
    ('training.studies.rfa', ['--models=nope'], "models: unknown model 'nope'"),
    ('training.studies.rfa_spread', ['--trajectory=nope'], 'invalid flags: flag --trajectory=nope'),
    ('training.studies.membership', ['--rounds=1.5'], 'invalid flags: flag --rounds=1.5'),
    ('training.studies.gma_fmnist', ['--settings=nonsense'], 'invalid study settings: settings: unknown setting'),
])
def test_commands_end_in_one_line(tmp_path, module, flags, message):
  afile = tmp_path / 'afile'
  afile.write_text('')
  process = subprocess.run([sys.executable, '-m', module, *[f.format(file=afile) for f in flags]], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                           env=dict(_ENV, HOME=str(tmp_path)))
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith(message.format(file=afile)), process.stderr[-3000:]


# The tiniest flags of each command that reach its start of the TFF worker (and its first write into {out}).
TINY_FLAGS = {
    'training.demo': ['--rounds=1', '--num_clients=3', '--model=logistic', '--aggregators=mean',
                      '--local_epochs=1', '--corrupt_fraction=0', '--output_dir={out}'],
    'training.studies.gma': ['--settings=label10', '--methods=fedavg/mean', '--rounds=1', '--client_lrs=0.05',
                             '--taus=', '--seeds=0', '--output_dir={out}'],
    'training.studies.gma_fmnist': ['--settings=fmnist_iid100', '--methods=fedavg/mean', '--rounds=1',
                                    '--tune_seeds=0', '--seeds=0', '--output_dir={out}'],
    'training.studies.rfa': ['--seeds=0', '--rounds=1', '--local_epochs=1', '--models=logistic',
                             '--corruptions=omniscient', '--fractions=0', '--aggregators=mean', '--output_dir={out}'],
    'training.studies.membership': ['--seeds=0', '--rounds=1', '--model=logistic', '--num_clients=3',
                                    '--output_dir={out}'],
    'training.studies.rfa_spread': ['--rounds=1', '--output={out}/measure'],
    'training.bench': ['--smoke', '--sections=rounds', '--output={out}/bench.json'],
}


@pytest.mark.slow
@pytest.mark.parametrize('module, setting', [(m, 'confinement') for m in TINY_FLAGS] + [
    ('training.demo', 'link'), ('training.studies.gma', 'link'), ('training.bench', 'link')])
def test_a_refused_worker_setting_is_one_line_for_every_command(tmp_path, module, setting):
  """An unknown $TFF_GMA_WORKER_CONFINEMENT, or a worker log planted as a link: `error:` and why, exit 1, before
  anything is written (the runner's own test: tests/training/run_test.py)."""
  if setting == 'link':
    victim = tmp_path / 'victim'
    victim.write_text('precious')
    os.symlink(victim, tmp_path / 'worker.log')
    env, message = {'TFF_GMA_WORKER_LOG': str(tmp_path / 'worker.log')}, (
        f'error: TFF worker log {tmp_path}/worker.log is a symbolic link; refusing to follow it')
  else:
    env, message = {'TFF_GMA_WORKER_CONFINEMENT': 'sometimes'}, (
        "error: TFF_GMA_WORKER_CONFINEMENT='sometimes': expected one of")
  out = tmp_path / 'out'
  process = subprocess.run([sys.executable, '-m', module, *[f.format(out=out) for f in TINY_FLAGS[module]]],
                           cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                           env=dict(_ENV, HOME=str(tmp_path), **env))
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith(message), process.stderr[-3000:]
  assert not out.exists()
  if setting == 'link':
    assert victim.read_text() == 'precious'
