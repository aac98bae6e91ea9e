"""training.command_line: every command's usage errors and file-system errors are one line, no help, no traceback."""

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


@pytest.mark.slow
@pytest.mark.parametrize('module, flags, message', [
    ('training.demo', ['--rounds=1', '--aggregators=mean', '--omniscient_rounds=0', '--output_dir={file}'],
     'error: Not a directory: {file}/'),
    ('training.demo', ['--aggregators=nonsense'], '--aggregators: unknown method'),
    ('training.studies.gma', ['--settings=label10', '--rounds=1', '--client_lrs=0.05', '--taus=', '--seeds=0',
                              '--methods=fedavg/mean', '--output_dir={file}'], 'invalid study settings: output_dir {file}/runs/'),
    ('training.studies.gma', ['--settings=nonsense'], 'invalid study settings: settings: unknown setting'),
])
def test_commands_end_in_one_line(tmp_path, module, flags, message):
  afile = tmp_path / 'afile'
  afile.write_text('')
  process = subprocess.run([sys.executable, '-m', module, *[f.format(file=afile) for f in flags]], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                           env=dict(_ENV, HOME=str(tmp_path)))
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [l for l in process.stderr.splitlines() if l.strip() and 'TensorRT' not in l]
  assert len(lines) == 1 and lines[0].startswith(message.format(file=afile)), process.stderr[-3000:]
