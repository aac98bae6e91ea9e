"""The experiment runner: outputs, resume and determinism, validation, and every algorithm x aggregator."""

import dataclasses
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests.training import interrupt
from training import config as config_lib
from training.engine import methods
from training.engine import registry
from training.runner import checkpoints
from training.runner import dir_lock
from training.runner import config_checks
from training.runner import errors
from training.runner import experiment
from training.runner import resume_checks
from training.runner import round_steps
from training.runner import run_setup
from training.runner import run_summary

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, rounds=3, model='logistic',
    batch_size=32, client_lr=0.05, seed=3, checkpoint_every=1)  # Resume tests interrupt between rounds.


def _weights(result):
  w = result.model_weights
  return [np.asarray(t) for t in list(w.trainable) + list(w.non_trainable)]


def test_outputs_and_summary(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), eval_every=2)
  summary = experiment.run(config, show_progress=False).summary
  out = tmp_path / 'run'
  assert {'metrics.csv', 'summary.json', 'accuracy.png', 'config.json', 'checkpoints', 'tensorboard'} <= set(
      os.listdir(out))
  assert any(name.startswith('events') for name in os.listdir(out / 'tensorboard'))
  rows = experiment._read_rows(str(out / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2, 3]
  # Evaluated rounds: every 2nd and the last; participating vs non-participating since 3 of 4 clients take part.
  assert [('test/accuracy' in r) for r in rows] == [False, True, True]
  assert 'participating/accuracy' in rows[1] and 'non_participating/accuracy' in rows[1]
  assert 'client_work/train/loss' in rows[0]
  assert [r['all_clients_dropped'] for r in rows] == [0.0, 0.0, 0.0]
  assert not (out / dir_lock.LOCK_FILE).exists()  # Released.
  saved = json.loads((out / 'summary.json').read_text())
  assert saved['rounds_completed'] == 3
  assert saved['final_accuracy'] == pytest.approx(np.mean([rows[1]['test/accuracy'], rows[2]['test/accuracy']]))
  assert saved['best_accuracy'] == pytest.approx(max(rows[1]['test/accuracy'], rows[2]['test/accuracy']))
  assert saved['config']['aggregator'] == 'mean' and saved['config']['seed'] == 3
  assert summary['final_accuracy'] == saved['final_accuracy']
  parts = saved['seconds_by_part']
  assert parts['rounds'] == 3 and all(parts[k] > 0 for k in ('train', 'evaluate', 'release_and_checkpoint'))
  # Evaluations, rows and checkpoints ran beside the next rounds: what the rounds waited for them is part of the
  # run's time, their own time may overlap training.
  assert parts['waited'] >= 0
  assert parts['train'] + parts['waited'] <= saved['seconds_this_run']


def test_participation_eval_can_be_left_out_and_resumed_either_way(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), participation_eval=False, rounds=2)
  experiment.run(config, show_progress=False)
  experiment.run(dataclasses.replace(config, rounds=3, participation_eval=True), show_progress=False)
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  assert [('participating/accuracy' in r) for r in rows] == [False, False, True]
  assert all('test/accuracy' in r for r in rows)


def test_interrupted_and_resumed_run_equals_uninterrupted_run(tmp_path):
  whole = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'a')), show_progress=False)
  config_b = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(config_b, 2)
  rounds_seen = []
  resumed = experiment.run(config_b, show_progress=False, on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3]  # Only the missing round ran.
  for a, b in zip(_weights(whole), _weights(resumed)):
    np.testing.assert_array_equal(a, b)
  assert resumed.summary['rounds_completed'] == 3

  # A larger --rounds continues from the checkpoint.
  longer = experiment.run(dataclasses.replace(config_b, rounds=4), show_progress=False,
                          on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3, 4] and longer.summary['rounds_completed'] == 4


def test_checkpoint_every_saves_fewer_states_and_resumes_from_the_newest(tmp_path):
  config = dataclasses.replace(_TOY, rounds=5, checkpoint_every=1)
  whole = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'a')), show_progress=False)
  config_b = dataclasses.replace(config, output_dir=str(tmp_path / 'b'), checkpoint_every=3)
  interrupt.run_until(config_b, 4)
  assert sorted(checkpoints.saved_rounds(config_b.output_dir)) == [0, 3]
  # The rows are written with the checkpoints: round 4's, lost with the interruption, is trained again.
  assert [r['round'] for r in experiment._read_rows(os.path.join(config_b.output_dir, 'metrics.csv'))] == [1, 2, 3]
  rounds_seen = []
  resumed = experiment.run(config_b, show_progress=False, on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [4, 5]  # Round 4 had no checkpoint: it runs again.
  assert sorted(checkpoints.saved_rounds(config_b.output_dir)) == [0, 3, 5]  # The last round always saves.
  for a, b in zip(_weights(whole), _weights(resumed)):
    np.testing.assert_array_equal(a, b)
  rows = experiment._read_rows(os.path.join(config_b.output_dir, 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2, 3, 4, 5]
  whole_rows = experiment._read_rows(os.path.join(str(tmp_path / 'a'), 'metrics.csv'))
  assert rows == whole_rows  # Every metric of every round, as uninterrupted.
  for bad in (0, -1, 1.5, True):
    with pytest.raises(experiment.ConfigError, match='checkpoint_every'):
      experiment.run(dataclasses.replace(config_b, checkpoint_every=bad), show_progress=False)


def test_resume_with_other_settings_is_refused(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), rounds=1)
  experiment.run(config, show_progress=False)
  with pytest.raises(ValueError, match='aggregator'):
    experiment.run(dataclasses.replace(config, aggregator='gma'), show_progress=False)


def test_the_worker_intra_op_threads_are_a_run_setting(tmp_path, caplog):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  from tff_gma.runtime import contexts as runtime_contexts  # pylint: disable=g-import-not-at-top
  from tff_gma.runtime import worker_process  # pylint: disable=g-import-not-at-top
  for bad in (-1, 1025, 1.5):
    with pytest.raises(experiment.ConfigError, match=r'^worker_intra_op_threads must be an integer in \[0, 1024\]'):
      experiment.validate(dataclasses.replace(_TOY, worker_intra_op_threads=bad))
  assert config_lib.ExperimentConfig().worker_intra_op_threads == worker_process.DEFAULT_INTRA_OP_THREADS == 1
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), rounds=1, worker_intra_op_threads=0)
  try:
    experiment.run(config, show_progress=False)
    assert runtime.set_simulation_context().intra_op_threads == 0  # The run's worker.
    # Resumed with another count: it goes on, says once that its rounds differ in the last bits, and records it.
    caplog.set_level(logging.WARNING)
    resumed = experiment.run(dataclasses.replace(config, rounds=2, worker_intra_op_threads=1), show_progress=False)
    notes = [r.getMessage() for r in caplog.records if 'worker_intra_op_threads' in r.getMessage()]
    assert len(notes) == 1 and 'resumes with worker_intra_op_threads=1 (trained so far with 0)' in notes[0], notes
    assert resumed.summary['rounds_completed'] == 2 and resumed.summary['config']['worker_intra_op_threads'] == 1
    assert runtime.set_simulation_context().intra_op_threads == 1
    # Nothing left to train: no line. Under a context the caller installed instead, the run leaves it alone.
    caplog.clear()
    experiment.run(dataclasses.replace(config, rounds=2, worker_intra_op_threads=0), show_progress=False)
    assert not [r for r in caplog.records if 'worker_intra_op_threads' in r.getMessage()]
    assert runtime_contexts.simulation_context_applies()
    other = runtime.create_simulation_context(runtime.set_simulation_context())
    with tff.framework.get_context_stack().install(other):
      assert not runtime_contexts.simulation_context_applies()
  finally:
    runtime.set_simulation_context(intra_op_threads=worker_process.DEFAULT_INTRA_OP_THREADS)
  # A config written before the setting existed ran with TensorFlow's default.
  assert experiment.completed_config({})['worker_intra_op_threads'] == 0


def test_a_new_nested_output_dir_is_created_after_the_checks(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'new' / 'run'), rounds=1)
  experiment.check_resumable(config)  # Reads only: nothing there yet, nothing written.
  assert not (tmp_path / 'new').exists()
  experiment.run(config, show_progress=False)
  assert json.loads((tmp_path / 'new' / 'run' / 'config.json').read_text())['seed'] == 3
  experiment.check_resumable(config)  # The same settings again: resumable.
  with pytest.raises(experiment.ConfigError, match='seed'):
    experiment.check_resumable(dataclasses.replace(config, seed=4))


def test_an_older_config_without_rfa_init_is_the_mean_start_it_ran(tmp_path):
  # Runs written before --rfa_init existed started Weiszfeld from the weighted mean; the default is now 'zero',
  # so resuming such a run with today's defaults would change what its rounds compute.
  config = dataclasses.replace(_TOY, aggregator='rfa', output_dir=str(tmp_path / 'run'))
  os.makedirs(config.output_dir)
  older = {k: v for k, v in dataclasses.asdict(config).items() if k != 'rfa_init'}
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(older))
  assert config.rfa_init == 'zero'
  with pytest.raises(experiment.ConfigError, match="rfa_init: 'mean' -> 'zero'"):
    experiment.check_resumable(config)
  experiment.check_resumable(dataclasses.replace(config, rfa_init='mean'))
  # A setting whose default did not change is read at that default.
  older.pop('membership_inference')
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(older))
  experiment.check_resumable(dataclasses.replace(config, rfa_init='mean'))


@pytest.mark.parametrize('changes, flag', [
    ({'clients_per_round': 5}, 'clients_per_round'),
    ({'tau': 1.5}, 'tau'),
    ({'aggregator': 'median_of_means'}, 'aggregator'),
    ({'algorithm': 'fedsgd'}, 'algorithm'),
    ({'model': 'transformer'}, 'model'),
    ({'partition': 'by_writer'}, 'partition'),
    ({'fashion_mnist_source': 'tfds'}, 'fashion_mnist_source'),  # digits: TFDS's Fashion-MNIST does not apply.
    ({'fashion_mnist_source': 'http'}, 'fashion_mnist_source'),
    ({'dataset': 'imagenet'}, 'dataset'),
    ({'rounds': 0}, 'rounds'),
    ({'smoothing': 0.0}, 'smoothing'),
    ({'client_lr': -1.0}, 'client_lr'),
    ({'model': 'char_lstm'}, 'model'),
    ({'workers': 'localhost'}, 'workers'),
    ({'algorithm': 'fedprox', 'aggregator': 'elastic'}, 'aggregator'),
    ({'algorithm': 'scaffold', 'corruption': 'gaussian', 'corrupt_fraction': 0.25}, 'corruption'),
    ({'secure': True}, 'secure_bound'),
    ({'algorithm': 'personalized', 'aggregator': 'elastic'}, 'aggregator'),
    ({'seed': -1}, 'seed'),
    ({'client_lr': float('inf')}, 'client_lr'),
    ({'server_lr': float('nan')}, 'server_lr'),
])
def test_invalid_settings_fail_before_training(changes, flag, tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'never'), **changes)
  with pytest.raises(experiment.ConfigError, match=flag):
    experiment.validate(config)
  with pytest.raises(experiment.ConfigError):
    experiment.run(config, show_progress=False)
  assert not (tmp_path / 'never').exists()


# Every value of --algorithm and of --aggregator runs (each algorithm with the mean, each aggregator with FedAvg,
# and a few crossings), rather than the whole product: each case builds and traces a TFF process.
_MATRIX = sorted(
    {(a, 'mean') for a in registry.ALGORITHMS}
    | {('fedavg', g) for g in registry.AGGREGATORS}
    | {('fedadam', 'gma'), ('fedyogi', 'rfa'), ('fedprox', 'gma_binary'), ('fedadam', 'elastic'),
       ('scaffold', 'gma'), ('fedgma', 'rfa_one_step')})


@pytest.mark.parametrize('algorithm, aggregator', _MATRIX)
def test_algorithm_with_aggregator(algorithm, aggregator, tmp_path):
  config = dataclasses.replace(
      _TOY, algorithm=algorithm, aggregator=aggregator, rounds=2, num_clients=3, clients_per_round=3,
      partition='iid', corrupt_fraction=0.34 if aggregator in ('trimmed_mean', 'krum') else 0.0,
      server_lr=0.1 if algorithm in ('fedadam', 'fedyogi') else 1.0, output_dir=str(tmp_path / 'run'))
  result = experiment.run(config, show_progress=False)
  assert result.summary['rounds_completed'] == 2
  # Two rounds beat chance (0.1) clearly; personalized RFA's shared model alone need not (w + v_k predicts).
  key = 'final_personalized_accuracy' if algorithm == 'personalized' else 'best_accuracy'
  assert result.summary[key] > 0.3, result.summary
  assert all(np.all(np.isfinite(w)) for w in _weights(result))
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  assert [r['all_clients_dropped'] for r in rows] == [0.0, 0.0]  # No false alarm, whatever the measurements.


def test_scaffold_run_resumes_exactly_with_client_control_variates(tmp_path):
  base = dataclasses.replace(_TOY, algorithm='scaffold', aggregator='mean', rounds=3, partition='iid')
  whole = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'a')), show_progress=False)
  config_b = dataclasses.replace(base, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(config_b, 2)
  resumed = experiment.run(config_b, show_progress=False)
  for a, b in zip(_weights(whole), _weights(resumed)):
    np.testing.assert_array_equal(a, b)


def test_runner_on_two_workers_matches_one(tmp_path):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  workers = runtime.start_local_workers(2)
  try:
    base = dataclasses.replace(_TOY, aggregator='gma', rounds=2)
    one = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'one')), show_progress=False)
    two = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'two'),
                                             workers=','.join(w.target for w in workers)), show_progress=False)
  finally:
    runtime.set_simulation_context()
    for w in workers:
      w.stop()
  for a, b in zip(_weights(one), _weights(two)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  with pytest.raises(ValueError, match='sequential'):  # RFA's stages, which SCAFFOLD cannot run one at a time.
    experiment.run(dataclasses.replace(base, algorithm='scaffold', aggregator='rfa', output_dir=str(tmp_path / 'rfa'),
                                       workers='127.0.0.1:1'), show_progress=False)


def test_rfa_weight_audit_is_logged_per_round(tmp_path):
  config = dataclasses.replace(_TOY, aggregator='rfa', rounds=2, rfa_weight_bound=0.9,
                               output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  for row in rows:
    # 3 participants per round: the largest normalized weight lies between an equal share and 1.
    assert 1 / 3 - 1e-6 <= row['rfa_audit/max_normalized_weight'] <= 1.0
    assert row['rfa_audit/dominated'] in (0.0, 1.0)
  with pytest.raises(ValueError, match='rfa_weight_bound'):
    experiment.validate(dataclasses.replace(config, aggregator='gma'))


def test_membership_inference_option_writes_the_attack(tmp_path):
  config = dataclasses.replace(_TOY, rounds=1, membership_inference=True, output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  attack = json.loads((tmp_path / 'run' / 'membership.json').read_text())
  assert 0.0 <= attack['attack_accuracy'] <= 1.0
  assert summary['membership_attack_accuracy'] == pytest.approx(attack['attack_accuracy'])
  saved = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert saved['membership_attack_accuracy'] == pytest.approx(attack['attack_accuracy'])


def _warnings(caplog, text):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_fails_at_once_while_other_directories_run(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), rounds=2)
  seen = {}

  def during_round_one(round_num, state):
    del state
    if round_num != 1:
      return
    with pytest.raises(experiment.DirectoryLockedError) as raised:  # Before any training or writing.
      experiment.run(config, show_progress=False)
    seen['refusal'] = str(raised.value)
    # A study runs many runs in one process: another directory is not blocked.
    seen['other'] = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'other'), rounds=1),
                                   show_progress=False).summary['rounds_completed']
    raise KeyboardInterrupt()  # Ctrl-C: the lock is released on the way out too.

  with pytest.raises(KeyboardInterrupt):
    experiment.run(config, show_progress=False, on_round=during_round_one)
  assert str(tmp_path / 'run') in seen['refusal'] and f'pid {os.getpid()}' in seen['refusal']
  assert seen['other'] == 1
  assert not (tmp_path / 'run' / dir_lock.LOCK_FILE).exists()
  summary = experiment.run(config, show_progress=False).summary  # Resumes: the refused run wrote nothing.
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2] and summary['rounds_completed'] == 2


_DAMAGES = ('empty saved_model.pb', 'truncated variables', 'missing variables/')


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_resumes_from_the_newest_that_loads(tmp_path, caplog):
  from tests.training import checkpoints_test  # pylint: disable=g-import-not-at-top
  whole = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'whole')), show_progress=False)
  assert checkpoints.saved_rounds(str(tmp_path / 'whole')) == [0, 2, 3]
  for i, how in enumerate(_DAMAGES):
    out = tmp_path / f'damaged_{i}'
    shutil.copytree(tmp_path / 'whole', out)
    latest = str(out / 'checkpoints' / 'program_state_3')
    checkpoints_test._damage(latest, how)
    caplog.clear()
    rounds_seen = []
    resumed = experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False,
                             on_round=lambda r, s: rounds_seen.append(r))
    assert rounds_seen == [3], how  # Round 3 is trained again, from round 2's checkpoint.
    (message,) = _warnings(caplog, 'resuming from round 2')
    assert latest in message, message
    for a, b in zip(_weights(whole), _weights(resumed)):
      np.testing.assert_array_equal(a, b)
    assert [r['round'] for r in experiment._read_rows(str(out / 'metrics.csv'))] == [1, 2, 3]
    assert (out / 'checkpoints' / 'damaged' / 'program_state_3').is_dir()

  # None loads: the error names the damaged checkpoints, and nothing is moved or written.
  out = tmp_path / 'all_damaged'
  shutil.copytree(tmp_path / 'whole', out)
  paths = [str(out / 'checkpoints' / f'program_state_{r}') for r in (0, 2, 3)]
  for path in paths:
    checkpoints_test._damage(path, 'missing variables/')
  with pytest.raises(experiment.CheckpointError) as raised:
    experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False)
  assert all(p in str(raised.value) for p in paths)
  assert checkpoints.saved_rounds(str(out)) == [0, 2, 3]


def test_a_finished_run_is_not_resummarized_with_fewer_rounds(tmp_path):
  # What an 8-round run leaves (checkpoints 0, 7, 8); reading is all the check does.
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path), rounds=8)
  (tmp_path / 'config.json').write_text(json.dumps(dataclasses.asdict(config)))
  for r in (0, 7, 8):
    (tmp_path / 'checkpoints' / f'program_state_{r}').mkdir(parents=True)
  (tmp_path / 'summary.json').write_text('{"rounds_completed": 8}')
  with pytest.raises(experiment.ConfigError, match='rounds: .* trained to round 8; rounds=4 .* --rounds=8'):
    experiment.prepare(dataclasses.replace(config, rounds=4))
  experiment.prepare(config)  # The same rounds (reports it) or more (continues it) are fine.
  experiment.prepare(dataclasses.replace(config, rounds=9))
  assert (tmp_path / 'summary.json').read_text() == '{"rounds_completed": 8}'


@pytest.mark.slow
def test_a_refused_start_writes_nothing_and_the_corrected_command_runs(tmp_path):
  # SCAFFOLD cannot run RFA's several stages one computation each: refused with workers.
  refused = dataclasses.replace(_TOY, algorithm='scaffold', aggregator='rfa', rounds=1, workers='127.0.0.1:1',
                                output_dir=str(tmp_path / 'new' / 'run'))
  with pytest.raises(experiment.ConfigError, match='workers: .*sequential'):
    experiment.run(refused, show_progress=False)
  assert not (tmp_path / 'new').exists()
  summary = experiment.run(dataclasses.replace(refused, workers=None), show_progress=False).summary
  assert summary['rounds_completed'] == 1


def test_all_clients_dropped_reads_the_aggregator_or_the_client_work():
  dropped = experiment.all_clients_dropped
  # tff_gma's aggregators: no participating client (TFF's client work zeroed the non-finite ones' weights).
  assert 'aggregator/participating_clients = 0 of 3' in dropped(
      {'aggregator/participating_clients': 0.0, 'aggregator/dropped_clients': 0.0}, 3)
  assert dropped({'aggregator/participating_clients': 2.0, 'aggregator/dropped_clients': 1.0,
                  'client_work/train/num_examples': 0.0}, 3) is None
  assert 'gradient/participating_clients' in dropped({'aggregator/gradient/participating_clients': 0.0}, 3)
  # Dropped by the aggregator itself (elastic reports only dropped_clients).
  assert 'aggregator/dropped_clients = 3 of 3' in dropped({'aggregator/dropped_clients': 3.0}, 3)
  # TFF's MeanFactory reports nothing: the client work's example count (the weight sum) is 0.
  assert 'num_examples = 0' in dropped({'client_work/train/num_examples': 0.0,
                                        'finalizer/update_non_finite': 1.0}, 3)
  assert dropped({'client_work/train/num_examples': 1438.0, 'aggregator/dropped_clients': 1.0}, 3) is None
  assert dropped({}, 3) is None


@pytest.mark.slow
@pytest.mark.parametrize('aggregator', ['mean', 'gma', 'elastic'])
def test_a_round_that_drops_every_client_warns_once_and_its_row_records_it(tmp_path, caplog, aggregator):
  # A client learning rate near float32's largest value: every client's update overflows to inf/NaN.
  config = dataclasses.replace(_TOY, aggregator=aggregator, client_lr=1e38, rounds=2, eval_every=2,
                               output_dir=str(tmp_path / 'run'))
  caplog.set_level(logging.WARNING)
  experiment.run(config, show_progress=False)
  warned = _warnings(caplog, 'dropped as non-finite')
  assert [w.split(':')[0] for w in warned] == ['round 1 of 2', 'round 2 of 2'], warned
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  assert [r['all_clients_dropped'] for r in rows] == [1.0, 1.0]


@pytest.mark.parametrize('name', [f.name for f in dataclasses.fields(config_lib.ExperimentConfig)
                                  if f.type in ('float', 'Optional[float]')])
@pytest.mark.parametrize('value', [float('inf'), float('-inf'), float('nan')])
def test_every_float_setting_must_be_finite(name, value):
  with pytest.raises(experiment.ConfigError, match=f'{name}'):
    experiment.validate(dataclasses.replace(_TOY, **{name: value}))


def test_checkpoints_without_config_json_refuse_to_resume(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), rounds=1)
  experiment.run(config, show_progress=False)
  os.remove(tmp_path / 'run' / 'config.json')
  with pytest.raises(experiment.ConfigError, match='holds checkpoints but no config.json'):
    experiment.run(dataclasses.replace(config, rounds=2, client_lr=0.1), show_progress=False)
  (tmp_path / 'run' / 'config.json').write_text('{"seed": 3,')  # Damaged: cut mid-write by hand.
  with pytest.raises(experiment.ConfigError, match='config.json is damaged'):
    experiment.run(dataclasses.replace(config, rounds=2), show_progress=False)
  assert not list((tmp_path / 'run').glob('config.json.tmp'))


def test_resume_removes_unfinished_saves_and_a_cut_last_row(tmp_path):
  out = tmp_path / 'run'
  config = dataclasses.replace(_TOY, output_dir=str(out), rounds=2)
  experiment.run(config, show_progress=False)
  partial = out / 'checkpoints' / 'program_state_3_temp1234'  # A save killed before TFF renamed it.
  (partial / 'variables').mkdir(parents=True)
  (partial / 'saved_model.pb').write_bytes(b'\0' * 100)
  with open(out / 'metrics.csv', 'a') as f:
    f.write('3,0.51')  # A row cut while written: no line end, too few fields.
  release = out / 'metrics.csv_temp5678'  # TFF's CSV release written there, killed (or out of space) before renamed.
  release.write_text('round,x\n1,0.5\n')
  experiment.run(dataclasses.replace(config, rounds=3), show_progress=False)
  assert not partial.exists() and not release.exists()
  rows = experiment._read_rows(str(out / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2, 3]
  assert 'client_work/train/loss' in rows[2]
  assert json.loads((out / 'summary.json').read_text())['rounds_completed'] == 3


def test_a_run_whose_server_update_stays_non_finite_stops_saying_why(tmp_path):
  out = tmp_path / 'run'
  # FedProx's term of strength 1e38 sends the clients' weights to infinity after their first step: the round's
  # aggregate is non-finite and the finalizer rejects it (finalizer/update_non_finite = 1), every round.
  config = dataclasses.replace(_TOY, output_dir=str(out), rounds=9, algorithm='fedprox', proximal_strength=1e38)
  with pytest.raises(experiment.TrainingStopped, match=r'stopped after round 5 of 9: the server update was '
                     r'non-finite in 5 rounds in a row .* --proximal_strength=1e\+38'):
    experiment.run(config, show_progress=False)
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['non_finite_update_rounds'] == experiment.NON_FINITE_ROUNDS_TO_STOP == 5
  assert summary['stopped'].startswith('stopped after round 5 of 9')
  assert summary['rounds_completed'] == 4  # The 5th round's row is not released.
  healthy = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'ok')), show_progress=False)
  assert healthy.summary['non_finite_update_rounds'] == 0 and 'stopped' not in healthy.summary


class _ZeroResult(tff.aggregators.WeightedAggregationFactory):
  """`inner`'s aggregation with its result replaced by zeros: an aggregator that returns no update, as an RFA whose
  inner mean returned zeros did (its measurements still look healthy)."""

  def __init__(self, inner: tff.aggregators.WeightedAggregationFactory):
    self._inner = inner

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    inner = self._inner.create(value_type, weight_type)
    state_type, client_values_type, client_weights_type = inner.next.type_signature.parameter

    @tff.tensorflow.computation(value_type)
    def zeros(value):
      return tf.nest.map_structure(tf.zeros_like, value)

    @tff.federated_computation(state_type, client_values_type, client_weights_type)
    def next_fn(state, value, weight):
      output = inner.next(state, value, weight)
      return tff.templates.MeasuredProcessOutput(output.state, tff.federated_map(zeros, output.result),
                                                 output.measurements)

    return tff.templates.AggregationProcess(inner.initialize, next_fn)


def _aggregators_return_no_update(monkeypatch):
  build = registry.build
  monkeypatch.setattr(registry, 'build', lambda name, params=None: _ZeroResult(build(name, params)))
  # Built afresh, and kept from the other tests' runs: the built processes are cached by their settings.
  monkeypatch.setattr(methods, '_PROCESS_CACHE', {})


_FROZEN_STOP = (r"^stopped after round 3 of 9: the model has not changed for 3 rounds \(rounds 1-3\) with aggregator "
                r"'rfa': likely the aggregator returns no update")


@pytest.mark.slow
def test_a_run_whose_aggregator_returns_no_update_stops_naming_it_and_resumes_to_the_same_stop(tmp_path, monkeypatch):
  _aggregators_return_no_update(monkeypatch)
  config = dataclasses.replace(_TOY, aggregator='rfa', rounds=9, max_frozen_rounds=3, output_dir=str(tmp_path / 'a'))
  with pytest.raises(experiment.TrainingStopped, match=_FROZEN_STOP):
    experiment.run(config, show_progress=False)
  summary = json.loads((tmp_path / 'a' / 'summary.json').read_text())
  assert re.match(_FROZEN_STOP, summary['stopped']) and summary['rounds_completed'] == 2
  rows = experiment._read_rows(str(tmp_path / 'a' / 'metrics.csv'))
  assert [(r['round'], r['model_unchanged_rounds']) for r in rows] == [(1, 1.0), (2, 2.0)]  # Round 3's not written.

  # Interrupted inside the streak, the run resumes counting from its checkpoint's row: the same stop, the same rows.
  config_b = dataclasses.replace(config, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(config_b, 2)
  with pytest.raises(experiment.TrainingStopped, match=_FROZEN_STOP):
    experiment.run(config_b, show_progress=False)
  assert experiment._read_rows(str(tmp_path / 'b' / 'metrics.csv')) == rows
  assert sorted(checkpoints.saved_rounds(config_b.output_dir)) == sorted(checkpoints.saved_rounds(config.output_dir))

  # The same command stops it again; --max_frozen_rounds=0 lets it go on.
  with pytest.raises(experiment.TrainingStopped, match=_FROZEN_STOP):
    experiment.run(config, show_progress=False)
  finished = experiment.run(dataclasses.replace(config, max_frozen_rounds=0), show_progress=False)
  assert finished.summary['rounds_completed'] == 9 and 'stopped' not in finished.summary


@pytest.mark.slow
def test_the_frozen_model_watch_changes_nothing_in_a_run_that_trains(tmp_path):
  config = dataclasses.replace(_TOY, rounds=4, checkpoint_every=2)
  watched = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'a')), show_progress=False)
  unwatched = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'b'), max_frozen_rounds=0),
                             show_progress=False)
  for a, b in zip(_weights(watched), _weights(unwatched)):
    np.testing.assert_array_equal(a, b)
  rows = experiment._read_rows(str(tmp_path / 'a' / 'metrics.csv'))
  assert rows == experiment._read_rows(str(tmp_path / 'b' / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2, 3, 4] and not any('model_unchanged_rounds' in r for r in rows)
  assert 'stopped' not in watched.summary


def test_the_names_other_code_imports_from_experiment_are_the_steps_own():
  # The studies, the runner, command_line's refusal list and the tests import these from `experiment`.
  steps = {
      'ConfigError': errors, 'TrainingStopped': errors, 'UnsafeOutputError': errors,
      'DirectoryLockedError': errors, 'CheckpointError': errors, 'MAX_SEED': config_checks,
      'validate': config_checks, 'CONFIG_FILE': resume_checks, 'completed_config': resume_checks,
      'check_not_superseded': resume_checks, 'check_resumable': resume_checks, 'Setup': run_setup,
      'build_setup': run_setup, 'client_loop_used': run_setup, 'place_datasets': run_setup,
      'PERSONAL_TEST_FRACTION': run_setup, 'NON_FINITE_ROUNDS_TO_STOP': round_steps,
      'evaluate_weights': round_steps, 'all_clients_dropped': round_steps, 'LAST_EVALS_FOR_FINAL': run_summary}
  for name, module in steps.items():
    assert getattr(experiment, name) is getattr(module, name), name
  assert (experiment._read_rows, experiment._plot_figure, experiment._plot) == (
      run_summary.read_rows, run_summary.plot_figure, run_summary.write_plot)
  assert experiment.ConfigError is errors.ConfigError and issubclass(experiment.ConfigError, ValueError)
