"""Every flagfile in configs/ parses into a valid configuration; the offline (digits) ones run a round."""

import tests
import dataclasses
import glob
import os

import pytest
from absl import flags

from training import config as config_lib
from training.runner import experiment
from training import run  # Defines the runner's flags.

_ROOT = tests.ROOT
_CONFIGS = sorted(glob.glob(os.path.join(_ROOT, 'configs', '*.flags')))


def _parse(path: str) -> config_lib.ExperimentConfig:
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['run', f'--flagfile={path}'])
  try:
    return run.config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()


def test_there_are_configs():
  assert len(_CONFIGS) >= 8


@pytest.mark.parametrize('path', _CONFIGS, ids=os.path.basename)
def test_config_is_valid(path):
  config = _parse(path)
  experiment.validate(config)
  assert config.output_dir.startswith('outputs/')


@pytest.mark.parametrize('path', [p for p in _CONFIGS if 'digits' in os.path.basename(p)], ids=os.path.basename)
def test_offline_config_runs(path, tmp_path):
  config = dataclasses.replace(_parse(path), rounds=1, num_clients=min(_parse(path).num_clients, 10),
                               output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  assert summary['rounds_completed'] == 1
