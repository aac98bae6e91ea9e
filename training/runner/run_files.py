"""A run's files as its rounds begin: its settings written, the state it starts from, and its rounds' writers.

Written only once every check has passed: config.json (and audit.md with `audit`), then the state: the newest
checkpoint that loads (`checkpoints.resume`), else the seeded initial state, saved as round 0. metrics.csv is then
cut back to that state's round (the rows after it belong to rounds that run again), and the writers of the rounds
opened: checkpoints (`tff.program.FileProgramStateManager`), metrics.csv and TensorBoard (`tff.program` releases).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
from typing import Any, Optional

from absl import logging
import tensorflow as tf
import tensorflow_federated as tff

from training import config as config_lib
from training import safe_files
from training.engine import methods
from training.runner import checkpoints
from training.runner import resume_checks
from training.runner import round_loop
from training.runner import run_setup

METRICS_FILE = checkpoints.METRICS_FILE


def run_async(coro):
  """Runs a `tff.program` coroutine (a save, a release) to its end."""
  return asyncio.run(coro)


def write_settings(config: config_lib.ExperimentConfig, process: tff.learning.templates.LearningProcess) -> None:
  """config.json (the resume guard), and audit.md (the privacy audit of `process`) when `config.audit` says so.

  Atomically (a temporary file renamed over it): an interrupted write leaves the old config.json or the new one,
  never a half that refuses the resume. First the run's id (at its first start; kept after), which its
  checkpoints record."""
  checkpoints.start_run_id(config.output_dir)
  safe_files.write_atomic(os.path.join(config.output_dir, resume_checks.CONFIG_FILE),
                          json.dumps(dataclasses.asdict(config), indent=2))
  if config.audit:
    from tff_gma import audit  # pylint: disable=g-import-not-at-top
    report = audit.audit_computation(process)
    safe_files.write_atomic(os.path.join(config.output_dir, 'audit.md'), report.to_markdown())


@dataclasses.dataclass(frozen=True)
class Writers:
  """Where a run's rounds go: the state's checkpoints, the metrics rows (metrics.csv and TensorBoard)."""
  state_manager: tff.program.FileProgramStateManager
  csv_path: str
  csv_release: tff.program.CSVFileReleaseManager
  tensorboard_release: tff.program.TensorBoardReleaseManager
  identity: Optional[checkpoints.RunIdentity] = None  # What each checkpoint records (None: a run without an id).

  def write_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
    """Releases each (round, row) to metrics.csv (replacing that round's row and those after it) and TensorBoard."""
    try:
      for number, row in rows:
        run_async(self.csv_release.release(row, number))
        run_async(self.tensorboard_release.release(row, number))
    except (OSError, tf.errors.OpError) as e:
      _raise_if_moved_away(os.path.dirname(self.csv_path), e)
      raise

  def save(self, state: Any, round_num: int) -> None:
    """Saves the learning-process state of round `round_num` as its checkpoint, then its record of the run."""
    save_checkpoint(self.state_manager, self.csv_path, state, round_num, self.identity)


def save_checkpoint(state_manager: tff.program.FileProgramStateManager, csv_path: str, state: Any, round_num: int,
                    identity: Optional[checkpoints.RunIdentity]) -> None:
  """The state, then its record (`checkpoints.write_record`): a kill in between leaves a checkpoint without one,
  which the resume falls back past as a save that never finished."""
  output_dir = os.path.dirname(csv_path)
  try:
    run_async(state_manager.save(state, round_num))
    if identity is not None:
      checkpoints.write_record(output_dir, round_num, identity)
  except tf.errors.OpError as e:
    _raise_if_moved_away(output_dir, e)
    os_error = safe_files.os_error_of(e)
    if os_error is None:
      raise
    raise os_error from e
  except OSError as e:
    _raise_if_moved_away(output_dir, e)
    raise


def _raise_if_moved_away(output_dir: str, error: BaseException) -> None:
  """When a write failed because the output directory itself is gone (moved or removed under the run), says that,
  naming the directory, rather than the file it was writing (which only looks missing)."""
  if not os.path.isdir(output_dir):
    raise OutputDirectoryGone(errno.ENOENT, 'the output directory was moved or removed during the run',
                              output_dir) from error


class OutputDirectoryGone(FileNotFoundError):
  """The run's output directory was moved or removed under it (the message names it)."""


def identity_of(output_dir: str) -> Optional[checkpoints.RunIdentity]:
  """The run's identity from its files (its id and config.json, as this start wrote them); None without both."""
  config_path = os.path.join(output_dir, resume_checks.CONFIG_FILE)
  if not os.path.exists(config_path):
    return None
  return resume_checks.run_identity(output_dir, safe_files.read_json_object(config_path))


def open_state_manager(output_dir: str) -> tff.program.FileProgramStateManager:
  """The run's checkpoints, without the saves that never finished (one log line each)."""
  state_manager = tff.program.FileProgramStateManager(checkpoints.checkpoint_dir(output_dir),
                                                      keep_total=methods.KEEP_CHECKPOINTS)
  for path in checkpoints.remove_partial_saves(output_dir):
    logging.warning('%s: removed %s, a checkpoint whose save never finished', output_dir, path)
  return state_manager


def start_state(config: config_lib.ExperimentConfig, setup: run_setup.Setup,
                state_manager: tff.program.FileProgramStateManager) -> tuple[Any, int]:
  """The state the rounds start from and its round: the newest checkpoint that loads (with its clients' values;
  the log says why when it is not the newest), else the seeded initial state, saved as round 0."""
  initial_state = round_loop.seeded_initial_state(setup.process, setup.build_keras, config.seed)
  identity = resume_checks.run_identity(config.output_dir, dataclasses.asdict(config))
  resumed = checkpoints.resume(state_manager, config.output_dir, initial_state,
                               lambda r: setup.method.restore_client_state(config.output_dir, r), identity)
  if resumed.message():
    logging.warning('%s: %s', config.output_dir, resumed.message())
  if resumed.state is None:
    save_checkpoint(state_manager, os.path.join(config.output_dir, METRICS_FILE), initial_state, 0, identity)
    return initial_state, 0
  return resumed.state, resumed.round_num


def open_writers(output_dir: str, state_manager: tff.program.FileProgramStateManager, start_round: int) -> Writers:
  """The rounds' writers, metrics.csv first cut back to `start_round` (its unfinished releases removed, a row cut
  while written dropped, the rows after `start_round` dropped: of another timeline)."""
  csv_path = os.path.join(output_dir, METRICS_FILE)
  for path in checkpoints.remove_partial_releases(csv_path):
    logging.warning('%s: removed %s, a metrics.csv release that never finished', output_dir, path)
  if checkpoints.drop_partial_row(csv_path):
    logging.warning('%s: dropped the last row of metrics.csv, cut while it was written', output_dir)
  checkpoints.truncate_rows(csv_path, 'round', start_round)
  return Writers(state_manager, csv_path, tff.program.CSVFileReleaseManager(csv_path, key_fieldname='round'),
                 tff.program.TensorBoardReleaseManager(os.path.join(output_dir, 'tensorboard')),
                 identity_of(output_dir))
