"""--train_subset_fraction: checked once (one line naming it), a class-stratified subset of the training split
that is the same for every seed, and runs written before the setting existed resume and read back at 1.0."""

import dataclasses
import json
import os

import numpy as np
import pytest

from tff_gma.data import digits
from tff_gma.data import federated
from training import config as config_lib
from training.runner import experiment
from training.runner import run_setup
from training.studies.shared import study_runs

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='iid', num_clients=4, clients_per_round=3, rounds=1, model='logistic',
    batch_size=32, seed=3, checkpoint_every=1)


def test_the_default_is_every_training_example():
  assert config_lib.ExperimentConfig().train_subset_fraction == 1.0


@pytest.mark.parametrize('value', [0.0, -0.5, 1.5, float('nan'), float('inf'), True])
def test_an_invalid_fraction_is_one_line_naming_it(value):
  with pytest.raises(experiment.ConfigError, match='train_subset_fraction') as refused:
    experiment.validate(dataclasses.replace(_TOY, train_subset_fraction=value))
  assert '\n' not in str(refused.value)


def test_a_fraction_needs_an_array_pool():
  config = dataclasses.replace(_TOY, dataset='shakespeare', model='char_lstm', train_subset_fraction=0.5)
  with pytest.raises(experiment.ConfigError, match='train_subset_fraction applies to array pools'):
    experiment.validate(config)
  experiment.validate(dataclasses.replace(config, train_subset_fraction=1.0))


def test_every_seed_trains_on_the_same_stratified_subset():
  y_split = digits.load_split().y_train
  kept = federated.stratified_subset(y_split, 0.5)
  pools = []
  for seed in (0, 1):
    setup = experiment.build_setup(dataclasses.replace(_TOY, seed=seed, train_subset_fraction=0.5))
    x, y = setup.data.train.pooled_arrays()
    assert np.bincount(y).tolist() == [round(0.5 * n) for n in np.bincount(y_split)]
    assert len(setup.data.test_y) == len(digits.load_split().y_test)  # The test split is whole.
    pools.append(sorted(map(bytes, x)))
  assert pools[0] == pools[1] == sorted(map(bytes, digits.load_split().x_train[kept]))


def test_a_study_reading_a_runs_data_gets_its_subset():
  # The membership study attacks a run's model with that run's training examples: read through load_data.
  y_split = digits.load_split().y_train
  kept = federated.stratified_subset(y_split, 0.5)
  data = run_setup.load_data(dataclasses.replace(_TOY, train_subset_fraction=0.5))
  x, _ = data.train.pooled_arrays()
  assert sorted(map(bytes, x)) == sorted(map(bytes, digits.load_split().x_train[kept]))


def _drop_the_setting(path):
  with open(path) as f:
    saved = json.load(f)
  config = saved.get('config', saved)  # summary.json keeps the settings under 'config'.
  del config['train_subset_fraction']
  with open(path, 'w') as f:
    json.dump(saved, f)


def test_a_run_written_before_the_setting_resumes_and_reads_back(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  for name in (experiment.CONFIG_FILE, 'summary.json'):
    _drop_the_setting(tmp_path / 'run' / name)
  assert study_runs.finished_summary(config) is not None  # The studies' read-back: the same run at 1.0.
  with pytest.raises(experiment.ConfigError, match="train_subset_fraction: 1.0 -> 0.5"):
    experiment.check_resumable(dataclasses.replace(config, rounds=2, train_subset_fraction=0.5))
  summary = experiment.run(dataclasses.replace(config, rounds=2), show_progress=False).summary
  assert summary['rounds_completed'] == 2 and summary['config']['train_subset_fraction'] == 1.0
  assert os.path.exists(tmp_path / 'run' / 'checkpoints')
