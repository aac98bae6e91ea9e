"""`--adaptive_optimizer`: FedAdam/FedYogi's server optimizer in the harness, and run directories made before it.

`reddi` (the default) is Reddi et al.'s Algorithm 2 (`tff_gma.optimizers`, checked against the paper in
tests/tff_gma/optimizers_test.py); `tff` is TFF's bias-corrected `build_adam`/`build_yogi`, what every run made
before the setting existed used. A config.json without the setting resumes with `tff` for FedAdam/FedYogi; an old
FedProx directory (trained with TFF 0.87's wrong-signed proximal term) is refused in one line.
"""

import dataclasses
import json
import os
import subprocess
import sys

from absl import flags
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import tests
from tff_gma import models
from tff_gma import optimizers
from tff_gma.data import loaders
from training import config as config_lib
from training import run as run_lib
from training.engine import fedavg_family
from training.engine import methods
from training.runner import experiment
from training.runner import round_loop

SERVER_LR, EPSILON = 0.2, 0.01
# Three rounds of a 3-coordinate update: TFF's bias correction (0.74 at round 2) makes its second step differ.
UPDATES = [np.array([0.5, -0.2, 0.05]), np.array([0.4, 0.1, -0.05]), np.array([-0.3, 0.2, 0.02])]


def _steps(optimizer):
  """The weights after each of three rounds from 0, fed `UPDATES` as TFF's finalizer feeds them."""
  weights = [tf.zeros([3], tf.float32)]
  state = optimizer.initialize([tf.TensorSpec([3], tf.float32)])
  history = []
  for update in UPDATES:
    state, weights = optimizer.next(state, weights, [tf.constant(update, tf.float32)])
    history.append(weights[0].numpy())
  return history


def _algorithm(name, **kwargs):
  return config_lib.AlgorithmConfig(name=name, server_lr=SERVER_LR, adaptive_epsilon=EPSILON, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The setting.


def test_the_default_is_reddi_everywhere_a_config_is_made():
  assert config_lib.AlgorithmConfig().adaptive_optimizer == 'reddi'
  assert config_lib.ExperimentConfig().adaptive_optimizer == 'reddi'
  passed = config_lib.ExperimentConfig(algorithm='fedyogi', adaptive_optimizer='tff').algorithm_config()
  assert (passed.name, passed.adaptive_optimizer) == ('fedyogi', 'tff')


@pytest.mark.parametrize('name, reddi, tff_builder', [
    ('fedadam', optimizers.build_reddi_adam, tff.learning.optimizers.build_adam),
    ('fedyogi', optimizers.build_reddi_yogi, tff.learning.optimizers.build_yogi),
])
def test_each_value_builds_its_optimizer(name, reddi, tff_builder):
  betas = dict(beta_1=config_lib.ADAPTIVE_BETA_1, beta_2=config_lib.ADAPTIVE_BETA_2, epsilon=EPSILON)
  default = fedavg_family.server_optimizer(_algorithm(name))
  assert isinstance(default, optimizers.ReddiAdaptiveOptimizer)
  state = default.initialize([tf.TensorSpec([3], tf.float32)])
  assert list(default.get_hparams(state).values()) == [SERVER_LR, 0.9, 0.99, EPSILON]
  ours, theirs = _steps(reddi(SERVER_LR, **betas)), _steps(tff_builder(SERVER_LR, **betas))
  for got, want in zip(_steps(default), ours):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(_steps(fedavg_family.server_optimizer(_algorithm(name, adaptive_optimizer='tff'))), theirs):
    np.testing.assert_array_equal(got, want)
  assert np.abs(ours[1] - theirs[1]).max() > 1e-3  # The two are measurably different optimizers.


def test_the_sgd_servers_ignore_it():
  for name in ('fedavg', 'fedprox'):
    sgd = _steps(tff.learning.optimizers.build_sgdm(SERVER_LR))
    for value in config_lib.ADAPTIVE_OPTIMIZERS:
      for got, want in zip(_steps(fedavg_family.server_optimizer(_algorithm(name, adaptive_optimizer=value))), sgd):
        np.testing.assert_array_equal(got, want)


def test_an_unknown_value_is_refused_naming_the_setting(tmp_path):
  with pytest.raises(ValueError, match='adaptive_optimizer'):
    config_lib.AlgorithmConfig(adaptive_optimizer='adam')
  with pytest.raises(experiment.ConfigError, match='adaptive_optimizer'):
    experiment.validate(config_lib.ExperimentConfig(algorithm='fedadam', adaptive_optimizer='adam',
                                                    output_dir=str(tmp_path / 'run')))
  flag_values = flags.FlagValues()
  run_lib.define_flags(flag_values)
  assert flag_values['adaptive_optimizer'].default == 'reddi'
  with pytest.raises(flags.IllegalFlagValueError, match=r'<reddi\|tff>'):
    flag_values(['run', '--adaptive_optimizer=adam'])


@pytest.mark.parametrize('algorithm', ['fedadam', 'fedyogi'])
def test_elastic_aggregation_runs_with_each_adaptive_server(algorithm):
  # Elastic aggregation is a process of its own that takes fedavg_family's server optimizer (registry.py).
  data = loaders.load_federated_data('digits', 'iid', 3, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  method = methods.build(models.model_fn(build_keras, data.input_spec), algorithm, 'elastic',
                         algorithm_config=_algorithm(algorithm), num_clients=3)
  state = round_loop.seeded_initial_state(method.process, build_keras, 0)
  assert set(state.finalizer) >= {optimizers.FIRST_MOMENT, optimizers.SECOND_MOMENT}  # Reddi's, by default.
  before = method.process.get_model_weights(state).trainable
  done = round_loop.RoundLoop(method, state, round_loop.ClientInputs(data.train, 3, 1, 64, 0)).step()
  after = method.process.get_model_weights(done.state).trainable
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(not np.allclose(a, b) for a, b in zip(after, before))


# ----------------------------------------------------------------------------------------------------------------
# Run directories written before the setting existed.


def _old_config_json(config: config_lib.ExperimentConfig) -> None:
  """Writes `config` into its output directory as a config.json of before the setting: without the field."""
  os.makedirs(config.output_dir, exist_ok=True)
  saved = {k: v for k, v in dataclasses.asdict(config).items() if k != 'adaptive_optimizer'}
  with open(os.path.join(config.output_dir, experiment.CONFIG_FILE), 'w') as f:
    json.dump(saved, f)


def test_a_saved_config_without_the_setting_ran_tffs_optimizer_if_it_was_adaptive():
  for algorithm, value in (('fedadam', 'tff'), ('fedyogi', 'tff'), ('fedavg', 'reddi'), ('fedprox', 'reddi'),
                           ('fedgma', 'reddi')):
    assert experiment.completed_config({'algorithm': algorithm})['adaptive_optimizer'] == value, algorithm
  assert experiment.completed_config({})['adaptive_optimizer'] == 'reddi'  # The default algorithm, fedavg.
  assert experiment.completed_config({'algorithm': 'fedadam', 'adaptive_optimizer': 'reddi'})[
      'adaptive_optimizer'] == 'reddi'  # A config.json that has the setting says it.


@pytest.mark.parametrize('algorithm', ['fedadam', 'fedyogi'])
def test_an_old_adaptive_run_resumes_with_tff_only(tmp_path, algorithm):
  config = config_lib.ExperimentConfig(algorithm=algorithm, output_dir=str(tmp_path / 'run'))
  _old_config_json(dataclasses.replace(config, adaptive_optimizer='tff'))
  with pytest.raises(experiment.ConfigError, match="adaptive_optimizer: 'tff' -> 'reddi'"):
    experiment.check_resumable(config)
  experiment.check_resumable(dataclasses.replace(config, adaptive_optimizer='tff'))


def test_an_old_sgd_run_resumes_under_the_default(tmp_path):
  config = config_lib.ExperimentConfig(algorithm='fedavg', aggregator='gma', output_dir=str(tmp_path / 'run'))
  _old_config_json(config)
  experiment.check_resumable(config)


def test_an_old_fedprox_directory_is_refused_in_one_line(tmp_path):
  config = config_lib.ExperimentConfig(algorithm='fedprox', output_dir=str(tmp_path / 'run'))
  _old_config_json(config)
  for flags_now in (config, dataclasses.replace(config, seed=5)):  # Whatever the flags: the directory is refused.
    with pytest.raises(experiment.ConfigError) as refused:
      experiment.check_resumable(flags_now)
    message = str(refused.value)
    assert '\n' not in message and message.startswith(f'{config.output_dir} cannot resume: '), message
    assert "TFF 0.87's proximal client work" in message and 'new --output_dir' in message, message
  # A FedProx directory written since (config.json has the setting) resumes.
  with open(os.path.join(config.output_dir, experiment.CONFIG_FILE), 'w') as f:
    json.dump(dataclasses.asdict(config), f)
  experiment.check_resumable(config)


def test_the_runner_refuses_an_old_fedprox_directory_in_one_line(tmp_path):
  out = tmp_path / 'old_fedprox'
  _old_config_json(config_lib.ExperimentConfig(algorithm='fedprox', output_dir=str(out), rounds=1))
  written = sorted(os.listdir(out))
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', '--algorithm=fedprox', f'--output_dir={out}', '--rounds=1'],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
  assert process.returncode != 0
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith(f'invalid flags: {out} cannot resume: '), process.stderr[-3000:]
  assert sorted(os.listdir(out)) == written  # Nothing written.


def test_an_old_fedadam_run_resumes_from_its_checkpoint_with_tff_and_records_it(tmp_path):
  # The checkpoint holds TFF's Adam state (step, accumulator, preconditioner): only 'tff' loads and continues it.
  config = config_lib.ExperimentConfig(
      dataset='digits', num_clients=3, clients_per_round=3, rounds=1, model='logistic', batch_size=64,
      algorithm='fedadam', server_lr=0.01, adaptive_optimizer='tff', eval_every=5, participation_eval=False,
      output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  _old_config_json(config)  # As a run made before the setting existed left it.
  with pytest.raises(experiment.ConfigError, match="adaptive_optimizer: 'tff' -> 'reddi'"):
    experiment.run(dataclasses.replace(config, rounds=2, adaptive_optimizer='reddi'), show_progress=False)
  summary = experiment.run(dataclasses.replace(config, rounds=2), show_progress=False).summary
  assert summary['rounds_completed'] == 2 and summary['config']['adaptive_optimizer'] == 'tff'
  with open(os.path.join(config.output_dir, experiment.CONFIG_FILE)) as f:
    assert json.load(f)['adaptive_optimizer'] == 'tff'  # Recorded from now on.


def test_a_reddi_run_resumes_exactly(tmp_path):
  # Reddi's optimizer state (hyperparameters and both moments) round-trips through the run's checkpoints.
  config = config_lib.ExperimentConfig(
      dataset='digits', num_clients=3, clients_per_round=3, rounds=2, model='logistic', batch_size=64,
      algorithm='fedyogi', server_lr=0.01, eval_every=5, participation_eval=False, output_dir=str(tmp_path / 'a'))
  whole = experiment.run(config, show_progress=False).model_weights
  resumed_dir = dataclasses.replace(config, output_dir=str(tmp_path / 'b'))
  experiment.run(dataclasses.replace(resumed_dir, rounds=1), show_progress=False)
  resumed = experiment.run(resumed_dir, show_progress=False).model_weights
  for a, b in zip(whole.trainable, resumed.trainable):
    np.testing.assert_array_equal(a, b)
  with open(os.path.join(config.output_dir, experiment.CONFIG_FILE)) as f:
    assert json.load(f)['adaptive_optimizer'] == 'reddi'
