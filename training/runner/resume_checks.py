"""Whether the output directory's run may resume under these settings.

Same settings where they matter, not already trained past `rounds`, and not dated by its saved settings to a
computation today's code no longer runs. Reads only: the directory is created, and `CONFIG_FILE` written, by the run
once every check has passed. A saved config.json (or a summary's `config`) that lacks a setting was written before
the setting existed: `completed_config` gives the value that run used."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from absl import logging

from training import config as config_lib
from training import safe_files
from training.engine import client_execution as client_execution_lib
from training.runner import checkpoints
from training.runner.errors import ConfigError

CONFIG_FILE = 'config.json'  # The run's settings: written once every check passed, the resume guard after that.

# Settings a resumed run may change: they do not alter the state or what a round computes.
_RESUMABLE_CHANGES = ('rounds', 'eval_every', 'eval_last_rounds', 'output_dir', 'audit', 'data_dir', 'workers',
                      'rfa_weight_bound', 'membership_inference', 'participation_eval', 'dataset_placement',
                      'client_loop', 'worker_intra_op_threads', 'checkpoint_every', 'max_frozen_rounds',
                      'first_round_deadline_s', 'round_deadline_factor', 'min_round_deadline_s')
# dataset_placement and client_loop change how, not what: the runs are bit-identical either way in the TFF worker
# (tested); with --client_execution=local the two loops agree to float32 rounding (a log line says so on resume).
# worker_intra_op_threads changes the last bits of what some kernels sum, as the machine's core count does under
# TensorFlow's default: a run may resume with another count (or on another machine), and the run says so in a log
# line; the summary records the count of its last session.
# max_frozen_rounds changes only when a run whose model no longer moves is stopped (0 lets a stopped one go on),
# and the deadlines only when a run whose workers do not answer is ended.


# Runs written before a setting existed: the one place that says what they ran. A saved config.json (or a summary's
# `config`) that lacks the setting is such a run.
# Settings whose default changed after runs were written without them: such a run ran with this value (a callable
# gives it from the run's saved settings).
# rfa_init: RFA started Weiszfeld from the weighted mean before the setting existed (the default is now 'zero').
# dataset_placement: every round's datasets were sent from this process before the setting existed.
# client_loop: every client walked its batches with TFF's iterator loop before the setting existed.
# worker_intra_op_threads: the worker ran with TensorFlow's default (0) before the setting existed.
# adaptive_optimizer: FedAdam and FedYogi ran TFF's bias-corrected build_adam/build_yogi before the setting existed
# (the default is now 'reddi', Reddi et al.'s Algorithm 2); the other algorithms have no adaptive server and read
# today's default.
_VALUE_BEFORE_SETTING_EXISTED = {
    'rfa_init': 'mean', 'dataset_placement': 'driver', 'client_loop': 'iterator', 'worker_intra_op_threads': 0,
    'adaptive_optimizer': lambda saved: (
        'tff' if saved.get('algorithm') in config_lib.ADAPTIVE_ALGORITHMS
        else config_lib.ExperimentConfig.adaptive_optimizer),
}
# Runs written before a setting existed that no flags can resume, since today's code no longer computes what they
# computed: (the setting, which runs lacking it, why; the refusal names the directory).
# fedprox: adaptive_optimizer arrived with the corrected FedProx client work (`tff_gma.learning.fed_prox`): a fedprox
# run whose config.json lacks it trained with TFF 0.87's proximal client work, whose term has the wrong sign.
_NOT_RESUMABLE_BEFORE_SETTING_EXISTED = (
    ('adaptive_optimizer', lambda saved: saved.get('algorithm') == 'fedprox',
     'its FedProx rounds were trained with TFF 0.87\'s proximal client work, whose term has the wrong sign (it pushes '
     'each client away from the server model; FedProx now pulls towards it), and cannot be continued with the '
     'corrected one: start the run again in a new --output_dir'),
    # scaffold: its clients honour --client_momentum since the same change as adaptive_optimizer; a run written
    # before trained with plain SGD whatever its client_momentum said.
    ('adaptive_optimizer', lambda saved: saved.get('algorithm') == 'scaffold' and saved.get('client_momentum') != 0,
     'its SCAFFOLD clients ignored --client_momentum (plain SGD) and now apply it, so it cannot be continued with the '
     'same settings: start the run again in a new --output_dir'),
)


def completed_config(saved: dict[str, Any]) -> dict[str, Any]:
  """A saved config's settings (config.json, a summary's `config`), with each setting it lacks at the value
  that run used: the setting's default then, which is today's default unless `_VALUE_BEFORE_SETTING_EXISTED`
  says otherwise."""
  before = {k: v(saved) if callable(v) else v for k, v in _VALUE_BEFORE_SETTING_EXISTED.items()}
  return {**dataclasses.asdict(config_lib.ExperimentConfig()), **before, **saved}


def check_not_superseded(output_dir: str, saved: dict[str, Any]) -> None:
  """Raises `ConfigError` (one line naming `output_dir` and why) if the run's saved settings (config.json, as
  written) date it to before a setting in `_NOT_RESUMABLE_BEFORE_SETTING_EXISTED` whose runs cannot resume."""
  for setting, applies, why in _NOT_RESUMABLE_BEFORE_SETTING_EXISTED:
    if setting not in saved and applies(saved):
      raise ConfigError(f'{output_dir} cannot resume: {why}')


def check_resumable(config: config_lib.ExperimentConfig) -> None:
  """Raises `ConfigError` if `config.output_dir` holds a run with other settings (its checkpoint would not fit),
  or a run already trained past `config.rounds`.

  Reads only: the directory is created, and config.json written, by `run` once every check has passed.
  """
  trained = max(checkpoints.saved_rounds(config.output_dir), default=0)
  if trained > config.rounds:
    raise ConfigError(
        f'rounds: {config.output_dir} holds a run trained to round {trained}; rounds={config.rounds} would '
        f'summarize only its first {config.rounds} rounds while its checkpoint stays at round {trained}. Pass '
        f'--rounds={trained} (or more, to continue it) to report it, or use another --output_dir')
  saved = _saved_settings(config.output_dir)
  if saved is None:
    return
  current = dataclasses.asdict(config)
  changed = sorted(k for k in current if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k])
  if changed:
    details = ', '.join(f'{k}: {saved.get(k)!r} -> {current[k]!r}' for k in changed)
    raise ConfigError(f'{config.output_dir} holds a run with other settings ({details}); use another '
                      f'--output_dir or the same flags to resume it')
  check_own_checkpoints(config)
  _note_last_bits(config, saved, trained)


def trajectory_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """The settings that determine a run's trajectory (those a resume may not change), as JSON values: what a
  checkpoint records of its run."""
  completed = completed_config(settings)
  return json.loads(json.dumps({k: v for k, v in completed.items() if k not in _RESUMABLE_CHANGES}))


def run_identity(output_dir: str, settings: dict[str, Any]) -> Optional[checkpoints.RunIdentity]:
  """The identity of the run in `output_dir` under `settings` (config.json's); None before its first start wrote
  its id. `CheckpointError` when its id file is damaged."""
  run = checkpoints.read_run_id(output_dir)
  if run is None:
    return None
  return checkpoints.RunIdentity(run['run_id'], trajectory_settings(settings), run['unrecorded_up_to'])


def _differences(recorded: dict[str, Any], ours: dict[str, Any]) -> list[str]:
  theirs = trajectory_settings(recorded)
  return [f'{k}: {theirs.get(k)!r} there, {ours[k]!r} here' for k in sorted(ours) if theirs.get(k) != ours[k]]


def check_own_checkpoints(config: config_lib.ExperimentConfig) -> None:
  """`CheckpointError` (one line naming the checkpoint and what differs) when a checkpoint of `config.output_dir`
  is recorded for another run, or for other settings. Checkpoints without a readable record are left to the resume
  (a save that never finished: it falls back past them). Reads only."""
  identity = run_identity(config.output_dir, dataclasses.asdict(config))
  ours = trajectory_settings(dataclasses.asdict(config))
  for round_num in checkpoints.saved_rounds(config.output_dir):
    record, _ = checkpoints.read_record(config.output_dir, round_num)
    if record is None:
      continue
    path = os.path.dirname(checkpoints.record_path(config.output_dir, round_num))
    same_settings = record['settings_digest'] == checkpoints.settings_digest(ours)
    differences = [] if same_settings else _differences(record['settings'], ours)
    if identity is None or record['run_id'] != identity.run_id or differences:
      raise checkpoints.CheckpointError(checkpoints.foreign_message(
          path, record['run_id'], identity.run_id if identity else None, differences))


def _saved_settings(output_dir: str) -> Optional[dict[str, Any]]:
  """The settings of the run in `output_dir` (`completed_config` of its config.json); None where it holds none.

  Raises `ConfigError` when checkpoints have no config.json, when config.json is damaged, or when the run cannot
  resume (`check_not_superseded`)."""
  path = os.path.join(output_dir, CONFIG_FILE)
  if not os.path.exists(path):
    if checkpoints.saved_rounds(output_dir):
      raise ConfigError(f'{output_dir} holds checkpoints but no {CONFIG_FILE}, so nothing says which settings '
                        f'they were trained with: resuming could continue another run under these flags. Use another '
                        f'--output_dir (or restore its {CONFIG_FILE})')
    return None
  try:
    saved = safe_files.read_json_object(path)
  except ValueError as e:
    raise ConfigError(f'{path} is damaged ({e}): it cannot say which settings the run was trained with; use another '
                      f'--output_dir') from None
  check_not_superseded(output_dir, saved)
  return completed_config(saved)


def _note_last_bits(config: config_lib.ExperimentConfig, saved: dict[str, Any], trained: int) -> None:
  """Logs once per run and setting a resume under a setting that changes the last bits of its rounds from here."""
  last_bits = ['worker_intra_op_threads'] if config.workers is None else []
  if config.client_execution == client_execution_lib.LOCAL:  # The local loops agree to float32 rounding only.
    last_bits.append('client_loop')
  for name in last_bits if 0 < trained < config.rounds else ():
    note = (config.output_dir, name, saved.get(name), getattr(config, name))
    if note[2] != note[3] and note not in _resume_notes:
      _resume_notes.add(note)
      logging.warning('%s: resumes with %s=%s (trained so far with %s): its rounds from here differ in the last '
                      'bits from an uninterrupted run\'s', config.output_dir, name, note[3], note[2])


_resume_notes: set[tuple[str, str, Any, Any]] = set()  # What check_resumable logged (it runs twice per run).
