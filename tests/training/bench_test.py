"""The benchmark: its measuring tools against NumPy and /proc, and `scripts/bench.py --smoke` end to end."""

import tests
import collections
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import benchmarks

_ROOT = tests.ROOT


def _load_bench_script():
  spec = importlib.util.spec_from_file_location('bench_script', os.path.join(_ROOT, 'scripts', 'bench.py'))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Its dataclasses look their module up while being defined.
  spec.loader.exec_module(module)
  return module


# ----------------------------------------------------------------------------------------------------------------
# Timing helpers.


def test_interleaved_times_rotates_the_order_and_counts_repetitions():
  calls = []
  samples = benchmarks.interleaved_times(
      {name: (lambda name=name: calls.append(name)) for name in 'abc'}, repetitions=4)
  assert calls == list('abc' 'bca' 'cab' 'abc')
  assert {name: len(s) for name, s in samples.items()} == {'a': 4, 'b': 4, 'c': 4}
  assert all(s.wall >= 0 for ss in samples.values() for s in ss)


def test_interleaved_times_measures_wall_and_cpu():
  def spin_cpu(seconds):
    # Busy-wait for `seconds` of this thread's CPU time (not wall time, not the process's, which other TF/gRPC
    # threads add to): then wall >= thread CPU >= seconds, and process CPU >= seconds, however loaded the machine.
    end = time.thread_time() + seconds
    while time.thread_time() < end:
      pass

  samples = benchmarks.interleaved_times(
      {'short': lambda: spin_cpu(0.02), 'long': lambda: spin_cpu(0.12), 'sleep': lambda: time.sleep(0.1)},
      repetitions=3)
  summary = {name: benchmarks.summarize(s) for name, s in samples.items()}
  # Wall time is at least this thread's CPU time; CPU time orders the two spins whatever the load.
  assert summary['short']['seconds'] >= 0.02 and summary['long']['seconds'] >= 0.12
  assert 0.015 <= summary['short']['python_cpu_seconds'] < summary['long']['python_cpu_seconds']
  assert summary['long']['python_cpu_seconds'] >= 0.1
  # Sleeping costs wall time but less CPU time than spinning (not zero: in a long test session other threads of
  # this process, TF's and gRPC's, use some CPU meanwhile, and process CPU time counts every thread).
  assert summary['sleep']['python_cpu_seconds'] < summary['long']['python_cpu_seconds'] - 0.05
  assert summary['sleep']['seconds'] >= 0.1
  assert summary['long']['repetitions'] == 3


def test_interleaved_times_rejects_bad_arguments():
  with pytest.raises(ValueError, match='repetitions'):
    benchmarks.interleaved_times({'a': lambda: None}, 0)
  with pytest.raises(ValueError, match='calls'):
    benchmarks.interleaved_times({}, 1)


def test_ratios_and_median_match_numpy():
  medians = {'mean': 0.5, 'x': 0.55, 'y': 1.5}
  ratios = benchmarks.ratios_to('mean', medians)
  np.testing.assert_allclose([ratios[k] for k in medians], np.array([0.5, 0.55, 1.5]) / 0.5)
  assert benchmarks.median([3.0, 1.0, 2.0, 10.0]) == np.median([3.0, 1.0, 2.0, 10.0])
  with pytest.raises(ValueError, match='baseline'):
    benchmarks.ratios_to('missing', medians)
  with pytest.raises(ValueError, match='baseline'):
    benchmarks.ratios_to('zero', {'zero': 0.0, 'x': 1.0})


# ----------------------------------------------------------------------------------------------------------------
# /proc readings.


def test_process_cpu_seconds_counts_this_process_work():
  before = benchmarks.process_cpu_seconds(os.getpid())
  end = time.process_time() + 0.3
  while time.process_time() < end:
    pass
  assert benchmarks.process_cpu_seconds(os.getpid()) - before >= 0.2
  assert benchmarks.process_cpu_seconds(2**22 + 12345) == 0.0  # No such process.


def test_peak_memory_sees_an_allocation_that_is_freed_again(simulation_context):
  size = 300 * 1024**2
  with benchmarks.PeakMemory({'python': os.getpid(), 'worker': simulation_context.pid}) as memory:
    baseline = benchmarks.resident_bytes(os.getpid())
    block = np.ones(size, dtype=np.uint8)  # Touched, so resident.
    time.sleep(0.1)
    del block
  result = memory.result
  assert result['peak_rss_bytes']['python'] >= baseline + 0.9 * size
  assert result['peak_rss_bytes']['worker'] > 0
  assert result['peak_total_bytes'] >= result['peak_rss_bytes']['python'] + result['peak_rss_bytes']['worker']
  assert result['sampled_peak_total_bytes'] >= baseline + 0.9 * size
  # The high-water mark was reset on entry (own processes), so a later block does not inherit this peak.
  if not result['peak_rss_since_start']['python']:
    with benchmarks.PeakMemory({'python': os.getpid()}) as later:
      pass
    assert later.result['peak_rss_bytes']['python'] < result['peak_rss_bytes']['python'] - 0.5 * size


# ----------------------------------------------------------------------------------------------------------------
# Probes: values generated inside the worker, checked against NumPy on the same values generated here.


def _client_values(value_type, seeds, make_value=None):
  make_value = make_value or (lambda s: benchmarks.random_client_value(value_type, s))
  values = [tf.nest.map_structure(np.asarray, make_value(tf.constant(s, tf.int32))) for s in seeds]
  weights = np.array([float(s % 5 + 1) for s in seeds])
  return values, weights


def test_random_client_value_is_a_function_of_the_seed():
  vector = tff.TensorType(np.float32, [1000])
  a = benchmarks.random_client_value(vector, tf.constant(3))
  b = benchmarks.random_client_value(vector, tf.constant(3))
  c = benchmarks.random_client_value(vector, tf.constant(4))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert abs(float(np.mean(a))) < 0.2 and 0.8 < float(np.std(a)) < 1.2
  structure = collections.OrderedDict(u=vector, s=tff.TensorType(np.float32, [2, 3]))
  value = benchmarks.random_client_value(structure, tf.constant(3), nonnegative=True)
  assert list(value) == ['u', 's'] and value['s'].shape == (2, 3)
  assert np.all(np.asarray(value['s']) >= 0) and not np.allclose(value['u'][:6], np.ravel(value['s']))


@pytest.mark.parametrize('factory', [tff.aggregators.MeanFactory(), aggregators.FederatedMeanFactory()],
                         ids=['tff_mean', 'federated_mean'])
def test_aggregation_probe_returns_the_norm_of_the_weighted_mean(factory):
  vector = tff.TensorType(np.float32, [500])
  seeds = [0, 1, 2, 3, 7]
  probe = benchmarks.aggregation_probe(factory, vector)
  norm, _ = probe(seeds)
  values, weights = _client_values(vector, seeds)
  expected = np.linalg.norm(np.average(np.stack(values).astype(np.float64), axis=0, weights=weights))
  np.testing.assert_allclose(norm, expected, rtol=1e-5)
  generation = benchmarks.generation_probe(vector)(seeds)
  np.testing.assert_allclose(
      generation, sum(w * np.linalg.norm(v.astype(np.float64)) for v, w in zip(values, weights)), rtol=1e-5)


def test_aggregation_probe_of_a_structured_value_returns_the_measurements():
  vector = tff.TensorType(np.float32, [200])
  value_type = collections.OrderedDict(update=vector, sensitivity=vector)
  make_value = lambda s: collections.OrderedDict(
      update=benchmarks.random_client_value(vector, s),
      sensitivity=benchmarks.random_client_value(vector, s + 1, nonnegative=True))
  seeds = [5, 6, 7]
  norm, measurements = benchmarks.aggregation_probe(
      aggregators.ElasticFactory(tau=0.5), value_type, make_value=make_value)(seeds)
  values, weights = _client_values(value_type, seeds, make_value)
  update = np.average(np.stack([v['update'] for v in values]).astype(np.float64), axis=0, weights=weights)
  omega = np.average(np.stack([v['sensitivity'] for v in values]).astype(np.float64), axis=0, weights=weights)
  zeta = 1.0 + 0.5 - omega / omega.max()  # Elastic aggregation's scale (paper, Algorithm 1).
  np.testing.assert_allclose(norm, np.linalg.norm(zeta * update), rtol=1e-5)
  np.testing.assert_allclose(measurements['zeta_min'], zeta.min(), rtol=1e-5)
  assert measurements['dropped_clients'] == 0


# ----------------------------------------------------------------------------------------------------------------
# The script.


def test_settings_reject_invalid_flags_naming_them():
  bench = _load_bench_script()
  parse = lambda *argv: bench.settings_from_args(bench._parser().parse_args(list(argv)))
  assert parse('--quick').round_repetitions == bench.QUICK.round_repetitions
  assert parse('--aggregators', 'gma_soft').aggregators == ('mean', 'gma_soft')
  for argv, name in [(('--sections', 'rounds,nope'), '--sections'), (('--aggregators', 'median'), '--aggregators'),
                     (('--round-repetitions', '0'), '--round-repetitions'),
                     (('--aggregation-sizes', '0'), '--aggregation-sizes'),
                     (('--scaling-clients', '2000'), '--scaling-clients'), (('--quick', '--smoke'), '--quick')]:
    with pytest.raises(ValueError, match=name):
      parse(*argv)


def test_targets_are_checked_against_issue_limits():
  bench = _load_bench_script()
  targets = bench.check_targets({
      'round_time_ratio': {'mean': 1.0, 'gma_soft': 1.05, 'gma_binary_secure': 1.2, 'rfa_3': 1.6, 'rfa_5': 3.0,
                           'rfa_one_step': 1.1, 'elastic': 1.29},
      'pipeline_throughput_ratio': 0.96,
      'scaling': [{'aggregator': 'mean', 'clients_per_round': 500, 'peak_total_gib': 30.0}],
  })
  met = {t['target'].split(' ')[0]: t['met'] for t in targets}
  assert met == {'gma_soft': True, 'gma_binary_secure': False, 'rfa_3': False, 'elastic': True, 'project': True,
                 '500': False}


def test_smoke_run_writes_json_and_markdown(tmp_path):
  output = tmp_path / 'bench.json'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', TFF_GMA_WORKER_LOG='none')
  with open(tmp_path / 'stdout', 'w') as out, open(tmp_path / 'stderr', 'w') as err:
    process = subprocess.Popen(
        [sys.executable, os.path.join(_ROOT, 'scripts', 'bench.py'), '--smoke', '--output', str(output)],
        cwd=str(tmp_path), env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      code = process.wait(timeout=240)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      raise
  assert code == 0, (tmp_path / 'stderr').read_text()[-3000:]
  result = json.loads(output.read_text())
  for key in ('round_time_ratio', 'round_cpu_ratio', 'aggregation_time_ratio', 'scaling', 'compile_seconds',
              'targets', 'pipeline_throughput_ratio', 'iterator_loop_speedup'):
    assert key in result

  def positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

  assert set(result['round_time_ratio']) == {'mean', 'gma_soft'}
  assert result['round_time_ratio']['mean'] == 1.0
  assert all(positive_finite(r) for r in result['round_time_ratio'].values())
  assert all(positive_finite(r) for r in result['round_cpu_ratio'].values())
  assert positive_finite(result['pipeline_throughput_ratio']) and positive_finite(result['iterator_loop_speedup'])
  assert list(result['aggregation_time_ratio']) == ['1000x3']
  assert all(positive_finite(r) for r in result['aggregation_time_ratio']['1000x3'].values())
  assert set(result['compile_seconds']) == {'rounds', 'aggregation', 'scaling'}
  assert all(positive_finite(s) for s in result['compile_seconds']['rounds'].values())
  assert [row['clients_per_round'] for row in result['scaling']] == [2, 4]
  for row in result['scaling']:
    assert positive_finite(row['seconds']) and positive_finite(row['peak_total_gib'])
    assert row['peak_rss_gib']['worker'] > 0 and row['peak_rss_gib']['python'] > 0
  markdown = (tmp_path / 'bench.md').read_text()
  assert '| gma_soft |' in markdown and '## Scaling' in markdown and '## Targets' in markdown
