"""Clients split over two TFF workers (TFF's mergeable-computation runtime) give the one-worker result."""

import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

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
  if runtime.confinement_status().startswith('unavailable'):
    pytest.skip(runtime.confinement_status())
  from tests.tff_gma import netutil  # pylint: disable=g-import-not-at-top
  assert all(t.startswith('unix:') for t in two_workers)
  for worker in list(runtime._live_workers):  # pylint: disable=protected-access
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
