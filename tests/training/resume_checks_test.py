"""The output directory's run against these settings: its saved settings read back, and the resume notes."""

import dataclasses
import json
import logging
import os

import pytest

from training import config as config_lib
from training.runner import errors
from training.runner import resume_checks

_CONFIG = config_lib.ExperimentConfig(dataset='digits', rounds=4, model='logistic')


def test_saved_settings_are_none_for_a_new_directory_and_completed_for_an_old_one(tmp_path):
  assert resume_checks._saved_settings(str(tmp_path / 'new')) is None
  saved = {k: v for k, v in dataclasses.asdict(_CONFIG).items() if k not in ('rfa_init', 'client_loop')}
  (tmp_path / resume_checks.CONFIG_FILE).write_text(json.dumps(saved))
  settings = resume_checks._saved_settings(str(tmp_path))
  # What the run ran before the settings existed: the mean start and TFF's iterator loop, not today's defaults.
  assert settings['rfa_init'] == 'mean' and settings['client_loop'] == 'iterator'
  assert {k: settings[k] for k in saved} == saved


def test_saved_settings_refuse_checkpoints_without_settings_and_damaged_settings(tmp_path):
  os.makedirs(tmp_path / 'checkpoints' / 'program_state_0')
  with pytest.raises(errors.ConfigError, match='holds checkpoints but no config.json'):
    resume_checks._saved_settings(str(tmp_path))
  (tmp_path / resume_checks.CONFIG_FILE).write_text('{"seed": 3,')
  with pytest.raises(errors.ConfigError, match='config.json is damaged'):
    resume_checks._saved_settings(str(tmp_path))


def test_a_fedprox_run_from_before_the_corrected_client_work_cannot_resume(tmp_path):
  saved = {k: v for k, v in dataclasses.asdict(_CONFIG).items() if k != 'adaptive_optimizer'}
  (tmp_path / resume_checks.CONFIG_FILE).write_text(json.dumps({**saved, 'algorithm': 'fedprox'}))
  with pytest.raises(errors.ConfigError, match='cannot resume: its FedProx rounds'):
    resume_checks._saved_settings(str(tmp_path))


def test_a_resume_that_changes_the_last_bits_is_noted_once_per_directory_and_setting(tmp_path, caplog):
  config = dataclasses.replace(_CONFIG, output_dir=str(tmp_path), worker_intra_op_threads=2)
  saved = resume_checks.completed_config(dataclasses.asdict(dataclasses.replace(config, worker_intra_op_threads=1)))
  caplog.set_level(logging.WARNING)
  resume_checks._note_last_bits(config, saved, trained=2)
  resume_checks._note_last_bits(config, saved, trained=2)  # The run checks twice (before and under its lock).
  resume_checks._note_last_bits(config, saved, trained=4)  # Nothing left to train: nothing to note.
  notes = [r.getMessage() for r in caplog.records if 'resumes with' in r.getMessage()]
  assert notes == [f'{tmp_path}: resumes with worker_intra_op_threads=2 (trained so far with 1): its rounds from '
                   'here differ in the last bits from an uninterrupted run\'s']
