"""The runner's command line: invalid flags end in one message and a non-zero exit, with nothing written."""

import os
import subprocess
import sys

import pytest

import tests


def _run(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, '-m', 'training.run', f'--output_dir={tmp_path / "out"}', '--rounds=1', *flags],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


@pytest.mark.slow
@pytest.mark.parametrize('flags, named', [
    (['--aggregator=mean', '--secure'], 'secure_bound'),
    (['--algorithm=personalized', '--aggregator=elastic'], 'aggregator'),
    (['--seed=-1'], 'seed'),
    (['--client_lr=inf'], 'client_lr'),
    (['--algorithm=scaffold', '--corruption=omniscient', '--corrupt_fraction=0.2'], 'corruption'),
])
def test_invalid_flags_end_in_one_message_and_write_nothing(tmp_path, flags, named):
  process = _run(tmp_path, *flags)
  assert process.returncode != 0
  assert 'invalid flags: ' in process.stderr and named in process.stderr, process.stderr[-2000:]
  assert 'Traceback' not in process.stderr + process.stdout, process.stderr[-3000:]
  assert not (tmp_path / 'out').exists()
