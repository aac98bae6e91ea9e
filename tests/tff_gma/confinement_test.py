"""The simulation's TFF worker cannot be reached from other hosts, other local processes or other users.

Each case runs the simulation in a child Python (the "run") that keeps running computations until told to stop;
this test process, outside the run, probes the worker meanwhile. Where the kernel refuses the private network
namespace, the run refuses (`require`, the default, naming the opt-in) or warns once and falls back (`auto`).
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.tff_gma import netutil
from tests.tff_gma import processes

# Preludes that run first in the child, while it is still single-threaded.
_UNPRIVILEGED = '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER: from here on this process is uid 1000, without root.
  print('NO_USERNS', flush=True)
  sys.exit(0)
open('/proc/self/setgroups', 'w').write('deny')
open('/proc/self/uid_map', 'w').write(f'1000 {uid} 1')
open('/proc/self/gid_map', 'w').write(f'1000 {gid} 1')
'''

# A user namespace in which no further network or user namespace may be made: confinement is unavailable.
_NO_NAMESPACES = '''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
try:
  if libc.unshare(0x10000000) != 0:
    raise OSError(ctypes.get_errno(), 'unshare')
  open('/proc/self/setgroups', 'w').write('deny')
  open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')
  open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')
  for limit in ('max_net_namespaces', 'max_user_namespaces'):
    open(f'/proc/sys/user/{limit}', 'w').write('0')
except OSError as e:
  print('NO_USERNS', e, flush=True)
  sys.exit(0)
'''

_RUN = '''
import os, sys, time
os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
{prelude}
import numpy as np
import tensorflow_federated as tff
from tff_gma import runtime

worker = runtime.set_simulation_context()

@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def secure_total(x):
  return tff.federated_secure_sum_bitwidth(x, 8)

assert secure_total([1, 2, 3]) == 6
print('WORKER', worker.pid, getattr(worker, 'helper_pid', None), worker.target, getattr(worker, 'confined', None),
      flush=True)
stop = sys.argv[1]
n = 0
while not os.path.exists(stop):  # Computations keep running while the test probes the worker.
  assert secure_total([1, 2, n % 100]) == 3 + n % 100
  n += 1
print('DONE', n, flush=True)
'''


def _start_run(tmp_path, prelude=''):
  stop = tmp_path / 'stop'
  proc = subprocess.Popen(
      [sys.executable, '-c', _RUN.format(prelude=textwrap.dedent(prelude)), str(stop)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=os.getcwd(), text=True)
  line = proc.stdout.readline()
  while line and not line.startswith(('WORKER', 'NO_USERNS')):
    line = proc.stdout.readline()
  if line.startswith('NO_USERNS'):
    proc.communicate(timeout=60)
    pytest.skip(f'no user namespaces for the test itself: {line.strip()}')
  assert line.startswith('WORKER'), proc.communicate(timeout=60)[1]
  _, pid, helper_pid, target, how = line.split(maxsplit=4)
  return proc, stop, int(pid), target, how.strip()


def _finish_run(proc, stop):
  stop.write_text('')
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  assert 'DONE' in out
  return err


@pytest.mark.slow
@pytest.mark.parametrize('prelude', ['', _UNPRIVILEGED], ids=['as_is', 'unprivileged'])
def test_worker_unreachable_while_a_run_computes(prelude, tmp_path):
  proc, stop, pid, target, how = _start_run(tmp_path, prelude)
  try:
    assert proc.poll() is None
    ports = netutil.listening_ports(pid)
    assert ports, 'the worker listens on no TCP port at all'
    addresses = netutil.host_addresses()
    assert addresses, 'this host has no non-loopback address to probe'
    for port in ports:  # From this process, outside the run: refused on every address of the host.
      for address in addresses + ['127.0.0.1']:
        assert netutil.connect(address, port) == 'refused', (address, port)
    # Nothing of the worker in this (the host's) network namespace.
    assert not netutil.host_listening_ports(pid)
    assert os.readlink(f'/proc/{pid}/ns/net') != os.readlink('/proc/self/ns/net')
    assert target.startswith('unix:'), target
    path = target[len('unix:'):]
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == '0o700'
    if prelude:
      assert how == 'user and network namespace'
    if os.geteuid() == 0:  # Another local user cannot connect to the worker's socket.
      assert netutil.unix_connect_as(path, 65534, 65534) == 'permission denied'
    assert proc.poll() is None, 'the run ended during the probes'
  finally:
    _finish_run(proc, stop)
  assert not processes.alive(pid)


@pytest.mark.slow
def test_fallback_warns_once_or_refuses_where_namespaces_are_unavailable(tmp_path):
  script = textwrap.dedent(_NO_NAMESPACES) + textwrap.dedent('''
      os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
      import numpy as np
      import pytest
      import tensorflow_federated as tff
      from tff_gma import runtime
      from tff_gma.runtime import listeners

      os.environ.pop('TFF_GMA_WORKER_CONFINEMENT', None)  # The default refuses, naming the opt-in.
      with pytest.raises(RuntimeError, match='required') as refused:
        runtime.set_simulation_context()
      print('DEFAULT', str(refused.value).replace(chr(10), ' '), flush=True)
      os.environ['TFF_GMA_WORKER_CONFINEMENT'] = 'require'
      with pytest.raises(RuntimeError, match='required') as refused:
        runtime.set_simulation_context()
      print('REFUSED', str(refused.value).replace(chr(10), ' '), flush=True)

      os.environ['TFF_GMA_WORKER_CONFINEMENT'] = 'auto'
      worker = runtime.set_simulation_context()
      extra = runtime.start_local_workers(1)[0]
      assert worker.confined is None and extra.confined is None
      assert listeners.confinement_status().startswith('unavailable')

      @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
      def secure_total(x):
        return tff.federated_secure_sum_bitwidth(x, 8)

      assert secure_total([1, 2, 3]) == 6
      print('FALLBACK', worker.target, flush=True)
  ''')
  proc = subprocess.run([sys.executable, '-c', 'import os, sys\n' + script], capture_output=True, text=True,
                        stdin=subprocess.DEVNULL, timeout=300)
  assert proc.returncode == 0, proc.stderr
  if 'NO_USERNS' in proc.stdout:
    pytest.skip('cannot make a user namespace without namespaces for the test')
  assert 'REFUSED' in proc.stdout and 'TFF_GMA_WORKER_CONFINEMENT=require' in proc.stdout
  (default,) = [line for line in proc.stdout.splitlines() if line.startswith('DEFAULT')]
  assert 'the default; TFF_GMA_WORKER_CONFINEMENT is unset' in default
  assert 'opt in to the exposed worker with TFF_GMA_WORKER_CONFINEMENT=off' in default
  assert 'FALLBACK 127.0.0.1:' in proc.stdout
  # Said once, clearly, for the two workers.
  assert proc.stderr.count('TFF worker NOT confined') == 1, proc.stderr
  assert 'listens on all interfaces' in proc.stderr


@pytest.mark.slow
def test_default_log_is_private_and_stale_logs_are_removed(tmp_path):
  tmp = tmp_path / 'tmp'
  tmp.mkdir()
  victim = tmp_path / 'victim'
  dead = subprocess.Popen(['true'])
  dead.wait()
  stale_file = tmp / f'tff_gma_worker_{dead.pid}.log'
  stale_file.write_text('')
  stale_dir = tmp / f'tff_gma_worker_{dead.pid}_abc123_x'
  stale_dir.mkdir()
  (stale_dir / 'worker_0.log').write_text('old')
  live_file = tmp / f'tff_gma_worker_{os.getpid()}.log'  # This test's pid: alive, kept.
  live_file.write_text('')
  script = textwrap.dedent(f'''
      import os, tempfile
      os.environ['TF_CPP_MIN_LOG_LEVEL'] = '0'  # The worker logs its banner.
      # A planted symbolic link at the (old) predictable log path of this process.
      os.symlink({str(victim)!r}, os.path.join(tempfile.gettempdir(), f'tff_gma_worker_{{os.getpid()}}.log'))
      import numpy as np
      import tensorflow_federated as tff
      from tff_gma import runtime
      worker = runtime.set_simulation_context()

      @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
      def secure_total(x):
        return tff.federated_secure_sum_bitwidth(x, 8)

      assert secure_total([1, 2, 3]) == 6
      print('LOG', worker.log_path, oct(os.stat(os.path.dirname(worker.log_path)).st_mode & 0o777),
            os.path.getsize(worker.log_path), flush=True)
  ''')
  env = dict(os.environ, TMPDIR=str(tmp))
  env.pop('TFF_GMA_WORKER_LOG', None)
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, env=env,
                        stdin=subprocess.DEVNULL, timeout=300)
  assert proc.returncode == 0, proc.stderr
  _, log, mode, size = next(line for line in proc.stdout.splitlines() if line.startswith('LOG')).split()
  assert not victim.exists(), 'the worker log followed a planted symbolic link'
  assert mode == '0o700' and int(size) > 0
  assert os.path.dirname(log) != str(tmp)
  assert not os.path.exists(os.path.dirname(log)), 'the private directory was left behind at a clean exit'
  assert not stale_file.exists() and not stale_dir.exists(), 'stale logs of a dead process were kept'
  assert live_file.exists()


def test_explicit_log_path_symlink_is_refused(tmp_path):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  victim = tmp_path / 'victim'
  link = tmp_path / 'worker.log'
  link.symlink_to(victim)
  with pytest.raises(RuntimeError, match='symbolic link'):
    runtime.WorkerProcess(log_path=str(link)).start()
  assert not victim.exists()


def test_remove_stale_files(tmp_path):
  from tff_gma.runtime import files  # pylint: disable=g-import-not-at-top
  dead = subprocess.Popen(['true'])
  dead.wait()
  victim_dir = tmp_path / 'victim'
  victim_dir.mkdir()
  (victim_dir / 'keep').write_text('')
  stale = [tmp_path / f'tff_gma_worker_{dead.pid}.log', tmp_path / f'tff_gma_worker_{dead.pid}_a1b2c3d4']
  stale[0].write_text('')
  stale[1].mkdir()
  (stale[1] / 'worker_0.log').write_text('')
  (stale[1] / 'link').symlink_to(victim_dir)
  kept = [tmp_path / f'tff_gma_worker_{os.getpid()}.log', tmp_path / 'tff_gma_worker_x.log',
          tmp_path / f'tff_gma_worker_{dead.pid}.txt']
  for path in kept:
    path.write_text('')
  link = tmp_path / f'tff_gma_worker_{dead.pid}_link'
  link.symlink_to(victim_dir)
  removed = files.remove_stale_files(str(tmp_path))
  assert sorted(removed) == sorted(str(p) for p in stale)
  assert all(p.exists() for p in kept)
  assert link.is_symlink() and (victim_dir / 'keep').exists()  # Symbolic links: never followed.


def test_removing_the_private_dir_gives_up_on_a_held_lock_when_told_to(tmp_path, monkeypatch):
  # The SIGTERM grace timer removes it this way: a main thread stuck holding the lock must not block the exit.
  from tff_gma.runtime import files  # pylint: disable=g-import-not-at-top
  from tff_gma.runtime.state import STATE  # pylint: disable=g-import-not-at-top
  private = tmp_path / 'tff_gma_worker_x'
  private.mkdir()
  (private / 'worker_0.sock').write_text('')
  monkeypatch.setattr(STATE, 'run_dir', str(private))  # This process's own directory stays as it was.
  monkeypatch.setattr(STATE, 'run_dir_pid', os.getpid())
  with STATE.files_lock:
    started = time.monotonic()
    files.remove_private_dir(lock_timeout=0.2)
    assert time.monotonic() - started < 5.0 and private.exists() and STATE.run_dir == str(private)
  files.remove_private_dir(lock_timeout=0.2)
  assert not private.exists() and STATE.run_dir is None


def test_restarted_worker_is_confined_again(simulation_context):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  from tff_gma.runtime import listeners  # pylint: disable=g-import-not-at-top
  worker = runtime.set_simulation_context()
  if worker.confined is None:
    pytest.skip(f'confinement unavailable here: {listeners.confinement_status()}')
  old_pid, old_helper = worker.pid, worker.helper_pid
  os.kill(old_pid, 9)
  deadline = time.monotonic() + 15
  while (processes.alive(old_pid) or processes.alive(old_helper)) and time.monotonic() < deadline:
    time.sleep(0.05)

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def total(x):
    return tff.federated_sum(x)

  assert total([1, 2]) == 3
  assert worker.pid != old_pid and worker.confined is not None
  assert worker.target.startswith('unix:') and not netutil.host_listening_ports(worker.pid)
