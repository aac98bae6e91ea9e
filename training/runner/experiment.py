"""One federated experiment: `run(config)` trains an `ExperimentConfig` and writes its outputs into `output_dir`.

metrics.csv, TensorBoard, checkpoints/, summary.json, accuracy.png; rerunning resumes to exactly the model of an
uninterrupted run. `run` is named steps, each in the module of its job under `training.runner`; names other code
uses stay importable from here. Outputs, steps, corruption, personalized RFA, validation split:
docs/experiments.md#one-run-step-by-step"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Optional

from absl import logging
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import context_check
from training import config as config_lib
from training import safe_files
from training.runner import checkpoints
from training.runner import config_checks
from training.runner import dir_lock
from training.runner import errors
from training.runner import resume_checks
from training.runner import round_steps
from training.runner import run_files
from training.runner import run_setup
from training.runner import run_summary
from training.runner import worker_deadline

# What the run's steps define, importable from here as before (the studies, the runner and the tests read them here).
TrainingStopped = errors.TrainingStopped
ConfigError = errors.ConfigError
# The output directory refuses the run (raised by `run` after the settings' checks, before training):
UnsafeOutputError = errors.UnsafeOutputError  # Writable by other users, or a link planted at an output's name.
DirectoryLockedError = errors.DirectoryLockedError  # Another run holds it (names the directory and the pid).
CheckpointError = errors.CheckpointError  # Checkpoints exist and none loads (names the damaged paths).
WorkerUnresponsive = worker_deadline.WorkerUnresponsive  # A call into the workers passed its deadline.
LAST_EVALS_FOR_FINAL = run_summary.LAST_EVALS_FOR_FINAL
PERSONAL_TEST_FRACTION = run_setup.PERSONAL_TEST_FRACTION
NON_FINITE_ROUNDS_TO_STOP = round_steps.NON_FINITE_ROUNDS_TO_STOP
CONFIG_FILE = resume_checks.CONFIG_FILE
MAX_SEED = config_checks.MAX_SEED
validate = config_checks.validate
completed_config = resume_checks.completed_config
check_not_superseded = resume_checks.check_not_superseded
check_resumable = resume_checks.check_resumable
Setup = run_setup.Setup
build_setup = run_setup.build_setup
client_loop_used = run_setup.client_loop_used
place_datasets = run_setup.place_datasets
evaluate_weights = round_steps.evaluate_weights
all_clients_dropped = round_steps.all_clients_dropped
_read_rows = run_summary.read_rows
_plot_figure = run_summary.plot_figure
_plot = run_summary.write_plot


def prepare(config: config_lib.ExperimentConfig) -> None:
  """Every check of a run, before anything is written: the settings, then the output directory's."""
  validate(config)
  safe_files.check_output_dir(config.output_dir)  # Nobody else can plant a link the run would write through.
  check_resumable(config)
  checkpoints.check_resume_files(config.output_dir)  # checkpoints/ a directory, metrics.csv readable: one line.


@dataclasses.dataclass(frozen=True)
class RunResult:
  summary: dict[str, Any]  # As written to summary.json.
  model_weights: tff.learning.models.ModelWeights  # The final global model.


def run(config: config_lib.ExperimentConfig, *, show_progress: bool = True,
        on_round: Optional[Callable[[int, Any], None]] = None) -> RunResult:
  """Trains (or resumes) the experiment; returns the summary (also written to summary.json) and the final model.

  Raises `ConfigError` before anything is written when a setting is invalid; then holds `config.output_dir`
  exclusively until it returns or raises (`DirectoryLockedError` at once if another run holds it);
  `CheckpointError` if the directory's checkpoints exist and none loads; `OSError` when a write fails under it (a
  full or read-only disk; TensorFlow's own file errors too, which TFF's checkpoints and releases raise as
  `tf.errors.OpError`). `on_round(round_num, state)` is called
  after each round (after its checkpoint, on a round that saves one; tests use it to interrupt).

  The state is saved, and the rounds' metrics rows written, after every `config.checkpoint_every`-th round and
  after the last (the rows also when training stops): what an interruption costs, never what the run computes. A
  resumed run re-runs the rounds after its newest checkpoint (dropping any rows of theirs first), so a run killed
  at any point loses at most `checkpoint_every` rounds and ends bit-identical to an uninterrupted one.
  """
  prepare(config)
  with dir_lock.DirectoryLock(config.output_dir) as lock:
    if lock.stale_holder:
      logging.warning('%s: took over the lock left by %s, which ended without releasing it',
                      config.output_dir, lock.stale_holder)
    # Again under the lock: another run may have written into the directory since `prepare` read it.
    check_resumable(config)
    try:
      return _run_locked(config, show_progress, on_round)
    except tf.errors.OpError as e:  # A write through TensorFlow (TFF's checkpoints and releases) that failed.
      os_error = safe_files.os_error_of(e)
      if os_error is None:
        raise
      raise os_error from e


def build_setup_quietly(config: config_lib.ExperimentConfig) -> run_setup.Setup:
  """`run_setup.build_checked_setup`, without the library's build-time `SecureSumContextWarning`: the runner installs
  its context next and `check_context_runs` refuses in one line a context that cannot run the process."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', context_check.SecureSumContextWarning)
    return run_setup.build_checked_setup(config)


def _run_locked(config: config_lib.ExperimentConfig, show_progress: bool,
                on_round: Optional[Callable[[int, Any], None]]) -> RunResult:
  """The run's steps, under its directory's lock: only once the setup is built and its context ready is anything
  but the lock written."""
  setup = build_setup_quietly(config)
  targets = run_setup.install_context(config, setup.process)
  deadline = worker_deadline.WorkerDeadline(worker_deadline.settings_of(config), targets)
  run_files.write_settings(config, setup.process)
  state_manager = run_files.open_state_manager(config.output_dir)
  state, start_round = deadline.call('the initial state', lambda: run_files.start_state(config, setup, state_manager),
                                     round_time=False)
  writers = run_files.open_writers(config.output_dir, state_manager, start_round)
  training = round_steps.start_training(config, setup, writers, show_progress=show_progress, on_round=on_round,
                                        deadline=deadline)
  trained = round_steps.train(training, state, start_round)
  summary = run_summary.write_summary(config, setup, trained)
  if trained.stopped is not None:
    raise trained.stopped
  return RunResult(summary, setup.process.get_model_weights(trained.state))
