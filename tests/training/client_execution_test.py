"""Client training in this process (`--client_execution=local`) against the TFF worker's (`worker`).

Tolerance of the equivalence tests: the two modes run the same TensorFlow graph of TFF's client update, but in two
TensorFlow builds (the worker's statically linked one, this process's), whose CPU kernels may reduce float32 sums
in another order: one client's update after a round differs by about 1e-7 relative. A convex model keeps this at
that level through the rounds (measured: <= 1.5e-6 absolute on the weights after 3 rounds, FedAdam included); the
ReLU CNN amplifies it through training (about 1e-3 after 3 rounds), so it is compared after one round, where it is
still rounding (about 1e-5).
"""

import collections
import dataclasses
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tests
from tests import tiers
from tests.training import interrupt
from tff_gma import models
from tff_gma.data import digits
from training import config as config_lib
from training.engine import client_execution
from training.engine import methods
from training.engine import registry
from training.runner import round_loop

_ATOL, _RTOL = 2e-5, 1e-5  # Weights of the logistic model after 3 rounds (see the module docstring).
_CNN_ATOL = 2e-4  # The CNN's weights after 1 round.
_SEED = 3


@pytest.fixture(scope='module')
def digits_setup():
  data = digits.federated_data('label_skew', 4, _SEED)
  return data


def _model(data, name):
  build_keras = models.keras_builder(name, data.input_shape, data.num_classes)
  return build_keras, models.model_fn(build_keras, data.input_spec)


def _datasets(data, round_num):
  return [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=32, seed=_SEED, round_num=round_num)
          for c in data.train.client_ids]


def _train(method, build_keras, data, rounds):
  state = round_loop.seeded_initial_state(method.process, build_keras, _SEED)
  all_metrics = []
  for round_num in range(1, rounds + 1):
    state, metrics = method.run_round(state, data.train.client_ids, _datasets(data, round_num), round_num)
    all_metrics.append(metrics)
  return state, all_metrics


def _flat(weights):
  return [np.asarray(t) for t in list(weights.trainable) + list(weights.non_trainable)]


def _flat_weights(process, state):
  return _flat(process.get_model_weights(state))


# The fast tier runs the first case (the one with most parts of its own); the full suite all six (tests/tiers.py).
@pytest.mark.parametrize('algorithm, aggregator, config', tiers.first_only([
    ('fedadam', 'gma', {'server_lr': 0.01}),  # GMA's Algorithm 2: its own aggregator and finalizer pair.
    ('fedavg', 'mean', {}),
    ('fedavg', 'rfa', {}),  # 3 Weiszfeld passes (the default).
    ('fedavg', 'gma', {}),
    ('fedprox', 'mean', {'proximal_strength': 0.1}),
    ('fedadam', 'mean', {'server_lr': 0.01}),
]))
def test_local_rounds_give_the_worker_rounds_model_and_metrics(digits_setup, algorithm, aggregator, config):
  data = digits_setup
  build_keras, model_fn = _model(data, 'logistic')
  algorithm_config = config_lib.AlgorithmConfig(**config)
  params = config_lib.AggregatorParams()
  assert params.num_passes == 3
  built = {mode: methods.build(model_fn, algorithm, aggregator, algorithm_config=algorithm_config,
                               aggregator_params=params, client_execution=mode)
           for mode in client_execution.MODES}
  assert built['worker'].client_execution == 'worker' and built['local'].client_execution == 'local'
  results = {mode: _train(method, build_keras, data, rounds=3) for mode, method in built.items()}
  (worker_state, worker_metrics), (local_state, local_metrics) = results['worker'], results['local']

  # The same state type (checkpoints and get_model_weights serve both) and the same model, to float tolerance.
  process = built['worker'].process
  for a, b in zip(_flat_weights(process, worker_state), _flat_weights(process, local_state)):
    np.testing.assert_allclose(b, a, atol=_ATOL, rtol=_RTOL)
  assert not all(np.array_equal(a, b) for a, b in zip(
      _flat_weights(process, worker_state), _flat_weights(process, round_loop.seeded_initial_state(
          process, build_keras, _SEED))))  # It trained.
  assert tf.nest.map_structure(lambda _: 0, worker_state.client_work) == tf.nest.map_structure(
      lambda _: 0, local_state.client_work)
  # The same metrics, key for key (client metrics aggregated by the same sum_then_finalize).
  for on_worker, on_local in zip(worker_metrics, local_metrics):
    on_worker, on_local = round_loop.flatten_metrics(on_worker), round_loop.flatten_metrics(on_local)
    assert set(on_worker) == set(on_local)
    for key in on_worker:
      np.testing.assert_allclose(on_local[key], on_worker[key], rtol=1e-4, atol=1e-5, err_msg=key)
  assert local_metrics[-1]['client_work']['train']['num_examples'] == sum(
      data.train.num_examples(c) for c in data.train.client_ids)
  cpu = built['local'].client_devices()
  assert cpu and all('CPU' in d for d in cpu) and not any('GPU' in d for d in cpu)
  assert built['worker'].client_devices() == list(client_execution.WORKER_DEVICES)


# Local mode's two client loops: the in-graph loop's update in a TF1 session per trainer against TFF's update in a
# tf.function, both in this process. Measured bit-identical for three of these four and one float32 rounding step
# apart (9e-8) for the CNN with FedProx (the session's graph optimizer and the tf.function's may fuse differently);
# asserted to 1e-6 (the CNN after one round, where that step has not grown through ReLU training).
# The fast tier runs the first case; the full suite all four (tests/tiers.py).
@pytest.mark.parametrize('model, algorithm, aggregator, rounds', tiers.first_only([
    ('logistic', 'fedprox', 'mean', 3),
    ('logistic', 'fedavg', 'mean', 3),
    ('cnn', 'fedavg', 'gma', 1),
    ('cnn', 'fedprox', 'mean', 1),
]))
def test_local_in_graph_loop_trains_as_the_local_iterator_loop(digits_setup, model, algorithm, aggregator, rounds):
  data = digits_setup
  build_keras, model_fn = _model(data, model)
  built = {loop: methods.build(model_fn, algorithm, aggregator, client_execution='local',
                               algorithm_config=config_lib.AlgorithmConfig(client_loop=loop, proximal_strength=0.1))
           for loop in config_lib.CLIENT_LOOPS}
  for loop, method in built.items():
    assert {t.loop for t in method._local_round.trainer._trainers} == {loop}  # pylint: disable=protected-access
  results = {loop: _train(method, build_keras, data, rounds=rounds) for loop, method in built.items()}
  process = built['iterator'].process
  (graph_state, graph_metrics), (iterator_state, iterator_metrics) = results['in_graph'], results['iterator']
  initial = _flat_weights(process, round_loop.seeded_initial_state(process, build_keras, _SEED))
  trained = _flat_weights(process, graph_state)
  assert not all(np.array_equal(a, b) for a, b in zip(initial, trained))
  for a, b in zip(_flat_weights(process, iterator_state), trained):
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-6)
  for g, i in zip(graph_metrics, iterator_metrics):
    g, i = round_loop.flatten_metrics(g), round_loop.flatten_metrics(i)
    assert set(g) == set(i)
    for key in g:
      np.testing.assert_allclose(g[key], i[key], rtol=1e-6, atol=1e-6, err_msg=key)
  assert built['in_graph'].client_devices() and all('CPU' in d for d in built['in_graph'].client_devices())


def test_the_cnn_after_one_round(digits_setup):
  data = digits_setup
  build_keras, model_fn = _model(data, 'cnn')
  built = {mode: methods.build(model_fn, 'fedavg', 'mean', client_execution=mode) for mode in client_execution.MODES}
  states = {mode: _train(method, build_keras, data, rounds=1)[0] for mode, method in built.items()}
  process = built['worker'].process
  for a, b in zip(_flat_weights(process, states['worker']), _flat_weights(process, states['local'])):
    np.testing.assert_allclose(b, a, atol=_CNN_ATOL)


def test_clients_spread_round_robin_over_devices_give_the_same_results(digits_setup):
  data = digits_setup
  _, model_fn = _model(data, 'logistic')
  algorithm_config = config_lib.AlgorithmConfig()
  # Two names of this process's one CPU: two trainers, each with its own model, run in two threads.
  two = client_execution.LocalClientTrainer(model_fn, algorithm_config,
                                            ['/device:CPU:0', '/job:localhost/device:CPU:0'])
  one = client_execution.LocalClientTrainer(model_fn, algorithm_config, ['/device:CPU:0'])
  weights = client_execution.tff.learning.models.ModelWeights.from_model(model_fn())
  weights = tf.nest.map_structure(lambda v: v.numpy(), weights)
  hparams = collections.OrderedDict(learning_rate=np.float32(0.05), momentum=np.float32(0.9))
  results_two, metrics_two = two.train(weights, _datasets(data, 1), hparams)
  results_one, metrics_one = one.train(weights, _datasets(data, 1), hparams)
  assert len(results_two) == len(data.train.client_ids)
  for a, b in zip(results_one, results_two):
    assert a.update_weight == b.update_weight
    for x, y in zip(a.update, b.update):
      np.testing.assert_array_equal(x, y)
  tf.nest.map_structure(np.testing.assert_array_equal, metrics_one, metrics_two)
  # Metrics start from zero for every client (one model serves many clients).
  assert [float(m['num_examples'][0]) for m in metrics_one] == [
      float(data.train.num_examples(c)) for c in data.train.client_ids]


def test_assign_devices_is_round_robin():
  assert client_execution.assign_devices(5, ['/GPU:0', '/GPU:1']) == ['/GPU:0', '/GPU:1', '/GPU:0', '/GPU:1',
                                                                       '/GPU:0']
  with pytest.raises(ValueError, match='devices'):
    client_execution.assign_devices(3, [])


def test_without_a_gpu_local_mode_says_once_that_it_uses_the_cpu(monkeypatch, caplog):
  monkeypatch.setattr(client_execution, '_warned_cpu', False)
  with caplog.at_level(logging.WARNING):
    first = client_execution.local_devices()
    second = client_execution.local_devices()
  assert first == second and 'CPU' in first[0]
  lines = [r.getMessage() for r in caplog.records if 'client_execution=local' in r.getMessage()]
  assert len(lines) == 1 and 'no GPU' in lines[0] and first[0] in lines[0]


@pytest.mark.parametrize('algorithm, aggregator, corruption, named', [
    ('fedavg', 'elastic', 'none', 'fedavg/elastic'),
    ('fedgma', 'mean', 'none', 'fedgma/mean'),
    ('scaffold', 'mean', 'none', 'scaffold/mean'),
    ('personalized', 'rfa', 'none', 'personalized/rfa'),
    ('fedavg', 'rfa', 'gaussian', 'corruption=gaussian'),
    ('fedavg', 'mean', 'omniscient', 'corruption=omniscient'),
])
def test_local_mode_refuses_what_it_does_not_run(algorithm, aggregator, corruption, named):
  with pytest.raises(ValueError, match='client_execution') as raised:
    registry.check(algorithm, aggregator, corruption, client_execution='local')
  assert named in str(raised.value)
  registry.check(algorithm, aggregator, corruption, client_execution='worker')
  with pytest.raises(ValueError, match='client_execution'):
    registry.check('fedavg', 'mean', client_execution='gpu')
  with pytest.raises(ValueError, match='workers'):
    registry.check('fedavg', 'mean', client_execution='local', workers='127.0.0.1:1')
  registry.check('fedavg', 'mean', 'data_negate', client_execution='local')  # Data corruption: either mode.


# ----------------------------------------------------------------------------------------------------------------
# The runner: --client_execution=local resumes bit-exactly, records its devices; older runs resume unchanged.

_TOY = dict(dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, model='logistic',
            batch_size=32, seed=3, checkpoint_every=1)


def test_a_local_run_interrupted_and_resumed_equals_the_uninterrupted_one(tmp_path):
  from training.runner import experiment  # pylint: disable=g-import-not-at-top
  config = config_lib.ExperimentConfig(**_TOY, rounds=3, client_execution='local')
  whole = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'a')), show_progress=False)
  config_b = dataclasses.replace(config, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(config_b, 2)
  rounds_seen = []
  resumed = experiment.run(config_b, show_progress=False, on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3]
  for a, b in zip(_flat(whole.model_weights), _flat(resumed.model_weights)):
    np.testing.assert_array_equal(a, b)
  summary = json.loads((tmp_path / 'b' / 'summary.json').read_text())
  assert summary['client_execution'] == 'local'
  assert summary['client_devices'] and all('CPU' in d for d in summary['client_devices'])
  assert summary['config']['client_execution'] == 'local'
  # Switching the mode of a run is refused (the rounds would differ in float rounding).
  with pytest.raises(experiment.ConfigError, match='client_execution'):
    experiment.run(dataclasses.replace(config_b, client_execution='worker', rounds=4), show_progress=False)
  # Local mode refuses what it does not run, before anything is written.
  for refused in (dict(algorithm='scaffold'), dict(aggregator='elastic'),
                  dict(corruption='gaussian', corrupt_fraction=0.25)):
    with pytest.raises(experiment.ConfigError, match='client_execution'):
      experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'c'), **refused), show_progress=False)
  assert not (tmp_path / 'c').exists()


def test_a_run_written_before_the_setting_existed_resumes_in_worker_mode(tmp_path):
  from training.runner import experiment  # pylint: disable=g-import-not-at-top
  config = config_lib.ExperimentConfig(**_TOY, rounds=1, output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  path = tmp_path / 'run' / 'config.json'
  saved = json.loads(path.read_text())
  del saved['client_execution']
  path.write_text(json.dumps(saved))
  summary = experiment.run(dataclasses.replace(config, rounds=2), show_progress=False).summary
  assert summary['rounds_completed'] == 2
  assert summary['client_execution'] == 'worker'
  assert summary['client_devices'] == list(client_execution.WORKER_DEVICES)


def test_the_runner_resumes_a_local_run_bit_exactly(tmp_path):
  flags = ['--model=logistic', '--num_clients=4', '--clients_per_round=3', '--batch_size=32', '--seed=3',
           '--client_execution=local']

  def run(out, rounds):
    process = subprocess.run(
        [sys.executable, '-m', 'training.run', f'--output_dir={out}', f'--rounds={rounds}', *flags],
        cwd=tests.ROOT, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    assert process.returncode == 0, process.stderr[-3000:]
    return process

  whole = run(tmp_path / 'whole', 3)
  assert sum('client_execution=local' in line for line in whole.stderr.splitlines()) == 1  # Says so once.
  run(tmp_path / 'resumed', 2)
  run(tmp_path / 'resumed', 3)
  rows = {name: (tmp_path / name / 'metrics.csv').read_text().splitlines() for name in ('whole', 'resumed')}
  assert len(rows['whole']) == 4 and rows['whole'] == rows['resumed']  # Every logged value, to the last digit.
  summary = json.loads((tmp_path / 'resumed' / 'summary.json').read_text())
  assert summary['client_execution'] == 'local' and all('CPU' in d for d in summary['client_devices'])
