"""`python -m tff_gma.worker` stopped as its banner says (Ctrl-C): one line, no traceback, its C++ worker gone.

The command runs in a session of its own with its output in files (a leftover worker would hold a pipe open), and
whatever is left of that session is killed at the end.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import tests
from tests.tff_gma import processes


def _banner(err_path, out_path, process, timeout=120.0) -> str:
  """The command's stdout once its banner is complete ('Ctrl-C stops it.'); fails if it exits first."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    text = out_path.read_text()
    if 'Ctrl-C stops it.' in text:
      return text
    if process.poll() is not None:
      break
    time.sleep(0.1)
  err = err_path.read_text()
  if 'confinement is required' in err or 'confinement is unavailable' in err:
    pytest.skip(f'the kernel refuses a network namespace here: {err.strip().splitlines()[-1]}')
  raise AssertionError(f'no banner (exit {process.poll()}): {err[-3000:]}')


@pytest.mark.slow
def test_ctrl_c_stops_the_worker_command_quietly_and_its_worker(tmp_path):
  out_path, err_path = tmp_path / 'stdout', tmp_path / 'stderr'
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    process = subprocess.Popen(
        [*processes.DEFAULT_SIGNALS, sys.executable, '-m', 'tff_gma.worker', '--port=0', '--bind=127.0.0.1'],
        cwd=tests.ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  try:
    banner = _banner(err_path, out_path, process)
    worker_pid = int(re.search(r'\(pid (\d+)\)', banner).group(1))
    assert processes.alive(worker_pid)
    os.kill(process.pid, signal.SIGINT)  # What Ctrl-C sends to the command (the worker is in a session of its own).
    code = process.wait(timeout=60)
    stderr = err_path.read_text()
    assert 'Traceback' not in stderr and 'KeyboardInterrupt' not in stderr, stderr[-3000:]
    assert code == 130, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.strip()] == ['TFF worker stopped.'], stderr[-3000:]
    assert processes.wait_gone(worker_pid), f'the C++ worker {worker_pid} outlived the command'
  finally:
    processes.kill_session(process.pid)
    process.wait()
