"""Clients split over two TFF workers (TFF's mergeable-computation runtime) give the one-worker result."""

import os
import re
import socket
import subprocess
import sys
import time
from typing import Optional

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import models
from tff_gma import runtime
from tff_gma.data import loaders
from tests.tff_gma import fixtures


@pytest.fixture(scope='module')
def two_workers():
  workers = runtime.start_local_workers(2)
  yield [w.target for w in workers]
  for w in workers:
    w.stop()
  runtime.set_simulation_context()  # Back to the suite's context.


def _one_round(aggregator, set_context):
  data = loaders.load_federated_data('digits', 'iid', 4, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  process = fixtures.fed_avg_family(models.model_fn(build_keras, data.input_spec), 'fedavg', aggregator)
  set_context()
  state = fixtures.seeded_initial_state(process, build_keras, 0)
  datasets = fixtures.round_datasets(data.train, 1)
  output = process.next(state, datasets)
  return process.get_model_weights(output.state), output.metrics


@pytest.mark.parametrize('aggregator', [
    None, aggregators.GradientMaskedFactory(tau=0.4),
    aggregators.GradientMaskedFactory(tau=0.4, secure=True, value_bound=1.0),
], ids=['tff_mean', 'gma', 'gma_secure'])
def test_two_workers_match_one(aggregator, two_workers):
  one, metrics_one = _one_round(aggregator, runtime.set_simulation_context)
  two, metrics_two = _one_round(aggregator, lambda: runtime.set_multi_worker_context(two_workers))
  runtime.set_simulation_context()
  for a, b in zip(one.trainable, two.trainable):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert not np.allclose(one.trainable[0], 0)
  assert (metrics_one['client_work']['train']['num_examples']
          == metrics_two['client_work']['train']['num_examples'])


def _doubled_slowly_on_the_first_worker():
  """Each client's value doubled, with its sum: the clients of the first worker's slice (values below 4 of 1-6)
  work long, so that the second worker finishes first."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation(np.float32)
  def doubled(x):
    m = tf.fill([200, 200], 1e-3)
    steps = tf.where(x < 4.0, 300, 0)
    _, waste = tf.while_loop(lambda i, a: i < steps, lambda i, a: (i + 1, a + tf.reduce_sum(m @ m)), (0, 0.0))
    return x * 2.0 + 0.0 * waste

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def comp(values):
    return tff.federated_sum(values), tff.federated_map(doubled, values)

  return comp


def test_each_clients_result_comes_back_to_it_whichever_worker_finishes_first(two_workers):
  comp = _doubled_slowly_on_the_first_worker()
  runtime.set_multi_worker_context(two_workers)
  try:
    total, doubled = comp([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
  finally:
    runtime.set_simulation_context()
  assert total == 21.0
  np.testing.assert_array_equal(doubled, [2.0, 4.0, 6.0, 8.0, 10.0, 12.0])


def test_each_computation_is_compiled_once_for_all_the_workers(two_workers, monkeypatch):
  """The workers' contexts share one compilation of each computation (each worker's own would compile it again)."""
  from tff_gma.runtime import contexts  # pylint: disable=g-import-not-at-top
  compiled = []
  compile_for_simulation = contexts.compile_for_simulation
  monkeypatch.setattr(contexts, 'compile_for_simulation',
                      lambda comp: compiled.append(comp) or compile_for_simulation(comp))
  comp = _doubled_slowly_on_the_first_worker()
  runtime.set_multi_worker_context(two_workers)
  try:
    for _ in range(2):
      total, _ = comp([1.0, 2.0, 3.0, 4.0])
  finally:
    runtime.set_simulation_context()
  assert total == 10.0
  # `up_to_merge`, then the merges with `after_merge`, each on both workers (the result holds the clients' values):
  # two computations, each compiled once, and not again in the second call.
  assert len(compiled) == 2 and compiled[0] is not compiled[1], compiled


def _counting(monkeypatch, method: str, fail_first: Optional[BaseException] = None) -> list:
  """The calls of `tff.framework.RemoteExecutor.<method>` from now on, as (argument's type) entries; the first one
  raises `fail_first` instead, where it is given."""
  calls = []
  original = getattr(tff.framework.RemoteExecutor, method)

  async def counted(self, *args, **kwargs):
    calls.append(getattr(args[0], 'type_signature', None) if args else None)
    if fail_first is not None and len(calls) == 1:
      raise fail_first
    return await original(self, *args, **kwargs)

  monkeypatch.setattr(tff.framework.RemoteExecutor, method, counted)
  return calls


def test_each_computation_is_sent_to_each_worker_once(two_workers, monkeypatch):
  """TFF's own context sends the computation with every call; a worker here keeps it for the next call."""
  comp = _doubled_slowly_on_the_first_worker()
  runtime.set_multi_worker_context(two_workers)
  sent = _counting(monkeypatch, 'create_value')
  try:
    for _ in range(3):
      total, doubled = comp([tf.constant(1.0), 2.0, 3.0, 4.0])  # An eager tensor goes as TFF's contexts send it.
  finally:
    runtime.set_simulation_context()
  assert total == 10.0
  np.testing.assert_array_equal(doubled, [2.0, 4.0, 6.0, 8.0])
  # The computations sent are the values of a function type.
  functions = [t for t in sent if isinstance(t, tff.FunctionType)]
  assert len(functions) == 4, sent  # `up_to_merge`, and the merges with `after_merge`, on each of the two workers.


def test_a_worker_found_unreachable_retries_the_whole_call(two_workers, monkeypatch):
  comp = _doubled_slowly_on_the_first_worker()
  runtime.set_multi_worker_context(two_workers)
  calls = _counting(monkeypatch, 'create_call', fail_first=tff.framework.RetryableError('unreachable'))
  try:
    total, doubled = comp([1.0, 2.0, 3.0, 4.0])
  finally:
    runtime.set_simulation_context()
  assert total == 10.0
  np.testing.assert_array_equal(doubled, [2.0, 4.0, 6.0, 8.0])
  # `up_to_merge` on both workers (one of them failed), then the whole call again: `up_to_merge` and `after_merge`
  # on each worker.
  assert len(calls) == 2 + 4, calls


def test_a_call_that_fails_raises_its_error_and_the_next_call_runs(two_workers, monkeypatch):
  comp = _doubled_slowly_on_the_first_worker()
  runtime.set_multi_worker_context(two_workers)
  _counting(monkeypatch, 'create_call', fail_first=ValueError('the first call fails'))
  try:
    with pytest.raises(ValueError, match='the first call fails'):
      comp([1.0, 2.0, 3.0, 4.0])
    total, _ = comp([1.0, 2.0, 3.0, 4.0])
  finally:
    runtime.set_simulation_context()
  assert total == 10.0


def test_multi_stage_aggregator_is_refused_before_running():
  data = loaders.load_federated_data('digits', 'iid', 2, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  rfa = fixtures.fed_avg_family(model_fn, 'fedavg', aggregators.GeometricMedianFactory(num_passes=3))
  with pytest.raises(ValueError, match='3 sequential'):
    runtime.check_single_aggregation_stage(rfa)
  gma = fixtures.fed_avg_family(model_fn, 'fedavg', aggregators.GradientMaskedFactory())
  assert runtime.check_single_aggregation_stage(gma) == 1


def test_bad_targets_are_rejected():
  with pytest.raises(ValueError, match='host:port'):
    runtime.set_multi_worker_context(['localhost'])
  with pytest.raises(ValueError, match='at least one'):
    runtime.set_multi_worker_context([])


def test_local_workers_are_confined_like_the_simulation_worker(two_workers):
  if runtime.listeners.confinement_status().startswith('unavailable'):
    pytest.skip(runtime.listeners.confinement_status())
  from tests.tff_gma import netutil  # pylint: disable=g-import-not-at-top
  assert all(t.startswith('unix:') for t in two_workers)
  for worker in list(runtime.state.STATE.live_workers):
    assert not netutil.host_listening_ports(worker.pid)


def test_unreachable_worker_fails_fast_naming_it():
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=r'127\.0\.0\.1:1\b'):
    runtime.set_multi_worker_context(['127.0.0.1:1'])
  assert time.monotonic() - start < 5
  with socket.socket() as silent:  # Accepts connections but speaks no gRPC.
    silent.bind(('127.0.0.1', 0))
    silent.listen()
    target = f'127.0.0.1:{silent.getsockname()[1]}'
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(target)):
      runtime.set_multi_worker_context([target], connect_timeout_s=2)
    assert time.monotonic() - start < 6


@pytest.mark.slow
def test_worker_command_prints_its_exposure_and_binds_where_told():
  from tests.tff_gma import netutil  # pylint: disable=g-import-not-at-top
  proc = subprocess.Popen([sys.executable, '-m', 'tff_gma.worker', '--port=0', '--bind=127.0.0.1'],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  try:
    lines = []
    while not lines or not lines[-1].startswith('Ctrl-C'):
      line = proc.stdout.readline()
      assert line, proc.stderr.read()
      lines.append(line.strip())
    banner = '\n'.join(lines)
    pid = int(re.search(r'\(pid (\d+)\)', banner).group(1))
    port = int(re.search(r'127\.0\.0\.1:(\d+) only', banner).group(1))
    assert 'UNAUTHENTICATED' in banner
    assert netutil.connect('127.0.0.1', port) == 'connected'
    for address in netutil.host_addresses():
      assert netutil.connect(address, port) == 'refused', address
    if 'NOT confined' not in banner:  # The worker itself: no port on the host.
      assert not netutil.host_listening_ports(pid)
    runtime.set_multi_worker_context([f'127.0.0.1:{port}'])
    assert _secure_total([1, 2, 3]) == 6
  finally:
    runtime.set_simulation_context()
    proc.terminate()
    proc.communicate(timeout=60)
  deadline = time.monotonic() + 15
  while os.path.exists(f'/proc/{pid}') and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not os.path.exists(f'/proc/{pid}')


def _secure_total(values):
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def secure_total(x):
    return tff.federated_secure_sum_bitwidth(x, 8)

  return secure_total(values)


# --- Who can connect to `python -m tff_gma.worker` (issue 24, item 1). --------------------------------------------

NOBODY = 65534

# The probe: a graph that writes a file, sent to the worker by user nobody. Imports and tracing happen as
# root (nobody cannot read this interpreter's files), then the process becomes nobody and calls the worker.
_GRAPH_AS_NOBODY = '''
import os, sys, threading
os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
target, path = sys.argv[1], sys.argv[2]
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation
from tff_gma.runtime import contexts

@tff.tensorflow.computation
def write_file():
  written = tf.io.write_file(path, tf.constant('written by the worker'))
  with tf.control_dependencies([written]):
    return tf.constant(1)

os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.geteuid() == 65534 and os.getuid() == 65534
tff.framework.get_context_stack().set_default_context(tff.framework.SyncExecutionContext(
    executor_fn=contexts.executor_factory(None, 1, target=target), compiler_fn=contexts.compile_for_simulation,
    transform_args=tensorflow_computation.transform_args, transform_result=tensorflow_computation.transform_result))
# TFF retries a call whose connection fails (UNAVAILABLE is retryable) without end: it gets 15 s.
threading.Timer(15, lambda: (print('NOT_RUN', flush=True), os._exit(0))).start()
try:
  print('RAN', write_file(), flush=True)
except Exception as e:  # pylint: disable=broad-except
  print('FAILED', type(e).__name__, flush=True)
os._exit(0)
'''


def _write_file_computation(path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation
  def write_file():
    written = tf.io.write_file(path, tf.constant('written by the worker'))
    with tf.control_dependencies([written]):
      return tf.constant(1)

  return write_file


def _start_worker_command(args):
  """`python -m tff_gma.worker ARGS`: (process, banner, worker pid); skips where the kernel refuses confinement."""
  proc = subprocess.Popen([sys.executable, '-m', 'tff_gma.worker'] + args,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  lines = []
  while not lines or not lines[-1].startswith('Ctrl-C'):
    line = proc.stdout.readline()
    if not line:
      err = proc.communicate(timeout=60)[1]
      if 'confinement is required' in err or 'confinement is unavailable' in err:
        pytest.skip(f'the kernel refuses a network namespace here: {err.strip().splitlines()[-1]}')
      raise AssertionError(err)
    lines.append(line.strip())
  banner = '\n'.join(lines)
  return proc, banner, int(re.search(r'\(pid (\d+)\)', banner).group(1))


def _stop_worker_command(proc, pid):
  proc.terminate()
  proc.communicate(timeout=60)
  deadline = time.monotonic() + 15
  while os.path.exists(f'/proc/{pid}') and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not os.path.exists(f'/proc/{pid}'), 'the worker outlived the command'


@pytest.mark.slow
def test_loopback_worker_runs_nothing_for_another_user(tmp_path):
  """`--bind=127.0.0.1` (the SSH-tunnel setup): a graph sent as user nobody is refused; the owner's runs."""
  if os.geteuid() != 0:
    pytest.skip('acting as user nobody needs root')
  from tests.tff_gma import netutil  # pylint: disable=g-import-not-at-top
  private = tmp_path / 'root_only'
  private.mkdir(mode=0o700)
  log = tmp_path / 'worker.log'
  proc, banner, pid = _start_worker_command(['--port=0', '--bind=127.0.0.1', f'--log_path={log}'])
  try:
    port = int(re.search(r'127\.0\.0\.1:(\d+) only', banner).group(1))
    # A raw connection as nobody is closed at once; the owner's reaches the worker (its gRPC server speaks first).
    assert netutil.first_read_as(('127.0.0.1', port), NOBODY, NOBODY) == 'eof'
    assert netutil.first_read_as(('127.0.0.1', port), os.geteuid(), os.getegid()) == 'data'
    # The probe: a TFF call from user nobody whose graph would write a file in a directory only root can write.
    probe = subprocess.run([sys.executable, '-c', _GRAPH_AS_NOBODY, f'127.0.0.1:{port}', str(private / 'nobody')],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert 'RAN' not in probe.stdout and ('NOT_RUN' in probe.stdout or 'FAILED' in probe.stdout), probe
    assert not (private / 'nobody').exists(), 'a graph sent by user nobody ran in the worker'
    # The owner's same graph runs, through the same listener.
    runtime.set_multi_worker_context([f'127.0.0.1:{port}'])
    assert _write_file_computation(str(private / 'owner'))() == 1
    assert (private / 'owner').read_text() == 'written by the worker'
    assert _secure_total([1, 2, 3]) == 6
  finally:
    runtime.set_simulation_context()
    _stop_worker_command(proc, pid)
  # The start-up message says exactly that.
  assert 'Who can connect: only processes of ' in banner and f'(uid {os.geteuid()}) on this host' in banner
  assert 'any local process' not in banner.lower()
  refusals = [line for line in log.read_text().splitlines() if 'refused a connection from 127.0.0.1' in line]
  # (TFF retries the call: each retry is refused. The last may find nobody's socket already closed: also refused.)
  assert refusals and f'a local socket of uid {NOBODY}' in refusals[0], log.read_text()[-2000:]


@pytest.mark.slow
def test_unix_socket_worker_serves_only_its_owner(tmp_path):
  """`--unix=PATH`: a 0600 socket in a 0700 directory it creates; nobody cannot connect, the owner runs a round."""
  from tests.tff_gma import netutil  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'sockets' / 'worker.sock'
  log = tmp_path / 'worker.log'
  proc, banner, pid = _start_worker_command([f'--unix={path}', f'--log_path={log}'])
  try:
    assert f'--workers=unix:{path}' in banner and 'no TCP port' in banner
    assert f'ssh -N -L 8000:{path}' in banner
    assert oct(os.stat(path.parent).st_mode & 0o777) == '0o700'
    assert oct(os.stat(path).st_mode & 0o777) == '0o600'
    assert not netutil.host_listening_ports(pid)
    if os.geteuid() == 0:
      assert netutil.first_read_as(str(path), NOBODY, NOBODY) == 'connect failed'  # The 0700 directory.
      # Past the directory (root's file access) but uid nobody: the forwarder's SO_PEERCRED check closes it.
      assert netutil.first_read_as(str(path), NOBODY, NOBODY, keep_root_files=True) == 'eof'
    runtime.set_multi_worker_context([f'unix:{path}'])
    assert _secure_total([1, 2, 3]) == 6
  finally:
    runtime.set_simulation_context()
    _stop_worker_command(proc, pid)
  assert not path.exists(), 'the socket was left behind'
  if os.geteuid() == 0:
    assert 'a process (pid ' in log.read_text() and f'of uid {NOBODY} on the Unix socket' in log.read_text()


def test_unix_socket_directory_must_be_the_users_own_and_private(tmp_path):
  opened = tmp_path / 'open'
  opened.mkdir()
  opened.chmod(0o755)
  with pytest.raises(RuntimeError, match=r'has mode 0755; it must be 0700'):
    runtime.listeners.unix_listener(str(opened / 'w.sock'))
  private = tmp_path / 'private'
  private.mkdir(mode=0o700)
  link = tmp_path / 'link'
  link.symlink_to(private)
  with pytest.raises(RuntimeError, match='not a directory'):
    runtime.listeners.unix_listener(str(link / 'w.sock'))
  if os.geteuid() == 0:
    others = tmp_path / 'others'
    others.mkdir(mode=0o700)
    os.chown(others, NOBODY, NOBODY)
    with pytest.raises(RuntimeError, match=f'belongs to uid {NOBODY}, not to this user'):
      runtime.listeners.unix_listener(str(others / 'w.sock'))
  (private / 'file').write_text('')
  with pytest.raises(RuntimeError, match='is not a socket'):
    runtime.listeners.unix_listener(str(private / 'file'))
  created = tmp_path / 'new' / 'w.sock'  # Missing directory: created 0700.
  listener = runtime.listeners.unix_listener(str(created))
  try:
    assert oct(os.stat(created.parent).st_mode & 0o777) == '0o700'
    assert oct(os.stat(created).st_mode & 0o777) == '0o600'
    listener.listen()
    with pytest.raises(RuntimeError, match='another process serves on'):
      runtime.listeners.unix_listener(str(created))
  finally:
    listener.close()
  # A stale socket (nobody listening) is replaced.
  runtime.listeners.unix_listener(str(created)).close()
  with pytest.raises(RuntimeError, match='at most 107'):
    runtime.listeners.unix_listener(str(tmp_path / ('x' * 120)))


@pytest.mark.slow
def test_worker_command_refusals_are_one_line(tmp_path):
  opened = tmp_path / 'open'
  opened.mkdir()
  opened.chmod(0o755)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  cases = [
      ([f'--unix={opened}/w.sock'], 'has mode 0755; it must be 0700'),
      ([f'--unix={tmp_path}/d/w.sock', '--bind=127.0.0.1'], 'leave out --port and --bind'),
  ]
  for args, message in cases:
    proc = subprocess.run([sys.executable, '-m', 'tff_gma.worker'] + args, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env, timeout=300)
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], proc.stderr
    assert not os.path.exists(f'{tmp_path}/d/w.sock')


def test_unconfined_worker_refuses_restricted_listeners(tmp_path):
  """Unconfined (opt-in), nothing checks who connects and the worker listens on all interfaces itself: a
  loopback, address or Unix listener would only pretend to restrict it, so they are refused."""
  for listener in ({'listen_host': '127.0.0.1'}, {'unix_path': str(tmp_path / 'd' / 'w.sock')}):
    worker = runtime.WorkerProcess(confinement='off', **listener)
    with pytest.raises(RuntimeError, match='cannot (restrict|serve) the TFF worker'):
      worker.start()
    assert not worker.running()
  assert not (tmp_path / 'd').exists()
  with pytest.raises(ValueError, match='not both'):
    runtime.WorkerProcess(listen_host='127.0.0.1', unix_path=str(tmp_path / 'w.sock')).start()


@pytest.mark.parametrize('listener, confined, expected, unexpected', [
    (dict(listen_host='127.0.0.1'), 'network namespace',
     ['Who can connect: only processes of', 'on this host', 'No other host can connect'], ['ANY local']),
    (dict(listen_host='10.0.0.5'), 'network namespace',
     ['any host that can reach 10.0.0.5:8000 only, and on this host only processes of'], ['ANY local']),
    (dict(listen_host=''), 'network namespace',
     ['any host that can reach all interfaces', 'on this host only processes of', 'Restrict it'], ['ANY local']),
    (dict(unix_path='/run/x/w.sock'), 'network namespace',
     ['the Unix socket /run/x/w.sock only', 'Who can connect: only processes of', 'No other host'], ['ANY local']),
    (dict(listen_host=''), None, ['ANY local process of any user', 'NOT confined'], ['only processes of']),
], ids=['loopback', 'address', 'all_interfaces', 'unix', 'unconfined'])
def test_exposure_message_says_who_can_connect(listener, confined, expected, unexpected):
  import types  # pylint: disable=g-import-not-at-top
  from tff_gma import worker as worker_command  # pylint: disable=g-import-not-at-top
  fake = types.SimpleNamespace(**{'pid': 1, 'port': 8000, 'confined': confined, 'unix_path': None,
                                  'listen_host': None, **listener})
  fake.target = (f'unix:{fake.unix_path}' if fake.unix_path else f'{fake.listen_host or "127.0.0.1"}:8000')
  message = worker_command.exposure_message(fake)
  for text in expected:
    assert text in message, message
  for text in unexpected:
    assert text not in message, message
  assert 'UNAUTHENTICATED' in message and message.endswith('Ctrl-C stops it.')


def test_the_clients_split_into_contiguous_shares_wherever_their_value_lies_in_the_argument():
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tff_gma.runtime import multi_worker  # pylint: disable=g-import-not-at-top
  clients = tff.FederatedType(np.float32, tff.CLIENTS)
  # The clients' value first: TFF's own split gives both workers the first three clients there.
  slices = multi_worker._split([[1.0, 2.0, 3.0, 4.0, 5.0], 7], tff.StructType([clients, np.int32]), 2)
  assert [(list(s[0]), s[1]) for s in slices] == [([1.0, 2.0, 3.0], 7), ([4.0, 5.0], 7)]
  assert len(multi_worker._split([1.0], clients, 2)) == 1  # No worker gets an empty share.
  joined = multi_worker._joined([tff.structure.Struct.unnamed([2.0, 4.0], 1), tff.structure.Struct.unnamed([6.0], 1)],
                                tff.StructType([clients, tff.FederatedType(np.int32, tff.SERVER)]))
  assert list(joined[0]) == [2.0, 4.0, 6.0] and joined[1] == 1
