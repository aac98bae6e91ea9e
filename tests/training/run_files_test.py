"""A run's files as its rounds begin: settings, the state it starts from, metrics.csv cut back, the writers."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

from training import config as config_lib
from training.runner import checkpoints
from training.runner import run_files
from training.runner import run_setup

_TOY = config_lib.ExperimentConfig(dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3,
                                   rounds=3, model='logistic', seed=3)


@pytest.fixture(scope='module')
def setup():
  return run_setup.build_setup(_TOY)


def _weights(setup, state):
  weights = setup.process.get_model_weights(state)
  return [np.asarray(w) for w in list(weights.trainable) + list(weights.non_trainable)]


def test_the_settings_are_written_as_the_resume_guard_reads_them(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path))
  run_files.write_settings(config, process=None)  # Without `audit`, the process is not read.
  assert json.loads((tmp_path / 'config.json').read_text()) == dataclasses.asdict(config)
  assert not (tmp_path / 'audit.md').exists()


def test_a_new_run_starts_from_the_seeded_model_saved_as_round_0_and_a_later_one_from_its_newest_save(
    tmp_path, setup, caplog):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path))
  partial = tmp_path / 'checkpoints' / 'program_state_2_temp99'  # A save that never finished.
  partial.mkdir(parents=True)
  caplog.set_level(logging.WARNING)
  manager = run_files.open_state_manager(config.output_dir)
  assert not partial.exists() and any('whose save never finished' in r.getMessage() for r in caplog.records)
  state, round_num = run_files.start_state(config, setup, manager)
  assert round_num == 0 and checkpoints.saved_rounds(config.output_dir) == [0]
  tf.keras.utils.set_random_seed(config.seed)  # The model Keras initializes from the run's seed.
  keras_model = setup.build_keras()
  expected = [w.numpy() for w in keras_model.trainable_weights + keras_model.non_trainable_weights]
  for got, want in zip(_weights(setup, state), expected, strict=True):
    np.testing.assert_array_equal(got, want)

  moved = setup.process.set_model_weights(state, setup.process.get_model_weights(state))
  writers = run_files.open_writers(config.output_dir, manager, round_num)
  writers.save(moved, 2)
  resumed, resumed_round = run_files.start_state(config, setup, run_files.open_state_manager(config.output_dir))
  assert resumed_round == 2 and checkpoints.saved_rounds(config.output_dir) == [0, 2]


def test_metrics_csv_is_cut_back_to_the_starting_round_and_the_writers_append_to_it(tmp_path, setup):
  del setup  # Only for the session's TFF set-up.
  manager = run_files.open_state_manager(str(tmp_path))
  writers = run_files.open_writers(str(tmp_path), manager, 0)
  writers.write_rows([(1, {'loss': 1.5}), (2, {'loss': 1.25}), (3, {'loss': 1.0})])
  with open(writers.csv_path, 'a') as f:
    f.write('4,0.')  # A row cut while written.
  writers = run_files.open_writers(str(tmp_path), manager, 2)  # Resumed from round 2's checkpoint.
  assert open(writers.csv_path).read().splitlines() == ['round,loss', '1,1.5', '2,1.25']
  writers.write_rows([(3, {'loss': 0.5})])
  assert open(writers.csv_path).read().splitlines() == ['round,loss', '1,1.5', '2,1.25', '3,0.5']
  assert any(name.startswith('events') for name in os.listdir(tmp_path / 'tensorboard'))
