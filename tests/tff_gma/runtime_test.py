"""The TFF worker never outlives its Python process and never holds the caller's pipes.

Each case runs a child Python that sets up the simulation context, runs a secure-sum computation, prints the
worker's pid, and then ends in a different way. The child's stdout/stderr are pipes: `communicate()` returns only
once every holder of those pipes has closed them, so a worker that inherited them would make it time out.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.tff_gma import processes

_CHILD = textwrap.dedent('''
    import os, sys, time
    # Inherited by the worker: at 3 it logs nothing, at 0 it logs its start-up banner.
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3' if {quiet!r} else '0'
    import numpy as np
    import tensorflow_federated as tff
    from tff_gma import runtime

    worker = runtime.set_simulation_context(log_path={log_path!r})

    @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
    def secure_total(x):
      return tff.federated_secure_sum_bitwidth(x, 8)

    assert secure_total([1, 2, 3]) == 6
    print('WORKER', worker.pid, worker.log_path, flush=True)
    mode = {mode!r}
    if mode == 'exception':
      raise RuntimeError('deliberate failure after a computation')
    if mode == 'wait':
      time.sleep(120)
''')


def _start(mode, tmp_path, log_path=None, quiet=True):
  return subprocess.Popen(
      [sys.executable, '-c', _CHILD.format(mode=mode, log_path=log_path, quiet=quiet)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=tmp_path,
      text=True, preexec_fn=processes.default_signals)


def _read_worker_pid(proc) -> int:
  line = proc.stdout.readline()
  while line and not line.startswith('WORKER'):
    line = proc.stdout.readline()
  assert line.startswith('WORKER'), proc.stderr.read()
  return int(line.split()[1])


@pytest.mark.parametrize('mode, expected_rc', [('exit', 0), ('exception', 1)])
def test_worker_stops_when_python_ends(mode, expected_rc, tmp_path):
  proc = _start(mode, tmp_path)
  # Times out (and fails) if the worker kept the pipes open after Python ended.
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == expected_rc, err
  _, pid, log = next(l for l in out.splitlines() if l.startswith('WORKER')).split()
  assert processes.wait_gone(int(pid)), f'worker {pid} outlived its Python process ({mode})'
  assert not os.path.exists(log), 'the default per-process worker log was left behind'


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_worker_stops_when_python_is_signalled(sig, tmp_path):
  proc = _start('wait', tmp_path)
  pid = _read_worker_pid(proc)
  assert processes.alive(pid)
  proc.send_signal(sig)
  proc.communicate(timeout=60)
  assert proc.returncode != 0
  assert processes.wait_gone(pid), f'worker {pid} outlived its Python process ({sig.name})'


def test_worker_log_goes_to_file_not_caller(tmp_path):
  log = tmp_path / 'worker.log'
  proc = _start('exit', tmp_path, log_path=str(log), quiet=False)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  # The worker's start-up banner is in its own log, never in the caller's output.
  banner = 'ExecutorService started'
  assert banner in log.read_text()
  assert banner not in err and banner not in out


def test_context_runs_secure_sums_and_restarts_a_dead_worker(simulation_context):
  import numpy as np
  import tensorflow_federated as tff
  from tff_gma import runtime

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def secure_total(x):
    return tff.federated_secure_sum(x, 7)

  assert secure_total([1, 2, 7]) == 10
  worker = runtime.set_simulation_context()
  old_pid = worker.pid
  os.kill(old_pid, signal.SIGKILL)
  assert processes.wait_gone(old_pid)
  assert secure_total([3, 4]) == 7  # The context starts a fresh worker instead of failing.
  assert worker.pid != old_pid and processes.alive(worker.pid)


def _worker_environment(pid: int) -> dict[str, str]:
  with open(f'/proc/{pid}/environ', 'rb') as f:
    pairs = [e.decode().partition('=') for e in f.read().split(b'\0') if e]
  return {k: v for k, _, v in pairs}


def test_the_worker_runs_with_the_intra_op_threads_asked_for(simulation_context, monkeypatch):
  import numpy as np
  import tensorflow_federated as tff
  from tff_gma import runtime

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def secure_total(x):
    return tff.federated_secure_sum(x, 7)

  try:
    # The default: one thread (in the worker's environment, where its TensorFlow reads it), not this process's.
    worker = runtime.set_simulation_context(intra_op_threads=runtime.DEFAULT_INTRA_OP_THREADS)
    assert runtime.DEFAULT_INTRA_OP_THREADS == 1 and worker.intra_op_threads == 1
    assert _worker_environment(worker.pid)['TF_NUM_INTRAOP_THREADS'] == '1'
    assert os.environ.get('TF_NUM_INTRAOP_THREADS') is None
    first = worker.pid
    assert runtime.set_simulation_context().pid == first  # None keeps the running worker.
    # Another count replaces the worker; 0 leaves TensorFlow's default (no variable set).
    assert runtime.set_simulation_context(intra_op_threads=0) is worker  # The same object, restarted.
    assert worker.pid != first and processes.wait_gone(first)
    assert worker.intra_op_threads == 0 and 'TF_NUM_INTRAOP_THREADS' not in _worker_environment(worker.pid)
    assert secure_total([1, 2, 7]) == 10
    worker = runtime.set_simulation_context(intra_op_threads=3)
    assert _worker_environment(worker.pid)['TF_NUM_INTRAOP_THREADS'] == '3' and secure_total([3, 4]) == 7
  finally:
    runtime.set_simulation_context(intra_op_threads=runtime.DEFAULT_INTRA_OP_THREADS)


def test_intra_op_threads_reads_the_environment_and_names_a_bad_value(monkeypatch):
  from tff_gma import runtime
  monkeypatch.delenv(runtime.INTRA_OP_THREADS_ENV, raising=False)
  assert runtime.intra_op_threads() == 1 and runtime.intra_op_threads(0) == 0 and runtime.intra_op_threads(4) == 4
  monkeypatch.setenv(runtime.INTRA_OP_THREADS_ENV, ' 2 ')
  assert runtime.intra_op_threads() == 2 and runtime.intra_op_threads(1) == 1  # An argument wins.
  for raw in ('x', '-1', '1.5', '1025'):
    monkeypatch.setenv(runtime.INTRA_OP_THREADS_ENV, raw)
    with pytest.raises(ValueError, match=r'^\$TFF_GMA_WORKER_INTRA_OP_THREADS must be an integer in \[0, 1024\] '):
      runtime.intra_op_threads()
  for value in (-1, 1.0, True, '1', 1025):
    with pytest.raises(ValueError, match=r'^intra_op_threads must be an integer in \[0, 1024\]'):
      runtime.intra_op_threads(value)
