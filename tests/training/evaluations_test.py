"""A run's evaluations beside the next round: results reach their rows by `wait`, as evaluating in turn would give
them; errors surface there; the run's rows are the same either way."""

import dataclasses
import os
import threading

import pytest

from training import config as config_lib
from training.runner import evaluations
from training.runner import experiment


@pytest.mark.parametrize('background', [True, False])
def test_results_join_their_rows_by_wait(background):
  runs = evaluations.Evaluations(background)
  release = threading.Event()
  rows = [{'round': 1.0}, {'round': 2.0}]
  threads = []

  def evaluate(value):
    threads.append(threading.current_thread() is threading.main_thread())
    if background:
      release.wait(10)  # Still running while the caller goes on (the next round trains meanwhile).
    return {'test/accuracy': value}

  for row, value in zip(rows, (0.25, 0.5)):
    runs.submit(row, lambda value=value: evaluate(value))
  if background:
    assert rows == [{'round': 1.0}, {'round': 2.0}]  # Not yet.
    release.set()
  runs.wait()
  assert rows == [{'round': 1.0, 'test/accuracy': 0.25}, {'round': 2.0, 'test/accuracy': 0.5}]
  assert threads == [not background] * 2
  assert runs.seconds > 0 and runs.waited >= 0 and (background or runs.waited == runs.seconds)
  runs.close()


def test_an_evaluation_error_surfaces_at_wait():
  runs = evaluations.Evaluations(True)
  runs.submit({}, lambda: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    runs.wait()
  runs.wait()  # Nothing left pending.
  runs.close()


def test_a_run_writes_the_same_rows_with_evaluations_in_turn(tmp_path, monkeypatch):
  config = config_lib.ExperimentConfig(
      dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, rounds=4, model='logistic',
      batch_size=32, client_lr=0.05, seed=3, eval_every=2, checkpoint_every=3)
  experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'beside')), show_progress=False)
  asked = []
  original = evaluations.Evaluations.__init__

  def in_turn(self, background):  # pylint: disable=redefined-outer-name
    asked.append(background)
    original(self, False)

  monkeypatch.setattr(evaluations.Evaluations, '__init__', in_turn)
  experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'in_turn')), show_progress=False)
  assert asked == [True]  # The worker trains this method's clients: its evaluations ran beside.
  texts = [open(os.path.join(tmp_path, d, 'metrics.csv')).read() for d in ('beside', 'in_turn')]
  assert texts[0] == texts[1] and 'test/accuracy' in texts[0]
