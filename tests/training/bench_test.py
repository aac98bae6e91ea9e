"""The benchmark: its measuring tools against NumPy and /proc, its flags and candidates, `scripts/bench.sh`."""

import tests
import collections
import dataclasses
import json
import math
import os
import signal
import subprocess
import time

from absl import flags
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import models
from training import config as config_lib
from training.bench import candidates
from training.bench import multi_worker
from training.bench import cli as bench
from training.bench import presets
from training.bench import runner_runs
from training.bench import sections
from training.bench import small_rounds
from training.bench import timing
from training.engine import client_execution
from training.engine import registry
from training.engine import worker_datasets

_ROOT = tests.ROOT


# ----------------------------------------------------------------------------------------------------------------
# Timing helpers.


def test_interleaved_times_rotates_the_order_and_counts_repetitions():
  calls = []
  samples = timing.interleaved_times(
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

  samples = timing.interleaved_times(
      {'short': lambda: spin_cpu(0.02), 'long': lambda: spin_cpu(0.12), 'sleep': lambda: time.sleep(0.1)},
      repetitions=3)
  summary = {name: timing.summarize(s) for name, s in samples.items()}
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
    timing.interleaved_times({'a': lambda: None}, 0)
  with pytest.raises(ValueError, match='calls'):
    timing.interleaved_times({}, 1)


def test_ratios_and_median_match_numpy():
  medians = {'mean': 0.5, 'x': 0.55, 'y': 1.5}
  ratios = timing.ratios_to('mean', medians)
  np.testing.assert_allclose([ratios[k] for k in medians], np.array([0.5, 0.55, 1.5]) / 0.5)
  assert timing.median([3.0, 1.0, 2.0, 10.0]) == np.median([3.0, 1.0, 2.0, 10.0])
  with pytest.raises(ValueError, match='baseline'):
    timing.ratios_to('missing', medians)
  with pytest.raises(ValueError, match='baseline'):
    timing.ratios_to('zero', {'zero': 0.0, 'x': 1.0})


# ----------------------------------------------------------------------------------------------------------------
# /proc readings.


def test_process_cpu_seconds_counts_this_process_work():
  before = timing.process_cpu_seconds(os.getpid())
  end = time.process_time() + 0.3
  while time.process_time() < end:
    pass
  assert timing.process_cpu_seconds(os.getpid()) - before >= 0.2
  assert timing.process_cpu_seconds(2**22 + 12345) == 0.0  # No such process.


def test_peak_memory_sees_an_allocation_that_is_freed_again(simulation_context):
  size = 300 * 1024**2
  with timing.PeakMemory({'python': os.getpid(), 'worker': simulation_context.pid}) as memory:
    baseline = timing.resident_bytes(os.getpid())
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
    with timing.PeakMemory({'python': os.getpid()}) as later:
      pass
    assert later.result['peak_rss_bytes']['python'] < result['peak_rss_bytes']['python'] - 0.5 * size


# ----------------------------------------------------------------------------------------------------------------
# Probes: values generated inside the worker, checked against NumPy on the same values generated here.


def _client_values(value_type, seeds, make_value=None):
  make_value = make_value or (lambda s: timing.random_client_value(value_type, s))
  values = [tf.nest.map_structure(np.asarray, make_value(tf.constant(s, tf.int32))) for s in seeds]
  weights = np.array([float(s % 5 + 1) for s in seeds])
  return values, weights


def test_random_client_value_is_a_function_of_the_seed():
  vector = tff.TensorType(np.float32, [1000])
  a = timing.random_client_value(vector, tf.constant(3))
  b = timing.random_client_value(vector, tf.constant(3))
  c = timing.random_client_value(vector, tf.constant(4))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert abs(float(np.mean(a))) < 0.2 and 0.8 < float(np.std(a)) < 1.2
  structure = collections.OrderedDict(u=vector, s=tff.TensorType(np.float32, [2, 3]))
  value = timing.random_client_value(structure, tf.constant(3), nonnegative=True)
  assert list(value) == ['u', 's'] and value['s'].shape == (2, 3)
  assert np.all(np.asarray(value['s']) >= 0) and not np.allclose(value['u'][:6], np.ravel(value['s']))


@pytest.mark.parametrize('factory', [tff.aggregators.MeanFactory(), aggregators.FederatedMeanFactory()],
                         ids=['tff_mean', 'federated_mean'])
def test_aggregation_probe_returns_the_norm_of_the_weighted_mean(factory):
  vector = tff.TensorType(np.float32, [500])
  seeds = [0, 1, 2, 3, 7]
  probe = timing.aggregation_probe(factory, vector)
  norm, _ = probe(seeds)
  values, weights = _client_values(vector, seeds)
  expected = np.linalg.norm(np.average(np.stack(values).astype(np.float64), axis=0, weights=weights))
  np.testing.assert_allclose(norm, expected, rtol=1e-5)
  generation = timing.generation_probe(vector)(seeds)
  np.testing.assert_allclose(
      generation, sum(w * np.linalg.norm(v.astype(np.float64)) for v, w in zip(values, weights)), rtol=1e-5)


def test_aggregation_probe_of_a_structured_value_returns_the_measurements():
  vector = tff.TensorType(np.float32, [200])
  value_type = collections.OrderedDict(update=vector, sensitivity=vector)
  make_value = lambda s: collections.OrderedDict(
      update=timing.random_client_value(vector, s),
      sensitivity=timing.random_client_value(vector, s + 1, nonnegative=True))
  seeds = [5, 6, 7]
  norm, measurements = timing.aggregation_probe(
      aggregators.ElasticFactory(tau=0.5), value_type, make_value=make_value)(seeds)
  values, weights = _client_values(value_type, seeds, make_value)
  update = np.average(np.stack([v['update'] for v in values]).astype(np.float64), axis=0, weights=weights)
  omega = np.average(np.stack([v['sensitivity'] for v in values]).astype(np.float64), axis=0, weights=weights)
  zeta = 1.0 + 0.5 - omega / omega.max()  # Elastic aggregation's scale (paper, Algorithm 1).
  np.testing.assert_allclose(norm, np.linalg.norm(zeta * update), rtol=1e-5)
  np.testing.assert_allclose(measurements['zeta_min'], zeta.min(), rtol=1e-5)
  assert measurements['dropped_clients'] == 0


# ----------------------------------------------------------------------------------------------------------------
# The program: flags, candidates, targets.


def _settings(*argv):
  values = flags.FlagValues()
  bench.define_flags(values)
  values(['bench', *argv])
  return bench.settings_from_flags(values)


def test_flags_pick_a_preset_and_override_it():
  assert _settings() == presets.Settings()
  assert _settings('--quick').round_repetitions == presets.QUICK.round_repetitions
  smoke = _settings('--smoke', '--aggregation_sizes=10,20', '--seed=3')
  assert smoke.aggregation_sizes == (10, 20) and smoke.seed == 3 and smoke.model == presets.SMOKE.model
  assert _settings('--aggregators=gma,rfa+num_passes=5,gma').aggregators == ('mean', 'gma', 'rfa+num_passes=5')
  assert _settings('--profile=stock_fedavg,mean').sections == presets.SECTIONS


@pytest.mark.parametrize('argv, flag', [
    (('--sections=rounds,nope',), '--sections'),
    (('--aggregators=nope',), '--aggregators'),
    (('--aggregators=gma+nope=1',), '--aggregators'),
    (('--aggregators=rfa+num_passes=x',), '--aggregators'),
    (('--aggregators=median+secure',), '--aggregators'),  # Non-private: the registry refuses secure=True.
    (('--aggregators=gma+tau=2',), '--aggregators'),  # The factory checks its settings.
    (('--scaling_aggregators=nope',), '--scaling_aggregators'),
    (('--round_repetitions=0',), '--round_repetitions'),
    (('--peers_repetitions=0',), '--peers_repetitions'),
    (('--aggregation_sizes=0',), '--aggregation_sizes'),
    (('--aggregation_clients=a',), '--aggregation_clients'),
    (('--scaling_clients=2000',), '--scaling_clients'),
    (('--profile=rfa', '--aggregators=gma'), '--profile'),
    (('--quick', '--smoke'), '--quick'),
])
def test_invalid_flags_are_refused_naming_the_flag(argv, flag):
  with pytest.raises(ValueError, match=flag):
    _settings(*argv)


def test_every_registered_aggregator_is_a_default_candidate_built_by_the_registries():
  # No table of its own: the defaults start with every aggregator the methods know, and each builds.
  assert presets.AGGREGATORS[:len(registry.AGGREGATORS)] == tuple(registry.AGGREGATORS)
  for entry in presets.AGGREGATORS + presets.Settings().scaling_aggregators:
    candidate = candidates.parse_candidate(entry)
    assert (candidate.algorithm, candidate.aggregator) == registry.resolve(entry.split('+')[0])
    kind, factory = candidates.probe_factory(candidate, presets.PROBE_VALUE_BOUND)
    assert kind == ('update_and_sensitivity' if candidate.aggregator == 'elastic' else 'vector')
    assert isinstance(factory, tff.aggregators.WeightedAggregationFactory)
  assert isinstance(candidates.probe_factory(candidates.parse_candidate('rfa'), 1.0)[1], type(registry.build('rfa')))


def test_entries_carry_aggregator_and_method_settings():
  secure = candidates.parse_candidate('gma_binary+secure+tau=0.3')
  assert (secure.algorithm, secure.aggregator) == ('fedavg', 'gma_binary')
  assert secure.aggregator_params == config_lib.AggregatorParams(tau=0.3, secure=True)
  assert secure.params(2.0).secure_bound == 2.0  # The section's bound where the entry sets none...
  assert candidates.parse_candidate('gma+secure+secure_bound=0.5').params(2.0).secure_bound == 0.5  # ...else its own.
  assert candidates.parse_candidate('rfa').params(2.0).secure_bound is None
  elastic = candidates.parse_candidate('elastic+elastic_tau=0.7')
  assert elastic.method_params == config_lib.MethodParams(elastic_tau=0.7)
  assert candidates.parse_candidate('fedavg/rfa+rfa_init=zero').aggregator_params.rfa_init == 'zero'
  assert candidates.probe_factory(candidates.parse_candidate('scaffold'), 1.0) is None  # Composed: rounds only.


def test_targets_are_checked_against_issue_limits():
  targets = bench.check_targets({
      'round_time_ratio': {'mean': 1.0, 'gma': 1.05, 'gma_binary+secure': 1.2, 'rfa': 1.6, 'rfa+num_passes=5': 3.0,
                           'rfa_one_step': 1.1, 'elastic': 1.29, 'fedgma': 2.0},
      'pipeline_throughput_ratio': 0.96,
      'scaling': [{'aggregator': 'mean', 'clients_per_round': 500, 'peak_total_gib': 30.0}],
  })
  met = {t['target'].split(' ')[0]: t['met'] for t in targets}
  assert met == {'gma': True, 'gma_binary+secure': False, 'rfa': False, 'elastic': True, 'project': True,
                 '500': False}


# ----------------------------------------------------------------------------------------------------------------
# The program end to end, through its launcher.


def _run_bench(tmp_path, *argv, timeout):
  """`bash scripts/bench.sh ARGV` in a session of its own (killed whole on timeout, worker included)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', TFF_GMA_WORKER_LOG='none')
  with open(tmp_path / 'stdout', 'w') as out, open(tmp_path / 'stderr', 'w') as err:
    process = subprocess.Popen(['bash', os.path.join(_ROOT, 'scripts', 'bench.sh'), *argv], cwd=str(tmp_path),
                               env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
      raise


@pytest.mark.slow
def test_invalid_flags_end_in_a_usage_message_and_write_nothing(tmp_path):
  output = tmp_path / 'out' / 'bench.json'
  code = _run_bench(tmp_path, '--smoke', '--aggregators=gma,nope', f'--output={output}', timeout=180)
  stderr = (tmp_path / 'stderr').read_text()
  assert code != 0
  assert "--aggregators: 'nope': unknown method" in stderr and 'Traceback' not in stderr
  assert not (tmp_path / 'out').exists()


@pytest.fixture(scope='module')
def smoke_run(tmp_path_factory):
  """`scripts/bench.sh --smoke`, run once: (its JSON, its directory). Every section at the smoke settings, which
  the section tests below read rather than run each section again."""
  tmp_path = tmp_path_factory.mktemp('smoke')
  code = _run_bench(tmp_path, '--smoke', '--output', str(tmp_path / 'bench.json'), timeout=300)
  assert code == 0, (tmp_path / 'stderr').read_text()[-3000:]
  return json.loads((tmp_path / 'bench.json').read_text()), tmp_path


@pytest.mark.slow
def test_smoke_run_writes_json_and_markdown(smoke_run):
  result, tmp_path = smoke_run
  assert list(result) == ['environment', 'round_time_ratio', 'aggregation_time_ratio', 'scaling', 'details',
                          'round_cpu_ratio', 'pipeline_throughput_ratio', 'iterator_loop_speedup',
                          'compile_seconds', 'client_execution_time_ratio', 'round_to_floor',
                          'loop_before_speedup', 'round_parts', 'peer_ratios', 'runner_ratios',
                          'multi_worker_efficiency', 'targets']
  assert result['environment']['mode'] == 'smoke' and 'training.bench' in result['environment']['command']

  def positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

  assert set(result['round_time_ratio']) == {'mean', 'gma'}
  assert result['round_time_ratio']['mean'] == 1.0
  assert all(positive_finite(r) for r in result['round_time_ratio'].values())
  assert all(positive_finite(r) for r in result['round_cpu_ratio'].values())
  assert positive_finite(result['pipeline_throughput_ratio']) and positive_finite(result['iterator_loop_speedup'])
  assert set(result['details']['rounds']['timings']) == {'mean', 'gma', *presets.PIPELINE}
  assert list(result['aggregation_time_ratio']) == ['1000x3']
  assert all(positive_finite(r) for r in result['aggregation_time_ratio']['1000x3'].values())
  assert set(result['details']['aggregation']['timings']['1000x3']) == {'mean', 'gma', 'generation_vector'}
  assert set(result['compile_seconds']) == {'rounds', 'aggregation', 'scaling'}
  assert all(positive_finite(s) for s in result['compile_seconds']['rounds'].values())
  assert [row['clients_per_round'] for row in result['scaling']] == [2, 4]
  for row in result['scaling']:
    assert positive_finite(row['seconds']) and positive_finite(row['peak_total_gib'])
    assert row['peak_rss_gib']['worker'] > 0 and row['peak_rss_gib']['python'] > 0
  assert [t['target'].split(' ')[0] for t in result['targets']] == [
      'gma', 'project', 'project', 'project', 'process', 'saving', 'label500-shaped', 'two']  # Runner's, workers'.
  assert '| study run / floor |' in (tmp_path / 'bench.md').read_text()
  assert all(math.isfinite(r) for r in result['round_to_floor']['logistic'].values())
  markdown = (tmp_path / 'bench.md').read_text()
  assert '| gma |' in markdown and '## Scaling' in markdown and '## Targets' in markdown
  assert '### logistic 2x20, batch 16' in markdown and '| logistic 2x20, batch 16 |' in markdown
  assert '### logistic 4x20, batch 16' in markdown and '| workers_2 |' in markdown


@pytest.mark.slow  # A whole benchmark section: both client-execution modes trained and timed.
def test_client_execution_section_times_both_modes_and_says_where_they_trained(simulation_context):
  settings = dataclasses.replace(presets.SMOKE, sections=('client_execution',),
                                 client_execution_models=('logistic', 'resnet18_gn'))
  section = sections.bench_client_execution(settings, [simulation_context.pid])
  assert list(section['client_execution_time_ratio']) == ['logistic', 'resnet18_gn']
  assert all(math.isfinite(r) and r > 0 for r in section['client_execution_time_ratio'].values())
  resnet = section['models']['resnet18_gn']
  assert resnet['setup']['data'].startswith('generated CIFAR-10-shaped [32, 32, 3]')
  assert resnet['setup']['clients'] == 2 and resnet['setup']['examples'] == 8
  assert resnet['setup']['parameters'] > 10_000_000  # ResNet-18.
  for row in section['models'].values():
    assert set(row['timings']) == {'worker', 'local'}
    assert row['client_devices']['worker'] == list(client_execution.WORKER_DEVICES)
    assert row['client_devices']['local'] and all('CPU' in d for d in row['client_devices']['local'])
  assert section['gpus_visible'] == [] and 'no GPU' in section['device_line']
  markdown = bench.to_markdown({'environment': dict(mode='smoke', date='d', command='c', cpus=2, load_before=[],
                                                    load_after=[], tff='0.87.0'),
                                'details': {'client_execution': section}, 'targets': [],
                                'client_execution_time_ratio': section['client_execution_time_ratio']})
  assert '| resnet18_gn (' in markdown and 'no GPU' in markdown


def test_client_execution_flags():
  settings = _settings('--smoke', '--client_execution_models=cnn', '--client_execution_examples=7')
  assert settings.client_execution_models == ('cnn',) and settings.client_execution_examples == 7
  for argv, flag in ((('--client_execution_examples=0',), 'client_execution_examples'),
                     (('--client_execution_models=char_lstm',), 'client_execution_models')):
    with pytest.raises(ValueError, match=flag):
      _settings(*argv)


@pytest.mark.parametrize('model', ['logistic', 'cnn'])
def test_the_floor_computes_the_round_tffs_fedavg_computes(simulation_context, model):
  # The floor is the same arithmetic: from the same model and batches (unshuffled), the mean of the clients'
  # SGD-with-momentum epochs equals TFF's stock FedAvg round (server SGD at 1) to float32 rounding.
  del simulation_context
  from training.bench import floor as floor_lib  # pylint: disable=g-import-not-at-top
  shape = presets.FLOOR_SHAPES[model]
  rng = np.random.default_rng(1)
  arrays = [(rng.random((n, *shape), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)) for n in (7, 12)]
  spec = collections.OrderedDict(x=tf.TensorSpec([None, *shape], tf.float32), y=tf.TensorSpec([None], tf.int32))
  build_keras = models.keras_builder(model, shape, 10)
  model_fn = models.model_fn(build_keras, spec)
  config = presets.ALGORITHM_CONFIG
  process = sections._stock_process('stock_fedavg_iterator', model_fn)  # pylint: disable=protected-access
  tf.keras.utils.set_random_seed(0)
  start = [v.numpy() for v in build_keras().trainable_weights]
  state = process.set_model_weights(process.initialize(), tff.learning.models.ModelWeights(start, []))
  datasets = [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(4) for x, y in arrays]
  expected = process.next(state, datasets).state
  ours = floor_lib.build_floor(build_keras, spec, arrays, batch_size=4, client_lr=config.client_lr,
                               momentum=config.client_momentum, initial_weights=start)()
  for a, b in zip(ours, process.get_model_weights(expected).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert any(not np.allclose(a, s) for a, s in zip(ours, start))
  # The same graph run by the worker: the same round (this process optimizes the graph with Grappler, the worker
  # does not, so the rounding may differ).
  in_worker = floor_lib.build_floor_in_worker(build_keras, spec, arrays, batch_size=4, client_lr=config.client_lr,
                                              momentum=config.client_momentum, initial_weights=start)()
  for a, b in zip(in_worker, ours):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # A whole benchmark section, timed.
def test_floor_section_times_every_entry_as_a_ratio_to_the_floor(smoke_run):
  section = smoke_run[0]['details']['floor']
  assert set(section['round_to_floor']['logistic']) == {*sections.FLOOR_ENTRIES[1:], 'project_beyond_one_batch'}
  assert all(math.isfinite(r) for r in section['round_to_floor']['logistic'].values())
  detail = section['models']['logistic']
  assert detail['setup']['clients'] == 2 and detail['setup']['examples_per_client'] == 20
  assert set(detail['timings']) == set(sections.FLOOR_ENTRIES)
  markdown = bench.to_markdown({'environment': dict(mode='smoke', date='d', command='c', cpus=2, load_before=[],
                                                    load_after=[], tff='0.87.0'),
                                'details': {'floor': section}, 'round_to_floor': section['round_to_floor'],
                                'targets': []})
  assert '| logistic | 2 x 20, 16 |' in markdown


# ----------------------------------------------------------------------------------------------------------------
# Small rounds (issue 37): the breakdown and the plain TF peer.


@pytest.mark.parametrize('model', ['cnn', 'lenet'])
def test_the_plain_tf_peer_computes_the_projects_round(simulation_context, model):
  # The peer is the project's round as plain TF: from the same model, on the same examples in the same shuffled
  # order (37 a client: a short last batch), two rounds of the runner's default round (datasets built in the worker,
  # the in-graph loop) and of the peer agree to float32 rounding, the floor test's tolerance: the weights move by
  # about 1e-2 a round, the two differ by about 1e-8 (other kernels, Grappler here and none in the worker). The same
  # peer on the next round's order differs by orders of magnitude more.
  del simulation_context
  setup = small_rounds.build_generated_round(model, 3, 37, batch_size=16, seed=0)
  try:
    peer = small_rounds.build_plain_tf_round(setup, 16)
    start = setup.initial_weights()
    project = {}
    for round_num in (1, 2):
      setup.loop.step()
      ours = [w.numpy() for w in peer.step()]
      project[round_num] = setup.method.process.get_model_weights(setup.loop.state).trainable
      for a, b in zip(ours, project[round_num]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
      assert peer.round_num == setup.loop.round_num == round_num
    assert max(np.max(np.abs(a - s)) for a, s in zip(project[1], start)) > 1e-3  # Trained.
    other_order = [w.numpy() for w in peer.round(start, 2)]  # From the initial model on round 2's order.
    assert max(np.max(np.abs(a - b)) for a, b in zip(other_order, project[1])) > 1e-4
  finally:
    setup.close()


def _small_markdown(section_name, section):
  return bench.to_markdown({'environment': dict(mode='smoke', date='d', command='c', cpus=2, load_before=[],
                                                load_after=[], tff='0.87.0'),
                            'details': {section_name: section}, 'targets': []})


@pytest.mark.slow  # A whole benchmark section, timed.
def test_breakdown_section_times_every_probe_and_derives_the_parts(simulation_context):
  section = small_rounds.bench_breakdown(presets.SMOKE, [simulation_context.pid])
  assert list(section['round_parts']) == ['logistic 2x20']
  case = section['cases']['logistic 2x20']
  probes = {'round_step', 'next', 'state_in_out', 'get_model_weights', 'dispatch', 'client_data', 'client_work',
            'client_work_and_aggregation', 'client_inputs_python', 'checkpoint_save', 'csv_release'}
  if hasattr(worker_datasets.ClientSources, 'batches'):
    probes.add('client_data_batches')
  assert set(case['timings']) == set(case['compile_seconds']) == probes
  assert all(t['seconds'] > 0 and t['repetitions'] == 1 for t in case['timings'].values())
  for part, whole, inner in small_rounds.PARTS:
    assert case['parts'][part] == case['timings'][whole]['seconds'] - case['timings'][inner]['seconds']
  assert case['setup']['clients'] == 2 and case['setup']['examples_per_client'] == 20
  markdown = _small_markdown('breakdown', section)
  assert '### logistic 2x20, batch 16' in markdown and '| part: aggregation (' in markdown


@pytest.mark.slow  # A whole benchmark section, timed.
def test_peers_section_times_the_three_rounds_as_ratios(simulation_context):
  section = small_rounds.bench_peers(presets.SMOKE, [simulation_context.pid])
  ratios = section['peer_ratios']['logistic 2x20']
  assert set(ratios) == {'project_to_plain_tf', 'project_to_floor', 'plain_tf_to_floor', 'project_to_plain_tf_cpu',
                         'project_to_floor_cpu'}
  assert all(math.isfinite(r) and r > 0 for name, r in ratios.items() if not name.endswith('_cpu'))
  assert set(section['cases']['logistic 2x20']['timings']) == set(small_rounds.PEER_ENTRIES)
  assert '| logistic 2x20, batch 16 |' in _small_markdown('peers', section)


def test_issue_37_targets_are_checked_for_their_cases():
  def case(model, examples, to_plain_tf, to_floor):
    return {'setup': dict(model=model, clients=10, examples_per_client=examples),
            'ratios': dict(project_to_plain_tf=to_plain_tf, project_to_floor=to_floor, project_to_plain_tf_cpu=1.0,
                           project_to_floor_cpu=1.0)}

  cases = {'lenet 10x120': case('lenet', 120, 1.1, 3.0), 'lenet 10x600': case('lenet', 600, 1.06, 1.0),
           'cnn 10x144': case('cnn', 144, 9.0, 1.4), 'logistic 10x20': case('logistic', 20, 9.0, 9.0)}
  targets = bench.check_targets({'details': {'peers': {'cases': cases}}})
  assert [(t['target'], t['met']) for t in targets] == [
      ('project round (lenet 10x120) <= 1.15x plain TF', True),
      ('project round (lenet 10x600) <= 1.05x plain TF', False),
      ('project round (cnn 10x144) <= 1.50x its in-graph floor', True)]


@pytest.mark.slow
def test_runner_section_measures_the_runner_end_to_end(smoke_run):
  section = smoke_run[0]['details']['runner']  # The digits' runner runs (two subprocesses).
  ratios = section['runner_ratios']
  assert set(ratios) == {'start_up_seconds', 'saving_share', 'saving_waited_share', 'study_to_floor',
                         'study_training_to_floor'}
  assert all(math.isfinite(r) and r >= 0 for r in ratios.values()) and ratios['start_up_seconds'] > 1
  targets = runner_runs.check_targets({'runner_ratios': ratios})
  assert [t['target'] for t in targets] == [
      'process start to first round <= 8 s (defaults run)', 'saving <= 10% of training (defaults run; own time)',
      'label500-shaped study run <= 1.3x its training floor']
  assert [t['met'] for t in targets] == [ratios['start_up_seconds'] <= 8, ratios['saving_share'] <= 0.1,
                                         ratios['study_to_floor'] <= 1.3]
  assert '| study run / floor |' in '\n'.join(runner_runs.markdown({'details': {'runner': section}}))


# ----------------------------------------------------------------------------------------------------------------
# Several workers per round.


@pytest.mark.slow  # Two pinned workers, a round timed on one and on both.
def test_multi_worker_section_times_each_worker_count_and_its_stages(smoke_run):
  section = smoke_run[0]['details']['multi_worker']
  assert list(section['multi_worker_efficiency']) == ['logistic 4x20']
  case = section['cases']['logistic 4x20']
  assert list(case['efficiency']) == ['workers_1', 'workers_2']
  assert all(math.isfinite(e) and e > 0 for e in case['efficiency'].values())
  assert list(case['breakdown']) == [multi_worker.ONE_WORKER, 'workers_1', 'workers_2']
  assert 'stage_seconds' not in case['breakdown'][multi_worker.ONE_WORKER]  # TFF's own context: no stages.
  for entry in ('workers_1', 'workers_2'):
    stages = case['breakdown'][entry]['stage_seconds']
    assert list(stages) == list(multi_worker.STAGES)
    assert stages['invoke'] >= stages['up_to_merge'] > 0
  assert len(case['breakdown']['workers_2']['each_worker_cpu_seconds']) == 2
  assert case['setup']['pinning']['workers_2'] == [case['setup']['cores'][i % len(case['setup']['cores'])]
                                                   for i in range(2)]
  assert all(d <= 1e-5 for d in case['max_abs_difference_to_one_worker'].values())  # As multi_worker_runs_test.
  markdown = '\n'.join(multi_worker.markdown({'details': {'multi_worker': section}}))
  assert '### logistic 4x20, batch 16' in markdown and '| workers_2 |' in markdown


def test_multi_worker_target_is_two_workers_efficiency_per_case():
  result = {'multi_worker_efficiency': {'lenet 10x600': {'workers_1': 0.9, 'workers_2': 0.86, 'workers_4': 0.8},
                                        'lenet 100x30': {'workers_2': 0.5}}}
  targets = multi_worker.check_targets(result)
  assert [(t['value'], t['met']) for t in targets] == [(0.86, True), (0.5, False)]
  assert all('two workers' in t['target'] for t in targets)


def test_pinned_workers_start_on_their_cores():
  cpus = sorted(os.sched_getaffinity(0))
  workers = multi_worker.start_pinned_workers(2, cpus)
  try:
    assert [os.sched_getaffinity(w.pid) for w in workers] == [{cpus[0]}, {cpus[1 % len(cpus)]}]
    assert os.sched_getaffinity(0) == set(cpus)  # This process's own cores restored.
  finally:
    for w in workers:
      w.stop()
