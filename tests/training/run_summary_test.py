"""A finished run's summary.json, read back from a metrics.csv written here, with stand-ins for the run's setup."""

import csv
import dataclasses
import json
import types

import numpy as np

from training import config as config_lib
from training.runner import round_steps
from training.runner import run_setup
from training.runner import run_summary


def _write_metrics(path, rows):
  columns = sorted({k for row in rows for k in row})
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, columns)
    writer.writeheader()
    writer.writerows(rows)


def _setup(validation=None):
  method = types.SimpleNamespace(client_execution='worker', client_devices=lambda: ['cpu'])
  return types.SimpleNamespace(method=method, validation=validation, model_fn=None,
                               accuracy_key='test/accuracy' if validation is None else 'validation/accuracy')


def _trained(**changes):
  trained = round_steps.Trained(state=None, rounds_run=3, seconds={'train': 1.23456, 'evaluate': 0.5,
                                                                   'release_and_checkpoint': 0.25, 'waited': 0.0},
                                dataset_placement='worker', started=0.0, process_age=12.345, non_finite_in_a_row=0)
  return dataclasses.replace(trained, **changes)


def _config(tmp_path, **changes):
  return config_lib.ExperimentConfig(dataset='digits', algorithm='scaffold', rounds=12, output_dir=str(tmp_path),
                                     **changes)


def test_the_summary_reads_the_evaluated_rounds_up_to_rounds(tmp_path, monkeypatch):
  monkeypatch.setattr(run_setup, 'client_loop_used', lambda config, model_fn: 'in_graph')
  accuracy = [0.1 * (i % 7) for i in range(1, 14)]
  # 13 rows: round 13 lies past rounds=12 (a longer run's row) and is left out; round 1 was not evaluated.
  rows = [{'round': i, 'client_work/train/loss': 1.0, **({'test/accuracy': accuracy[i - 1],
                                                           'participating/accuracy': 0.5} if i > 1 else {})}
          for i in range(1, 14)]
  _write_metrics(tmp_path / 'metrics.csv', rows)
  summary = run_summary.write_summary(_config(tmp_path), _setup(), _trained(non_finite_in_a_row=2))
  evaluated = accuracy[1:12]
  assert summary['final_accuracy'] == float(np.mean(evaluated[-10:]))
  assert summary['best_accuracy'] == max(evaluated)
  assert summary['rounds_completed'] == 12
  assert summary['final_participating_accuracy'] == 0.5
  assert summary['process_seconds_before_rounds'] == 12.35
  assert summary['seconds_by_part'] == {'train': 1.235, 'evaluate': 0.5, 'release_and_checkpoint': 0.25,
                                        'waited': 0.0, 'rounds': 3}
  assert (summary['client_execution'], summary['dataset_placement'], summary['client_loop'],
          summary['client_devices']) == ('worker', 'worker', 'in_graph', ['cpu'])
  assert summary['non_finite_update_rounds'] == 2 and 'stopped' not in summary
  assert summary['config']['rounds'] == 12
  assert list(summary) == [
      'final_accuracy', 'best_accuracy', 'rounds_completed', 'seconds_this_run', 'process_seconds_before_rounds',
      'seconds_by_part', 'client_execution', 'dataset_placement', 'client_loop', 'client_devices', 'config',
      'final_participating_accuracy', 'non_finite_update_rounds']
  assert json.loads((tmp_path / 'summary.json').read_text()) == summary
  assert (tmp_path / 'accuracy.png').read_bytes().startswith(b'\x89PNG')


def test_a_validation_run_reports_the_validation_split_and_no_test_accuracy(tmp_path):
  rows = [{'round': i, 'validation/accuracy': 0.25 * i} for i in (1, 2, 3)]
  _write_metrics(tmp_path / 'metrics.csv', rows)
  stopped = round_steps.TrainingStopped('stopped after round 3 of 12: why')
  summary = run_summary.write_summary(_config(tmp_path), _setup(validation=((), ())), _trained(stopped=stopped))
  assert summary['final_accuracy'] is None and summary['best_accuracy'] is None
  assert summary['final_validation_accuracy'] == 0.5 and summary['best_validation_accuracy'] == 0.75
  assert summary['stopped'] == 'stopped after round 3 of 12: why'
  assert summary['client_loop'] is None  # SCAFFOLD walks its batches with its own loop.


def test_without_evaluated_rounds_there_is_no_plot_and_no_figure(tmp_path):
  _write_metrics(tmp_path / 'metrics.csv', [{'round': 1, 'client_work/train/loss': 2.0}])
  summary = run_summary.write_summary(_config(tmp_path), _setup(), _trained())
  assert summary['final_accuracy'] is None and summary['rounds_completed'] == 1
  assert not (tmp_path / 'accuracy.png').exists()
