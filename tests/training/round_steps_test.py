"""The runner's steps around each round, one by one over a `Training` of stand-ins, and the rounds they drive."""

import dataclasses
import io
import logging
import types
from typing import Any, NamedTuple

import numpy as np
import pytest
import tensorflow_federated as tff

from training import config as config_lib
from training.runner import background
from training.runner import progress
from training.runner import round_loop
from training.runner import round_steps
from training.runner import run_setup

_CONFIG = config_lib.ExperimentConfig(dataset='digits', num_clients=3, clients_per_round=2, rounds=5, eval_every=2,
                                      checkpoint_every=2, output_dir='/nonexistent/run')


class _Writers:
  """Records what the steps write, in order."""

  def __init__(self, log):
    self.log = log

  def write_rows(self, rows):
    self.log.append(('rows', [number for number, _ in rows]))

  def save(self, state, round_num):
    self.log.append(('save', round_num, state))


class _Method:
  """A method whose round adds 1 to the state and reports `metrics(round_num)`."""

  client_sources = None
  client_state = None

  def __init__(self, log, metrics=lambda round_num: {}):
    self.log = log
    self.metrics = metrics

  def run_round(self, state, participants, datasets, round_num):
    del participants, datasets  # The stand-in never reads the datasets (they are built when read).
    return state + 1, self.metrics(round_num)

  def checkpoint_client_state(self, output_dir, round_num):
    self.log.append(('client_state', round_num))


class _Weights(NamedTuple):
  """The stand-in's model weights: ('weights', state), whose one trainable array is the state."""
  tag: str
  state: Any

  @property
  def trainable(self):
    return [np.asarray(self.state)]


def _training(config=_CONFIG, log=None, **changes):
  log = [] if log is None else log
  setup = types.SimpleNamespace(
      method=_Method(log), corrupted=('b',), accuracy_key='test/accuracy',
      process=types.SimpleNamespace(get_model_weights=lambda state: _Weights('weights', state)),
      data=types.SimpleNamespace(train=types.SimpleNamespace(client_ids=['a', 'b', 'c'])))
  training = round_steps.Training(config, setup, _Writers(log), background.AfterRoundWork(False))
  return dataclasses.replace(training, **changes)


def _round(number, row=None, participants=('a', 'b'), state=None, seconds=0.0):
  return round_loop.Round(number, list(participants), [], number if state is None else state, dict(row or {}),
                          seconds)


def test_count_training_sums_the_rounds_own_time():
  training = _training()
  for seconds in (0.5, 0.25):
    round_steps.count_training(training, _round(1, seconds=seconds))
  assert training.train_seconds == 0.75


def test_non_finite_server_updates_in_a_row_stop_the_run_and_a_finite_one_resets_the_count():
  training = _training(config=dataclasses.replace(_CONFIG, rounds=20, client_lr=0.5))
  rejected = {'finalizer/update_non_finite': 1.0}
  for number in range(1, 5):
    round_steps.stop_if_non_finite(training, _round(number, rejected))
  assert training.non_finite_in_a_row == 4
  round_steps.stop_if_non_finite(training, _round(5, {'finalizer/update_non_finite': 0.0}))
  assert training.non_finite_in_a_row == 0
  for number in range(6, 6 + round_steps.NON_FINITE_ROUNDS_TO_STOP - 1):
    round_steps.stop_if_non_finite(training, _round(number, rejected))
  with pytest.raises(round_steps.TrainingStopped, match=r'^stopped after round 10 of 20: .*--client_lr=0\.5'):
    round_steps.stop_if_non_finite(training, _round(10, rejected))
  assert training.non_finite_in_a_row == 5


def test_a_round_without_counted_clients_is_marked_and_warned_once(caplog):
  training = _training()
  caplog.set_level(logging.WARNING)
  dropped = _round(3, {'aggregator/participating_clients': 0.0})
  round_steps.mark_dropped_clients(training, dropped)
  healthy = _round(4, {'aggregator/participating_clients': 2.0})
  round_steps.mark_dropped_clients(training, healthy)
  assert dropped.row['all_clients_dropped'] == 1.0 and healthy.row['all_clients_dropped'] == 0.0
  warnings = [r.getMessage() for r in caplog.records if 'dropped as non-finite' in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].startswith('round 3 of 5: ') and 'participating_clients = 0 of 2' in (
      warnings[0])


def test_corrupted_participants_are_counted_only_in_runs_with_corruption():
  done = _round(1, participants=('a', 'b', 'c'))
  round_steps.count_corrupted(_training(), done)
  assert 'corrupted_participants' not in done.row
  round_steps.count_corrupted(_training(config=dataclasses.replace(_CONFIG, corruption='gaussian')), done)
  assert done.row['corrupted_participants'] == 1.0  # 'b' of ('a', 'b', 'c').


def test_the_due_rounds_are_evaluated_on_their_own_weights(monkeypatch):
  seen = []

  def evaluate(setup, weights, participants):
    del setup
    seen.append((weights, participants))
    return {'test/accuracy': weights[1] / 10}

  monkeypatch.setattr(round_steps, 'evaluate_weights', evaluate)
  training = _training()  # eval_every=2 of 5 rounds: rounds 2, 4 and the last.
  rows = {}
  for number in range(1, 6):
    done = _round(number, state=number * 10)
    round_steps.evaluate_round(training, done)
    rows[number] = done.row
  assert {n: r.get('test/accuracy') for n, r in rows.items()} == {1: None, 2: 2.0, 3: None, 4: 4.0, 5: 5.0}
  assert seen == [(('weights', 20), ['a', 'b']), (('weights', 40), ['a', 'b']), (('weights', 50), ['a', 'b'])]


def test_an_earlier_failed_task_is_raised_before_the_next_evaluation():
  training = _training(work=background.AfterRoundWork(True))
  training.work.submit('evaluate', lambda: 1 / 0)
  training.work._pending[0].exception(timeout=10)  # pylint: disable=protected-access  # Let it fail first.
  with pytest.raises(ZeroDivisionError):
    round_steps.evaluate_round(training, _round(1))
  training.work.close()


def test_rows_then_client_values_then_the_state_are_saved_every_checkpoint_every_rounds_and_after_the_last():
  log = []
  training = _training(log=log)  # checkpoint_every=2 of 5 rounds.
  for number in range(1, 6):
    round_steps.release_and_save(training, _round(number, state=f'state {number}'))
  assert log == [('rows', [1, 2]), ('client_state', 2), ('save', 2, 'state 2'),
                 ('rows', [3, 4]), ('client_state', 4), ('save', 4, 'state 4'),
                 ('rows', [5]), ('client_state', 5), ('save', 5, 'state 5')]
  assert training.unreleased == []


def test_report_round_updates_the_bar_and_calls_on_round_after_the_rounds_work():
  stream = io.StringIO()
  calls, done_tasks = [], []
  training = _training(bar=progress.RoundProgress(5, 'fedavg/mean', stream=stream),
                       on_round=lambda number, state: calls.append((number, state, list(done_tasks))),
                       work=background.AfterRoundWork(True))
  training.work.submit('evaluate', lambda: done_tasks.append('evaluated'))
  round_steps.report_round(training, _round(5, {'test/accuracy': 0.75}, state='last'))
  assert calls == [(5, 'last', ['evaluated'])]  # The work had finished when on_round ran.
  assert 'round    5/5 acc 0.7500' in stream.getvalue()
  training.work.close()


def test_without_the_audit_the_step_before_a_round_adds_nothing():
  assert round_steps.audit_weights(_training(), 1, 0, ['a'], []) == {}


def _evaluate_as_half(monkeypatch):
  monkeypatch.setattr(round_steps, 'evaluate_weights', lambda setup, weights, participants: {'test/accuracy': 0.5})


def test_train_runs_the_rounds_with_every_step_and_reports_them(monkeypatch):
  _evaluate_as_half(monkeypatch)
  log = []
  training = _training(log=log)
  training.setup.method.metrics = lambda round_num: {'client_work': {'train': {'loss': float(round_num)}}}
  trained = round_steps.train(training, state=100, start_round=1)  # Resumed after round 1.
  assert trained.state == 104 and trained.rounds_run == 4 and trained.stopped is None
  assert trained.dataset_placement == 'driver' and trained.non_finite_in_a_row == 0
  assert set(trained.seconds) == {'train', 'evaluate', 'release_and_checkpoint', 'waited'}
  assert log == [('rows', [2]), ('client_state', 2), ('save', 2, 101), ('rows', [3, 4]), ('client_state', 4),
                 ('save', 4, 103), ('rows', [5]), ('client_state', 5), ('save', 5, 104)]


def test_a_stopped_run_writes_the_rows_of_the_rounds_it_ran_and_says_why(monkeypatch):
  _evaluate_as_half(monkeypatch)
  log = []
  training = _training(config=dataclasses.replace(_CONFIG, rounds=9, checkpoint_every=4), log=log)
  training.setup.method.metrics = lambda round_num: {'finalizer': {'update_non_finite': float(round_num > 1)}}
  trained = round_steps.train(training, state=0, start_round=0)
  assert isinstance(trained.stopped, round_steps.TrainingStopped) and 'after round 6 of 9' in str(trained.stopped)
  assert trained.state == 6 and trained.rounds_run == 6 and trained.non_finite_in_a_row == 5
  # Rounds 1-4 written with their checkpoint; round 5's row on the stop (no checkpoint); round 6's, the round that
  # stopped the run, not at all.
  assert log == [('rows', [1, 2, 3, 4]), ('client_state', 4), ('save', 4, 4), ('rows', [5])]


def test_the_work_runs_beside_the_rounds_only_where_the_next_round_leaves_it_alone():
  def started(**method):
    setup = types.SimpleNamespace(method=types.SimpleNamespace(**method))
    training = round_steps.start_training(_CONFIG, setup, None, show_progress=False, on_round=None)
    beside = training.work._pool is not None  # pylint: disable=protected-access
    training.work.close()
    return beside, training.bar, training.monitor

  assert started(client_state=None, client_execution='worker') == (True, None, None)
  assert started(client_state=object(), client_execution='worker')[0] is False  # SCAFFOLD, personalized RFA.
  assert started(client_state=None, client_execution='local')[0] is False


def test_accuracy_key_is_the_validation_splits_in_a_validation_run():
  setup = run_setup.Setup(None, None, None, None, None)
  assert setup.accuracy_key == 'test/accuracy'
  assert dataclasses.replace(setup, validation=((), ())).accuracy_key == 'validation/accuracy'


def _watched(config=_CONFIG, **changes):
  training = _training(config=config, **changes)
  round_steps.watch_model(training, 0, 0)  # From the initial state 0.
  return training


def test_rounds_whose_model_did_not_move_are_counted_in_their_rows_and_a_moved_one_resets_the_count():
  training = _watched(config=dataclasses.replace(_CONFIG, rounds=20))
  states = [0, 0, 1, 1, 1, 2]  # Rounds 1 and 2: the initial state's model; 4 and 5: round 3's; 3 and 6 moved.
  rows = []
  for number, state in enumerate(states, start=1):
    done = _round(number, state=state)
    round_steps.stop_if_frozen(training, done)
    rows.append(done.row.get('model_unchanged_rounds'))
  assert rows == [1.0, 2.0, None, 1.0, 2.0, None]


def test_max_frozen_rounds_unchanged_rounds_in_a_row_stop_the_run_naming_the_aggregator():
  config = dataclasses.replace(_CONFIG, rounds=20, aggregator='rfa', max_frozen_rounds=3)
  training = _watched(config=config)
  round_steps.stop_if_frozen(training, _round(1, state=5))  # Moved.
  for number in (2, 3):
    round_steps.stop_if_frozen(training, _round(number, state=5))
  with pytest.raises(round_steps.TrainingStopped, match=r"^stopped after round 4 of 20: the model has not changed for "
                     r"3 rounds \(rounds 2-4\) with aggregator 'rfa': likely the aggregator returns no update"):
    round_steps.stop_if_frozen(training, _round(4, state=5))


def test_the_stop_says_when_every_client_was_dropped():
  training = _watched(config=dataclasses.replace(_CONFIG, max_frozen_rounds=1, aggregator='gma'))
  with pytest.raises(round_steps.TrainingStopped, match="aggregator 'gma': every client was dropped as non-finite"):
    round_steps.stop_if_frozen(training, _round(1, {'all_clients_dropped': 1.0}, state=0))


def test_max_frozen_rounds_0_never_reads_the_weights():
  fetched = []
  training = _training(config=dataclasses.replace(_CONFIG, max_frozen_rounds=0))
  training.setup.process.get_model_weights = lambda state: fetched.append(state)
  round_steps.watch_model(training, 0, 0)
  for number in range(1, 10):
    done = _round(number, state=0)
    round_steps.stop_if_frozen(training, done)
    assert done.row == {}
  assert fetched == [] and training.frozen is None


def test_a_resumed_run_counts_on_from_its_checkpoints_row(tmp_path):
  config = dataclasses.replace(_CONFIG, rounds=20, max_frozen_rounds=4, output_dir=str(tmp_path))
  (tmp_path / 'metrics.csv').write_text('round,model_unchanged_rounds\n1,\n2,1.0\n3,2.0\n')
  training = _training(config=config)
  round_steps.watch_model(training, 7, 3)  # Resumed from round 3's checkpoint, its model 7.
  round_steps.stop_if_frozen(training, _round(4, state=7))
  with pytest.raises(round_steps.TrainingStopped, match=r'after round 5 of 20: .* for 4 rounds \(rounds 2-5\)'):
    round_steps.stop_if_frozen(training, _round(5, state=7))


def test_the_watch_reads_a_learning_states_own_weights_without_a_tff_call():
  fetched = []
  training = _training()
  training.setup.process.get_model_weights = lambda state: fetched.append(state) or _Weights('weights', state)
  weights = tff.learning.models.ModelWeights(trainable=[np.ones(2, np.float32)], non_trainable=[])
  state = types.SimpleNamespace(global_model_weights=weights)
  assert round_steps.trainable_weights(training, state) == weights.trainable and fetched == []
  assert round_steps.trainable_weights(training, 3) == [np.asarray(3)] and fetched == [3]  # No such field.


def test_a_run_whose_model_stays_put_stops_within_max_frozen_rounds_and_writes_the_rows_before(monkeypatch):
  _evaluate_as_half(monkeypatch)
  log = []
  config = dataclasses.replace(_CONFIG, rounds=9, checkpoint_every=2, max_frozen_rounds=3)
  training = _training(config=config, log=log)
  training.setup.method.run_round = lambda state, participants, datasets, round_num: (state, {})
  trained = round_steps.train(training, state=0, start_round=0)
  assert isinstance(trained.stopped, round_steps.TrainingStopped)
  assert str(trained.stopped).startswith("stopped after round 3 of 9: the model has not changed for 3 rounds "
                                         "(rounds 1-3) with aggregator 'mean'")
  assert trained.rounds_run == 3
  # Rounds 1-2 with their checkpoint; round 3, the round that stopped the run, neither evaluated nor written.
  assert log == [('rows', [1, 2]), ('client_state', 2), ('save', 2, 0), ('rows', [])]
