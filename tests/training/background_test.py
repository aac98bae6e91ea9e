"""A run's after-round work beside the next round: in submission order, errors raised in the round loop, nothing
run after a failure; the run's rows and checkpoints are the same as in turn."""

import dataclasses
import os
import threading

import numpy as np
import pytest

from training import config as config_lib
from training.runner import background
from training.runner import checkpoints
from training.runner import experiment


@pytest.mark.parametrize('in_background', [True, False])
def test_tasks_run_in_order_and_wait_joins_them(in_background):
  work = background.AfterRoundWork(in_background)
  release = threading.Event()
  done, threads = [], []

  def task(name):
    threads.append(threading.current_thread() is threading.main_thread())
    if in_background and name == 'a':
      release.wait(10)  # Still running while the caller goes on (the next round trains meanwhile).
    done.append(name)

  for name in 'abc':
    work.submit('evaluate' if name == 'a' else 'release_and_checkpoint', lambda name=name: task(name))
  if in_background:
    assert done == []  # Not yet: the first task holds the thread, the others wait their turn.
    release.set()
  work.wait()
  assert done == ['a', 'b', 'c'] and threads == [not in_background] * 3
  assert work.seconds['evaluate'] > 0 and work.seconds['release_and_checkpoint'] >= 0
  work.close()


def test_wait_for_last_waits_for_that_parts_latest_task_and_those_before_it_only():
  work = background.AfterRoundWork(True)
  release = threading.Event()
  done = []
  work.submit('evaluate', lambda: done.append('evaluate 1'))
  work.submit('release_and_checkpoint', lambda: done.append('save 2'))
  work.submit('evaluate', lambda: (release.wait(10), done.append('evaluate 3')))  # Still running after the wait.
  work.wait_for_last('release_and_checkpoint')
  assert done == ['evaluate 1', 'save 2']
  work.wait_for_last('release_and_checkpoint')  # Nothing newer to wait for: returns at once.
  release.set()
  work.wait()
  assert done == ['evaluate 1', 'save 2', 'evaluate 3']
  work.close()


def test_wait_for_last_raises_an_earlier_failure():
  work = background.AfterRoundWork(True)
  work.submit('evaluate', lambda: 1 / 0)
  work.submit('release_and_checkpoint', lambda: None)
  with pytest.raises(ZeroDivisionError):
    work.wait_for_last('release_and_checkpoint')
  work.close()


def test_an_error_is_raised_in_the_loop_and_nothing_runs_after_it():
  work = background.AfterRoundWork(True)
  ran = []
  work.submit('evaluate', lambda: 1 / 0)
  work.submit('release_and_checkpoint', lambda: ran.append('checkpoint'))  # Must not follow a failed evaluation.
  with pytest.raises(ZeroDivisionError):
    work.wait()
  assert ran == []
  work.close()


def test_check_raises_a_finished_failure_without_waiting():
  work = background.AfterRoundWork(True)
  work.submit('evaluate', lambda: 1 / 0)
  work._pending[0].exception(timeout=10)  # pylint: disable=protected-access  # Let it fail first.
  with pytest.raises(ZeroDivisionError):
    work.check()
  work.close()


def test_a_run_writes_the_same_rows_and_checkpoints_with_its_work_in_turn(tmp_path, monkeypatch):
  config = config_lib.ExperimentConfig(
      dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, rounds=5, model='logistic',
      batch_size=32, client_lr=0.05, seed=3, eval_every=2, checkpoint_every=2)
  beside = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'beside')), show_progress=False)
  asked = []
  original = background.AfterRoundWork.__init__

  def in_turn(self, background):  # pylint: disable=redefined-outer-name
    asked.append(background)
    original(self, False)

  monkeypatch.setattr(background.AfterRoundWork, '__init__', in_turn)
  in_turn_run = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'in_turn')), show_progress=False)
  assert asked == [True]  # The worker trains this method's clients: its work ran beside the next rounds.
  texts = [open(os.path.join(tmp_path, d, 'metrics.csv')).read() for d in ('beside', 'in_turn')]
  assert texts[0] == texts[1] and 'test/accuracy' in texts[0]
  assert checkpoints.saved_rounds(str(tmp_path / 'beside')) == checkpoints.saved_rounds(str(tmp_path / 'in_turn'))
  for a, b in zip(beside.model_weights.trainable, in_turn_run.model_weights.trainable):
    np.testing.assert_array_equal(a, b)
  parts = beside.summary['seconds_by_part']
  assert parts['evaluate'] > 0 and parts['release_and_checkpoint'] > 0 and parts['waited'] >= 0
