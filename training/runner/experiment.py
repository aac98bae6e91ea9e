"""One federated experiment: data, model, learning process, rounds, evaluation, outputs and checkpoints.

`config_lib.ExperimentConfig` holds every setting (the runner maps its absl flags onto it); `run(config)` trains and
writes into `config.output_dir`:

* `metrics.csv`: one row per completed round (`tff.program.CSVFileReleaseManager`, keyed by round): the
  process's metrics, the aggregator's measurements, and the evaluations of the rounds that evaluate;
* TensorBoard event files (`tff.program.TensorBoardReleaseManager`) under `tensorboard/`;
* `checkpoints/`: the learning-process state after every round (`tff.program.FileProgramStateManager`);
* `summary.json`: final accuracy (mean over the last 10 evaluated rounds), best accuracy, rounds completed, where
  the clients trained (`client_execution`, and `client_devices`: this process's TensorFlow devices in `local`
  mode, the TFF worker's CPU in `worker` mode), the full resolved configuration;
* `accuracy.png`: accuracy and loss against rounds, of the round's clients (training) and of the test split.

Rerunning with the same output directory resumes after the last saved round (a larger `rounds` continues).
Every random choice is a function of (seed, round), so an interrupted and resumed run ends with exactly the
model of an uninterrupted one.

Corruption (`corruption`, `corrupt_fraction`; `training.engine.corruption`): a fixed, seeded set of
round(corrupt_fraction * num_clients) clients is corrupted for the whole run: their data poisoned before training
(`data_negate`, `data_flip_labels`), or their updates replaced inside the client work (`gaussian`; `omniscient`,
whose attack the simulation harness computes from the round's honest updates). Rows then carry
`corrupted_participants`. `algorithm='personalized'` is personalized RFA (`tff_gma.learning.personalized_rfa`;
with `aggregator='rfa'` the RFA paper's Algorithm 4): each client holds out `PERSONAL_TEST_FRACTION` of its
examples, its personal parameters are saved per round under `personal/` beside `checkpoints/` (SCAFFOLD's
control variates likewise under `control_variate/`), and evaluations add `personalized/*` (w + v_k on the
held-out examples) and `personalized/shared_*` (w alone on them).

`run` is a sequence of steps, each in the module of its job under `training.runner`: the checks
(`config_checks`, `resume_checks`), the lock (`dir_lock`), the data, model and method with the context that runs
them (`run_setup`), the settings written and the state resumed (`run_files`, `checkpoints`), the rounds with the
steps around each (`round_steps`, `round_loop`, `background`), the summary (`run_summary`). The names other code
uses stay importable from here.

Every method is built by the one registry, `training.engine.methods`. Settings are checked once, by `prepare` (which
`run` calls first), before anything is written: an invalid setting raises `ConfigError` naming it, and so does a
`rounds` below the rounds the directory's run has already trained (its summary would describe fewer rounds than
its checkpoint holds: pass at least those rounds to report or continue it).

A run holds its output directory exclusively (`training.runner.dir_lock`, taken once the checks have passed, released
on every exit): a second run into it fails at once with `dir_lock.DirectoryLockedError`, naming the directory
and the holder's pid; a lock left by a dead process is taken over. Resuming loads the newest checkpoint that loads
(`training.runner.checkpoints`): damaged newer ones are moved aside and the log says which round resumes and why; when
none loads, `checkpoints.CheckpointError` names the damaged paths. Rows of `metrics.csv` after the resumed round
are dropped, so the file always matches the checkpoint.

A round in which every client was dropped as non-finite (a diverging run) logs one warning line and its row has
`all_clients_dropped` = 1 (0 otherwise); see `all_clients_dropped`.

Validation split for tuning (`validation_fraction` > 0): every training client holds out floor(fraction * n) of its
examples (`evaluation.hold_out`, seeded by `seed`; taken from the clean data, before any data corruption poisons
the rest) and trains on the rest. The evaluated rounds then evaluate the global model on the pooled held-out
examples as `validation/loss`, `validation/accuracy`, and never on the test split or the OOD test clients: the run
drops them from its data right after loading, and refuses `membership_inference` (whose non-members are the test
split) and `algorithm='personalized'` (which holds out its own examples). summary.json then has
`final_validation_accuracy` (mean over the last 10 evaluated rounds) and `best_validation_accuracy`, and its
`final_accuracy` and `best_accuracy` are null (present, so readers of either mode find the keys);
`accuracy.png` plots the validation accuracy and loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from absl import logging
import tensorflow as tf
import tensorflow_federated as tff

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

# What the run's steps define, importable from here as before (the studies, the runner and the tests read them here).
TrainingStopped = errors.TrainingStopped
ConfigError = errors.ConfigError
# The output directory refuses the run (raised by `run` after the settings' checks, before training):
UnsafeOutputError = errors.UnsafeOutputError  # Writable by other users, or a link planted at an output's name.
DirectoryLockedError = errors.DirectoryLockedError  # Another run holds it (names the directory and the pid).
CheckpointError = errors.CheckpointError  # Checkpoints exist and none loads (names the damaged paths).
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


def _run_locked(config: config_lib.ExperimentConfig, show_progress: bool,
                on_round: Optional[Callable[[int, Any], None]]) -> RunResult:
  """The run's steps, under its directory's lock: only once the setup is built and its context ready is anything
  but the lock written."""
  setup = run_setup.build_checked_setup(config)
  run_setup.install_context(config, setup.process)
  run_files.write_settings(config, setup.process)
  state_manager = run_files.open_state_manager(config.output_dir)
  state, start_round = run_files.start_state(config, setup, state_manager)
  writers = run_files.open_writers(config.output_dir, state_manager, start_round)
  training = round_steps.start_training(config, setup, writers, show_progress=show_progress, on_round=on_round)
  trained = round_steps.train(training, state, start_round)
  summary = run_summary.write_summary(config, setup, trained)
  if trained.stopped is not None:
    raise trained.stopped
  return RunResult(summary, setup.process.get_model_weights(trained.state))
