"""Two TFF workers on two hosts, as far as the network can tell: each in a network namespace of its own, joined to
this one by a veth pair, bound to its namespace's address only; the runner trains over TCP across the pairs and
ends as on one worker. Needs root and `ip` (skipped otherwise, naming why)."""

import csv
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import tests
from tests.tff_gma import processes
from tests.training import loss_bound_test

_PORT = 8470  # Each namespace has its own ports: both workers use it.
_FLAGS = ['--rounds=2', '--first_round_deadline_s=600', '--round_deadline_factor=10', '--min_round_deadline_s=120']
_SETUP_TIMEOUT_S = 30
_WORKER_START_S = 240


def _ip(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(['ip', *args], capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S, check=False)


def _set_up(*args: str) -> None:
  """`ip ARGS`, skipping the test (with the command and its stderr) where this host refuses it."""
  done = _ip(*args)
  if done.returncode != 0:
    pytest.skip(f'`ip {" ".join(args)}` failed (status {done.returncode}): {done.stderr.strip()}')


class _Host:
  """One namespace `name` joined to this one by the veth pair (`veth` here, its peer inside), on a /30 subnet:
  `outer` is this namespace's end, `address` the namespace's own."""

  def __init__(self, index: int):
    pid = os.getpid()
    # A /30 per namespace, from the pid, so that parallel runs neither share names nor route the same subnet.
    network = ipaddress.ip_network('10.211.0.0/16')
    first = network.network_address + ((pid % 8192) * 8 + 4 * index)
    self.name = f'tff_gma_{pid}_{index}'
    self.veth = f'tffv{pid}h{index}'  # At most 15 characters (pids are at most 7 digits).
    self.peer = f'tffv{pid}n{index}'
    self.outer = str(first + 1)
    self.address = str(first + 2)


@pytest.fixture
def hosts():
  """Two namespaces, each with a veth pair to this one and its links up; removed afterwards, also on failure."""
  if os.geteuid() != 0:
    pytest.skip(f'network namespaces need root (this is uid {os.geteuid()})')
  if shutil.which('ip') is None:
    pytest.skip('no `ip` command (iproute2) on PATH')
  made = [_Host(0), _Host(1)]
  try:
    for host in made:
      _set_up('netns', 'add', host.name)
      _set_up('link', 'add', host.veth, 'type', 'veth', 'peer', 'name', host.peer)
      _set_up('link', 'set', host.peer, 'netns', host.name)
      _set_up('addr', 'add', f'{host.outer}/30', 'dev', host.veth)
      _set_up('link', 'set', host.veth, 'up')
      _set_up('-n', host.name, 'addr', 'add', f'{host.address}/30', 'dev', host.peer)
      _set_up('-n', host.name, 'link', 'set', host.peer, 'up')
      _set_up('-n', host.name, 'link', 'set', 'lo', 'up')
    yield made
  finally:
    for host in made:
      _ip('link', 'del', host.veth)  # Takes its peer with it; absent already if the namespace went first.
      _ip('netns', 'del', host.name)


def _start_worker(tmp_path, host: _Host) -> tuple[subprocess.Popen, str]:
  """`python -m tff_gma.worker --bind=<the namespace's address>` inside `host`, in its own session, its output in
  a file: (the command, its log path)."""
  log = tmp_path / f'{host.name}.log'
  with open(log, 'w') as f:
    process = subprocess.Popen(
        ['ip', 'netns', 'exec', host.name, *processes.DEFAULT_SIGNALS, sys.executable, '-m', 'tff_gma.worker',
         f'--port={_PORT}', f'--bind={host.address}'],
        cwd=tests.ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  return process, str(log)


def _wait_listening(process: subprocess.Popen, log: str, host: _Host) -> str:
  """The worker's start-up message, once it says it listens on its address only."""
  deadline = time.monotonic() + _WORKER_START_S
  while True:
    with open(log) as f:
      text = f.read()
    if f'listening on {host.address}:{_PORT} only' in text and 'Ctrl-C stops it.' in text:
      return text
    if process.poll() is not None:
      if 'confinement is required' in text or 'confinement is unavailable' in text:
        pytest.skip(f'the kernel refuses the worker its own network namespace here: {text.strip().splitlines()[-1]}')
      raise AssertionError(f'the worker in {host.name} exited ({process.returncode}): {text[-3000:]}')
    assert time.monotonic() < deadline, f'the worker in {host.name} did not start: {text[-3000:]}'
    time.sleep(0.2)


def _connect_inside(host: _Host, address: str) -> str:
  """Connects to `address`:_PORT from inside `host`'s namespace: 'connected', or the error's class name."""
  probe = ('import socket, sys\n'
           'try:\n'
           f'  socket.create_connection(({address!r}, {_PORT}), timeout=10).close()\n'
           "  print('connected')\n"
           'except OSError as e:\n'
           '  print(type(e).__name__)\n')
  done = subprocess.run(['ip', 'netns', 'exec', host.name, sys.executable, '-I', '-S', '-c', probe],
                        capture_output=True, text=True, timeout=60, check=False)
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


def _train(tmp_path, name: str, flags: list[str]):
  """`python -m training.run` with the test's settings (in its own session, output in a file): its output dir."""
  out = tmp_path / name
  runner = loss_bound_test._Runner(tmp_path, out, [*_FLAGS, *flags], name)  # pylint: disable=protected-access
  try:
    assert runner.process.wait(timeout=600) == 0, f'{name}: {runner.log.read_text()[-3000:]}'
  finally:
    runner.stop()
  return out


def _metrics(out) -> tuple[list[str], list[list[str]]]:
  with open(out / 'metrics.csv', newline='') as f:
    rows = list(csv.reader(f))
  return rows[0], rows[1:]


def _assert_same_metrics(one, two) -> None:
  """metrics.csv of `two` as `one`'s: the same columns and rounds, each number within 1e-5."""
  (header, rows), (header_two, rows_two) = _metrics(one), _metrics(two)
  assert header_two == header
  assert len(rows_two) == len(rows) > 0
  for row, row_two in zip(rows, rows_two):
    for column, a, b in zip(header, row, row_two):
      try:
        a_value, b_value = float(a), float(b)
      except ValueError:
        assert b == a, (column, row, row_two)
        continue
      assert b_value == pytest.approx(a_value, rel=0, abs=1e-5), (column, row, row_two)


@pytest.mark.slow
def test_workers_in_two_network_namespaces_train_over_tcp_as_one_worker(tmp_path, hosts):
  started = []
  try:
    for host in hosts:
      started.append(_start_worker(tmp_path, host))
    one = _train(tmp_path, 'one', [])  # Meanwhile the workers start.
    for (process, log), host in zip(started, hosts):
      banner = _wait_listening(process, log, host)
      assert re.search(r'Who can connect: any host that can reach \S+ only', banner), banner
      # Bound to its namespace's address only: the namespace's own loopback finds no worker.
      assert _connect_inside(host, '127.0.0.1') == 'ConnectionRefusedError'
    workers = ','.join(f'{host.address}:{_PORT}' for host in hosts)
    two = _train(tmp_path, 'two', [f'--workers={workers}'])
  finally:
    for process, _ in started:  # SIGTERM: the command stops its worker (exit 0); then whatever is left.
      process.terminate()
      try:
        process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass
      processes.kill_session(process.pid)
      process.wait(timeout=30)
  _assert_same_metrics(one, two)
