"""A read-only or full disk under every command (the audit's too), for real (a tmpfs in a private mount
namespace: root ignores permission bits): one line naming the path, no traceback; a disk that fills under a run
says how to resume, and the same command then resumes it (issue 24 item 7).

Also the other output paths of the commands that are not the runner: a file, a path under a file, one line each.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import tests
from tests.training import command_line_test
from tests.training import mounts

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', TFF_GMA_WORKER_LOG='none')


# TensorFlow's C++ start-up log lines, which the audit (TF_CPP_MIN_LOG_LEVEL=2 of its own) may print on import.
_TF_LOG_LINE = re.compile(r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+\] ')


def _lines(stderr: str) -> list[str]:
  """stderr's lines, TensorFlow's start-up chatter aside."""
  return [line for line in stderr.splitlines() if line.strip() and 'TensorRT' not in line]


def _python(module: str, *flags: str) -> str:
  return ' '.join(shlex.quote(a) for a in (sys.executable, '-m', module, *flags))


# The tiniest flags that reach each command's first write into --output_dir (or --output).
_COMMANDS = {
    'training.run': ['--rounds=1', '--model=logistic', '--num_clients=3', '--output_dir={out}'],
    **command_line_test.TINY_FLAGS,
    'tff_gma.audit': ['tests.tff_gma.audit.targets:weighted_mean', '--output={mnt}/audit.md'],
}
# Where each says the path fails: (the flag it names, the path it names).
_NAMED = {
    'training.run': 'invalid flags: output_dir {out}: {mnt} is on a read-only file system',
    'training.demo': 'invalid flags: output_dir {out}: {mnt} is on a read-only file system',
    'training.studies.gma': 'invalid study settings: output_dir {out}/runs/',
    'training.studies.gma_fmnist': 'invalid study settings: output_dir {out}/runs/',
    'training.studies.rfa': 'invalid study settings: output_dir {out}/',
    'training.studies.membership': 'invalid study settings: output_dir {out}/',
    'training.studies.rfa_spread': 'invalid flags: output {out}/measure: {mnt} is on a read-only file system',
    'training.bench': 'invalid flags: output {out}/bench.json: {mnt} is on a read-only file system',
    'tff_gma.audit': 'error: --output {mnt}/audit.md: directory {mnt} is on a read-only file system',
}
_EXIT = {'tff_gma.audit': 2}  # The audit's 1 is a verdict (FAIL); every other command's user error is 1.


@pytest.mark.slow
@pytest.mark.parametrize('module', list(_COMMANDS))
def test_a_read_only_output_dir_is_one_line_before_any_work(tmp_path, module):
  mounts.require()
  mnt = tmp_path / 'ro'
  out = mnt / 'run'
  flags = [f.format(out=out, mnt=mnt) for f in _COMMANDS[module]]
  process = mounts.run_on_tmpfs(mnt, _python(module, *flags), read_only=True, env=_ENV, cwd=tests.ROOT)
  assert process.returncode == _EXIT.get(module, 1), process.stderr[-3000:]
  assert 'Traceback' not in process.stderr + process.stdout, process.stderr[-3000:]
  lines = [line for line in _lines(process.stderr) if not _TF_LOG_LINE.match(line)]
  assert len(lines) == 1, process.stderr[-3000:]
  assert lines[0].startswith(_NAMED[module].format(out=out, mnt=mnt)), lines[0]
  assert 'read-only file system' in lines[0], lines[0]
  assert not process.stdout.strip() or module == 'training.demo', process.stdout[-2000:]  # No work done.


@pytest.mark.slow
def test_a_disk_that_fills_under_a_run_says_how_to_resume_and_the_same_command_resumes(tmp_path):
  """A tmpfs of 96 KiB: config.json, metrics.csv and the checkpoints of rounds 0 and 1 (~23 KB of files each, 8
  pages of 4 KiB) fit, round 2's does not; after the disk is grown, the command the line gives finishes the run."""
  mounts.require()
  mnt = tmp_path / 'small'
  out = mnt / 'run'
  flags = ['--rounds=4', '--model=logistic', '--num_clients=3', '--clients_per_round=3', '--checkpoint_every=1',
           f'--output_dir={out}']
  first_err = tmp_path / 'first.stderr'  # Outside the tmpfs: read after the namespace is gone.
  script = (f'{_python("training.run", *flags)} 2>{shlex.quote(str(first_err))}\n'
            f'echo "first exit $?"\n'
            f'ls -A "$MNT/run" "$MNT/run/checkpoints"\n'
            f'mount -o remount,size=16m "$MNT" || exit 98\n'  # Space freed: the same command again.
            f'{_python("training.run", *flags)}\n'
            f'echo "second exit $?"\n'
            f'ls -A "$MNT/run" "$MNT/run/checkpoints"\n'
            f'cat "$MNT/run/summary.json"')
  process = mounts.run_on_tmpfs(mnt, script, size='96k', env=_ENV, cwd=tests.ROOT, timeout=600)
  first = first_err.read_text()
  assert 'first exit 1' in process.stdout, (process.stdout[-2000:], first[-3000:])
  assert 'Traceback' not in first, first[-3000:]
  (line,) = [s for s in _lines(first) if not s.startswith('fedavg/mean ')]  # The progress bar's rounds aside.
  assert line.startswith('error: No space left on device: '), line
  assert f'{out}' in line
  resume = 'fix it, then resume with: python -m training.run ' + ' '.join(shlex.quote(f) for f in flags)
  assert line.endswith(resume), line
  assert '(stopped after round 1 of 4)' in line, line
  # The same command, once there is space: resumes and finishes, cleaning what the failed writes left.
  assert 'second exit 0' in process.stdout, process.stderr[-3000:]
  assert 'Traceback' not in process.stderr, process.stderr[-3000:]
  listing = process.stdout.partition('second exit 0')[2]
  assert '_temp' not in listing, listing
  summary = json.loads(listing[listing.index('{'):])
  assert summary['rounds_completed'] == 4


@pytest.mark.slow
@pytest.mark.parametrize('output, message', [
    ('{dir}', 'invalid flags: output {dir} is a directory'),
    ('{file}/bench.json', 'invalid flags: output {file}/bench.json: {file} is a file, not a directory'),
    ('{file}/sub/bench.json', 'invalid flags: output {file}/sub/bench.json: {file} is a file, not a directory'),
], ids=['a_directory', 'under_a_file', 'deeper_under_a_file'])
def test_the_bench_output_path_is_checked_before_the_benchmark(tmp_path, output, message):
  afile = tmp_path / 'afile'
  afile.write_text('')
  adir = tmp_path / 'adir'
  adir.mkdir()
  output = output.format(file=afile, dir=adir)
  process = subprocess.run([sys.executable, '-m', 'training.bench', '--smoke', f'--output={output}'],
                           cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                           env=_ENV)
  assert process.returncode == 1, process.stderr[-3000:]
  assert 'Traceback' not in process.stderr, process.stderr[-3000:]
  lines = _lines(process.stderr)
  assert len(lines) == 1 and lines[0].startswith(message.format(file=afile, dir=adir)), process.stderr[-3000:]
  assert not process.stdout.strip()
  assert os.listdir(adir) == []


@pytest.mark.slow
@pytest.mark.parametrize('module, flags, message', [
    ('training.studies.membership', ['--seeds=0', '--output_dir={file}'],
     'invalid study settings: output_dir {file}/'),
    ('training.studies.membership', ['--seeds=x'], 'invalid study settings: invalid literal'),
    ('training.studies.rfa_spread', ['--output={file}/measure'],
     'invalid flags: output {file}/measure: {file} is a file, not a directory'),
    ('training.studies.rfa_spread', ['--rounds=0'], 'invalid flags: rounds'),
    ('training.demo', ['--output_dir={file}/sub'], 'invalid flags: output_dir {file}/sub: {file} is a file'),
    ('training.demo', ['--num_clients=5000', '--aggregators=mean', '--output_dir={file}.d'],
     'invalid flags: num_clients=5000 exceeds the number of examples'),
    ('training.studies.membership', ['--seeds=0', '--num_clients=5000', '--output_dir={file}.d'],
     'error: num_clients=5000 exceeds the number of examples'),
], ids=['membership_file', 'membership_seeds', 'rfa_spread_under_file', 'rfa_spread_rounds', 'demo_under_file',
        'demo_too_many_clients', 'membership_too_many_clients'])
def test_the_other_commands_refuse_a_bad_path_or_setting_in_one_line(tmp_path, module, flags, message):
  """Paths and settings of the commands besides the runner (whose own: tests/training/run_test.py)."""
  afile = tmp_path / 'afile'
  afile.write_text('')
  process = subprocess.run([sys.executable, '-m', module, *[f.format(file=afile) for f in flags]], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 1, process.stderr[-3000:]
  assert 'Traceback' not in process.stderr, process.stderr[-3000:]
  lines = _lines(process.stderr)
  assert len(lines) == 1 and lines[0].startswith(message.format(file=afile)), process.stderr[-3000:]
