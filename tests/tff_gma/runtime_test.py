"""The TFF worker never outlives its Python process and never holds the caller's pipes.

Each case runs a child Python that sets up the simulation context, runs a secure-sum computation, prints the
worker's pid, and then ends in a different way. The child's stdout/stderr are pipes: `communicate()` returns only
once every holder of those pipes has closed them, so a worker that inherited them would make it time out.

Stopping is bounded (`confinement.stop_process`: SIGINT, SIGTERM, then SIGKILL), and a child started as a
background job (SIGINT and SIGQUIT ignored) starts its helper and worker with default dispositions, stops them,
and ends at once.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tests
from tests.tff_gma import background
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
    if mode.startswith('swallow'):  # A caller that catches SystemExit, as pytest does a test's.
      from tff_gma.runtime import worker_process
      worker_process.SIGTERM_GRACE_S = 1.0 if mode == 'swallow' else 600.0
      ready = False
      while True:
        try:  # Inside the try before it says so: a SIGTERM sent at 'READY' is always caught.
          if not ready:
            print('READY', flush=True)
            ready = True
          time.sleep(0.05)
        except SystemExit as e:
          print('SWALLOWED', e.code, flush=True)
''')


def _start(mode, tmp_path, log_path=None, quiet=True):
  env = {k: v for k, v in os.environ.items() if k != 'TFF_GMA_WORKER_LOG'}  # The default log: in the private dir.
  return subprocess.Popen(
      [*processes.DEFAULT_SIGNALS, sys.executable, '-c', _CHILD.format(mode=mode, log_path=log_path, quiet=quiet)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=tmp_path, text=True, env=env)


def _read_worker(proc) -> tuple[int, str]:
  """The child's worker pid and log path (its WORKER line)."""
  line = proc.stdout.readline()
  while line and not line.startswith('WORKER'):
    line = proc.stdout.readline()
  assert line.startswith('WORKER'), proc.stderr.read()  # Its stdout ended: so has the child, stderr can be read.
  _, pid, log = line.split()
  return int(pid), log


def _read_worker_pid(proc) -> int:
  return _read_worker(proc)[0]


@pytest.mark.parametrize('mode, expected_rc', [('exit', 0), ('exception', 1)])
def test_worker_stops_when_python_ends(mode, expected_rc, tmp_path):
  proc = _start(mode, tmp_path)
  # Times out (and fails) if the worker kept the pipes open after Python ended.
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == expected_rc, err
  _, pid, log = next(line for line in out.splitlines() if line.startswith('WORKER')).split()
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


@pytest.mark.parametrize('mode', ['swallow', 'swallow_then_sigterm'])
def test_a_caller_that_catches_the_sigterm_exit_still_ends(mode, tmp_path):
  # SIGTERM becomes SystemExit(143) so that the exit hook stops the worker; a caller that catches it (pytest) must
  # still end, as it would without the library: after the grace period (1 s here), or at once at a second SIGTERM.
  proc = _start(mode, tmp_path)
  try:
    pid, log = _read_worker(proc)
    assert os.path.exists(log)  # The default log, in the process's private directory.
    line = proc.stdout.readline()
    assert line == 'READY\n', line  # (Not stderr: a child still looping would never close it.)
    proc.send_signal(signal.SIGTERM)
    line = proc.stdout.readline()
    assert line == 'SWALLOWED 143\n', line
    started = time.monotonic()
    if mode == 'swallow_then_sigterm':
      proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    elapsed = time.monotonic() - started
  finally:
    if proc.poll() is None:  # It did not end: end it here, not at the suite's end.
      proc.kill()
      proc.wait()
  assert proc.returncode == (143 if mode == 'swallow' else -signal.SIGTERM), proc.returncode
  assert elapsed < 10.0 if mode == 'swallow' else elapsed < 5.0, elapsed
  assert processes.wait_gone(pid), f'worker {pid} outlived its Python process ({mode})'
  if mode == 'swallow':  # Past the grace the exit hook never ran: the private directory goes all the same.
    assert not os.path.exists(os.path.dirname(log)), 'the private directory outlived the grace exit'


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
  from tff_gma.runtime import worker_process

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def secure_total(x):
    return tff.federated_secure_sum(x, 7)

  try:
    # The default: one thread (in the worker's environment, where its TensorFlow reads it), not this process's.
    worker = runtime.set_simulation_context(intra_op_threads=worker_process.DEFAULT_INTRA_OP_THREADS)
    assert worker_process.DEFAULT_INTRA_OP_THREADS == 1 and worker.intra_op_threads == 1
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
    runtime.set_simulation_context(intra_op_threads=worker_process.DEFAULT_INTRA_OP_THREADS)


def test_intra_op_threads_reads_the_environment_and_names_a_bad_value(monkeypatch):
  from tff_gma.runtime import worker_process
  monkeypatch.delenv(worker_process.INTRA_OP_THREADS_ENV, raising=False)
  threads = worker_process.intra_op_threads
  assert threads() == 1 and threads(0) == 0 and threads(4) == 4
  monkeypatch.setenv(worker_process.INTRA_OP_THREADS_ENV, ' 2 ')
  assert threads() == 2 and threads(1) == 1  # An argument wins.
  for raw in ('x', '-1', '1.5', '1025'):
    monkeypatch.setenv(worker_process.INTRA_OP_THREADS_ENV, raw)
    with pytest.raises(ValueError, match=r'^\$TFF_GMA_WORKER_INTRA_OP_THREADS must be an integer in \[0, 1024\] '):
      worker_process.intra_op_threads()
  for value in (-1, 1.0, True, '1', 1025):
    with pytest.raises(ValueError, match=r'^intra_op_threads must be an integer in \[0, 1024\]'):
      worker_process.intra_op_threads(value)


# ----------------------------------------------------------------------------------------------------------------
# Stopping processes: a bounded escalation, and children with default signal dispositions.

_STUBBORN = textwrap.dedent('''
    import signal, sys, time
    def note(signum, frame):
      print(signal.Signals(signum).name, flush=True)  # Noted, and otherwise ignored.
    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)
    print('READY', flush=True)
    time.sleep(600)
''')


def test_stop_process_escalates_to_sigkill_within_its_bound():
  from tff_gma import confinement
  child = subprocess.Popen([sys.executable, '-c', _STUBBORN], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           text=True, start_new_session=True)
  try:
    assert child.stdout.readline() == 'READY\n'
    started = time.monotonic()
    code = confinement.stop_process(child, wait_s=0.5)
    elapsed = time.monotonic() - started
  finally:
    if child.poll() is None:
      child.kill()
    child.wait()
  assert code == -signal.SIGKILL, code
  assert child.stdout.read().split() == ['SIGINT', 'SIGTERM']  # In that order, each given its wait.
  assert 1.0 <= elapsed < 1.0 + 0.5 + 1.0, elapsed  # Two full waits, then SIGKILL ends it at once.
  assert not processes.alive(child.pid)
  # A process that takes SIGINT by default ends at the first step.
  plain = subprocess.Popen([*processes.DEFAULT_SIGNALS, sys.executable, '-c',
                            'import time; print("READY", flush=True); time.sleep(600)'],
                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
  try:
    assert plain.stdout.readline() == 'READY\n'
    assert confinement.stop_process(plain, wait_s=5.0) == -signal.SIGINT
  finally:
    if plain.poll() is None:
      plain.kill()
    plain.wait()


_JOB = textwrap.dedent('''
    import json, time
    import numpy as np

    def _parent(pid):
      try:
        with open(f'/proc/{pid}/stat') as f:
          return int(f.read().rsplit(')', 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        return None

    import tensorflow_federated as tff
    from tff_gma import runtime

    @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
    def total(x):
      return tff.federated_sum(x)

    # First on TFF's default context: its worker, which TFF stops (when the context is replaced) with SIGINT and
    # then waits for without a limit.
    assert total([1, 2]) == 3
    tffs = [int(p) for p in os.listdir('/proc') if p.isdigit() and _parent(p) == os.getpid()]
    print('TFFS', json.dumps(tffs), flush=True)
    worker = runtime.set_simulation_context()

    @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
    def secure_total(x):
      return tff.federated_secure_sum_bitwidth(x, 8)

    assert secure_total([1, 2, 3]) == 6

    def ignored(pid):
      with open(f'/proc/{pid}/status') as f:
        return int(next(l for l in f if l.startswith('SigIgn:')).split()[1], 16)

    pids = [p for p in (worker.pid, worker.helper_pid) if p is not None]
    print('PIDS', json.dumps(pids), flush=True)
    print('IGNORED', json.dumps({'self': ignored(os.getpid()), **{str(p): ignored(p) for p in pids}}), flush=True)
    print('DONE', time.time(), flush=True)
''')


def test_a_background_job_stops_its_worker_which_takes_signals_by_default(tmp_path):
  # Started with `&` by a script or nohup: SIGINT and SIGQUIT ignored in Python, which must not pass that on to the
  # worker (nor to the confinement helper), and must still stop it and end at once. Replacing TFF's context, whose
  # worker ignores SIGINT too, must not hang in TFF's `__del__` either.
  job = background.run_background_job('import os\n' + _JOB, str(tmp_path), tests.ROOT,
                                      dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'), timeout_s=120.0)
  pids = []
  try:
    pids = json.loads(job.marked('TFFS'))
    assert len(pids) == 1, pids  # TFF's worker, started for the first computation.
    assert 'PIDS ' in job.stdout, (
        f'set_simulation_context() did not return (replacing TFF\'s context): {job.stderr[-2000:]}')
    pids += json.loads(job.marked('PIDS'))
    ignored = json.loads(job.marked('IGNORED'))
    assert job.exit_delay_s is not None and job.exit_delay_s < 20.0, 'the job did not end after its work'
    assert job.returncode == 0, job.stderr[-3000:]
    for pid in pids:
      assert processes.wait_gone(pid), f'{pid} outlived the background job'
  finally:
    left = job.cleanup(pids)
  assert not left
  sigint, sigquit = 1 << (signal.SIGINT - 1), 1 << (signal.SIGQUIT - 1)
  assert ignored.pop('self') & sigint, 'the job did not ignore SIGINT'
  for pid, mask in ignored.items():
    assert not mask & (sigint | sigquit), f'process {pid} (worker or helper) ignores SIGINT or SIGQUIT: {mask:#x}'
