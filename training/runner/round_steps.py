"""A run's rounds: the one round loop (`round_loop.RoundLoop`) with the runner's steps around each round.

The steps are functions of the round and of `Training` (what the rounds share), run after each round in the order
`AFTER_ROUND` lists; evaluation, rows and checkpoint run beside the next round where they may (`background`).
Their order: docs/experiments.md#the-round-loop-and-the-steps-around-each-round"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any, Optional

from absl import logging
import numpy as np
import tensorflow_federated as tff

from training import config as config_lib
from training.engine import client_execution as client_execution_lib
from training.engine import corruption as corruption_lib
from training.engine import registry
from training.engine import rfa_weights
from training.engine import worker_datasets
from training.runner import background
from training.runner import frozen_model
from training.runner import progress
from training.runner import round_loop
from training.runner import run_files
from training.runner import run_setup
from training.runner import worker_deadline
from training.runner.errors import TrainingStopped

NON_FINITE_ROUNDS_TO_STOP = 5  # Rounds in a row whose server update was rejected as non-finite before a run stops.


@dataclasses.dataclass
class Training:
  """What a run's rounds share: built before the first round (`start_training`), updated by the steps after each."""
  config: config_lib.ExperimentConfig
  setup: run_setup.Setup
  writers: run_files.Writers
  work: background.AfterRoundWork  # The evaluations, rows and checkpoints, beside the next round where they may be.
  monitor: Optional[rfa_weights.RfaWeightMonitor] = None  # The RFA weight audit (`rfa_weight_bound`).
  bar: Optional[progress.RoundProgress] = None
  on_round: Optional[Callable[[int, Any], None]] = None  # The caller's hook, after each round's work.
  unreleased: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)  # Since the last save.
  non_finite_in_a_row: int = 0  # Rounds in a row whose server update was rejected as non-finite.
  frozen: Optional[frozen_model.FrozenModel] = None  # The weights' watch (`watch_model`; None: max_frozen_rounds=0).
  train_seconds: float = 0.0  # The method's rounds' own time (client training and aggregation).
  deadline: Optional[worker_deadline.WorkerDeadline] = None  # Bounds each round's wait on the workers.


def start_training(config: config_lib.ExperimentConfig, setup: run_setup.Setup, writers: run_files.Writers, *,
                   show_progress: bool, on_round: Optional[Callable[[int, Any], None]],
                   deadline: Optional[worker_deadline.WorkerDeadline] = None) -> Training:
  """The rounds' shared state: the RFA weight audit where asked, the progress bar, the after-round work (beside the
  next round unless that work reads what the next round changes, the clients' own values, or the next round trains
  in this process too)."""
  monitor = None
  if config.rfa_weight_bound is not None:  # Simulation harness only: it replays RFA on the round's updates.
    one_step = registry.aggregator(config.aggregator).weight_replay == registry.ONE_STEP
    monitor = rfa_weights.RfaWeightMonitor(
        setup.model_fn, config.algorithm_config(), config.rfa_weight_bound,
        rfa_weights.RfaSettings(num_passes=1 if one_step else config.num_passes, smoothing=config.smoothing,
                                one_step=one_step, secure=config.secure, value_bound=config.secure_bound,
                                init=None if one_step else config.rfa_init))
  bar = progress.RoundProgress(config.rounds, label=f'{config.algorithm}/{config.aggregator}') \
      if show_progress else None
  work = background.AfterRoundWork(
      background=setup.method.client_state is None and setup.method.client_execution == client_execution_lib.WORKER)
  return Training(config, setup, writers, work, monitor, bar, on_round, deadline=deadline)


def audit_weights(training: Training, round_num: int, state: Any, participants: list[str], datasets: list
                  ) -> dict[str, float]:
  """Before the round: the RFA weight audit's row entries (none without the audit)."""
  del round_num
  if training.monitor is None:
    return {}
  weights = training.setup.process.get_model_weights(state)
  return rfa_weights.report_metrics(training.monitor(weights, datasets, participants))


def count_training(training: Training, done: round_loop.Round) -> None:
  training.train_seconds += done.seconds


def stop_if_non_finite(training: Training, done: round_loop.Round) -> None:
  """Raises `TrainingStopped` after `NON_FINITE_ROUNDS_TO_STOP` rounds in a row whose server update the finalizer
  rejected as non-finite: the model stays where it was, so the run cannot recover."""
  rejected = any(k.endswith('update_non_finite') and v > 0 for k, v in done.row.items())
  training.non_finite_in_a_row = training.non_finite_in_a_row + 1 if rejected else 0
  if training.non_finite_in_a_row >= NON_FINITE_ROUNDS_TO_STOP:
    config = training.config
    raise TrainingStopped(
        f'stopped after round {done.number} of {config.rounds}: the server update was non-finite in '
        f'{NON_FINITE_ROUNDS_TO_STOP} rounds in a row (finalizer/update_non_finite = 1), so the model no longer '
        f'moves. Likely cause: a setting too large for this model (--client_lr={config.client_lr:g}, '
        f'--server_lr={config.server_lr:g}, --proximal_strength={config.proximal_strength:g}, '
        f'--adaptive_epsilon={config.adaptive_epsilon:g}) or every client dropped as non-finite')


def trainable_weights(training: Training, state: Any) -> list:
  """The trainable weights of `state`'s model: read off a TFF learning state's `global_model_weights` (what its
  `get_model_weights` returns) where it has one, since a TFF call costs a noticeable part of a small round; else
  through `get_model_weights`."""
  weights = getattr(state, 'global_model_weights', None)
  if not isinstance(weights, tff.learning.models.ModelWeights):
    weights = training.setup.process.get_model_weights(state)
  return list(weights.trainable)


def watch_model(training: Training, state: Any, start_round: int) -> None:
  """Before the first round: the watch of the weights (`stop_if_frozen`) from those of `state`, the state of round
  `start_round`, counting on the unchanged rounds its metrics.csv row records (a resumed run stops where it would
  have stopped uninterrupted)."""
  config = training.config
  if config.max_frozen_rounds == 0:
    return
  unchanged = frozen_model.resumed_unchanged(os.path.join(config.output_dir, run_files.METRICS_FILE), start_round)
  training.frozen = frozen_model.FrozenModel(trainable_weights(training, state), unchanged)


def stop_if_frozen(training: Training, done: round_loop.Round) -> None:
  """A round whose trainable weights are bit for bit the round before's, or whose aggregator flags no update
  (`frozen_model.aggregator_returned_no_update`), gets `frozen_model.COLUMN` in its row (the rounds in a row so
  far); `TrainingStopped` once they reach `max_frozen_rounds`: the run trains nothing. After `mark_dropped_clients`,
  whose entry says why; before the evaluation and the rows, as the non-finite stop."""
  if training.frozen is None:
    return
  unchanged = training.frozen.update(trainable_weights(training, done.state),
                                     frozen_model.aggregator_returned_no_update(done.row))
  if unchanged == 0:
    return
  done.row[frozen_model.COLUMN] = float(unchanged)
  if unchanged >= training.config.max_frozen_rounds:
    raise TrainingStopped(frozen_model.stop_message(training.config, done.number, unchanged,
                                                    done.row.get('all_clients_dropped') == 1))


def mark_dropped_clients(training: Training, done: round_loop.Round) -> None:
  """The row's `all_clients_dropped` (1 when no client's update counted, with one warning line; else 0)."""
  dropped_all = all_clients_dropped(done.row, len(done.participants))
  done.row['all_clients_dropped'] = float(dropped_all is not None)
  if dropped_all is not None:
    logging.warning('round %d of %d: every client was dropped as non-finite (%s); no client update counted. A '
                    'diverging run? Try a smaller --client_lr or --server_lr.', done.number, training.config.rounds,
                    dropped_all)


def count_corrupted(training: Training, done: round_loop.Round) -> None:
  """The row's `corrupted_participants`, in a run with corruption."""
  if training.config.corruption != corruption_lib.NONE:
    done.row['corrupted_participants'] = float(sum(c in training.setup.corrupted for c in done.participants))


def evaluate_round(training: Training, done: round_loop.Round) -> None:
  """The round's evaluation joins its row, where `round_loop.evaluation_due` says so (submitted to the after-round
  work; a failed evaluation or write of an earlier round is raised here first)."""
  config, setup, work = training.config, training.setup, training.work
  work.check()
  if round_loop.evaluation_due(done.number, config.eval_every, config.rounds, config.eval_last_rounds):
    weights, participants, row = setup.process.get_model_weights(done.state), done.participants, done.row
    work.submit('evaluate', lambda: row.update(evaluate_weights(setup, weights, participants)))


def keep_up(training: Training, done: round_loop.Round) -> None:
  """Before the round is reported done: the previous checkpoint's save (and the work before it) has finished, so a
  run killed at any moment loses at most `checkpoint_every` rounds, as one whose work ran in turn. Work queued
  without this bound fell further behind every round where it took longer than the round itself. That save still
  overlaps the round after it, and the evaluations between checkpoints overlap their rounds."""
  del done
  training.work.wait_for_last('release_and_checkpoint')


def release_and_save(training: Training, done: round_loop.Round) -> None:
  """Every `checkpoint_every` rounds and after the last: the rows since the last save, then the checkpoint."""
  config = training.config
  training.unreleased.append((done.number, done.row))
  if done.number % config.checkpoint_every == 0 or done.number == config.rounds:
    rows, number, state = list(training.unreleased), done.number, done.state
    training.unreleased.clear()

    def save() -> None:
      # The rows before the checkpoint: a crash in between re-runs their rounds on resume, and the CSV release
      # of a round replaces its row (it drops rows with keys >= the released key). Then the clients' values
      # before the server state: every saved state has its clients' values (SCAFFOLD, personalized RFA).
      training.writers.write_rows(rows)
      training.setup.method.checkpoint_client_state(config.output_dir, number)
      training.writers.save(state, number)

    training.work.submit('release_and_checkpoint', save)


def report_round(training: Training, done: round_loop.Round) -> None:
  """The progress bar; then the caller's `on_round`, once the round's work is done (as if it had run in turn:
  tests interrupt here, after a checkpoint)."""
  if training.bar is not None:
    key = training.setup.accuracy_key
    training.bar.update(done.number, **({'acc': done.row[key]} if key in done.row else {}))
  if training.on_round is not None:
    training.work.wait()
    training.on_round(done.number, done.state)


# The steps after each round, in order: each may add to the row before the next sees it.
AFTER_ROUND = (count_training, stop_if_non_finite, mark_dropped_clients, count_corrupted, stop_if_frozen,
               evaluate_round, keep_up, release_and_save, report_round)


@dataclasses.dataclass(frozen=True)
class Trained:
  """What the rounds left: the state, and what the summary reports of them."""
  state: Any  # The state after the last round run.
  rounds_run: int  # By this run (not those of the checkpoint it resumed from).
  seconds: dict[str, float]  # train, evaluate, release_and_checkpoint (their own time), waited (the rounds' wait).
  dataset_placement: str  # Where the clients' datasets were built (`worker_datasets.WORKER` or `DRIVER`).
  started: float  # `time.monotonic()` as the rounds began.
  process_age: Optional[float]  # The process's age then (`process_age`).
  non_finite_in_a_row: int  # At the end.
  stopped: Optional[TrainingStopped] = None  # Why the rounds stopped before the last, if they did.


def train(training: Training, state: Any, start_round: int) -> Trained:
  """Runs the rounds after `start_round` up to `config.rounds` from `state`, each with the steps around it.

  When a step stops the run (`TrainingStopped`), the rows of the rounds it ran are still written. On any exit the
  after-round task in progress finishes (a checkpoint is whole or absent) and the rest is dropped."""
  config, setup = training.config, training.setup
  inputs = round_loop.ClientInputs(setup.data.train, config.clients_per_round, config.local_epochs, config.batch_size,
                                   config.seed)
  watch_model(training, state, start_round)
  placement = run_setup.place_datasets(setup.method, inputs)
  loop = round_loop.RoundLoop(setup.method, state, inputs, round_num=start_round,
                              before_round=functools.partial(audit_weights, training),
                              after_round=[functools.partial(step, training) for step in AFTER_ROUND],
                              run_round=_run_round_within_deadline(training))
  started = time.monotonic()
  age = process_age()  # From the process's start to the first round (a one-run process's start-up).
  stopped = None
  try:
    try:
      state = loop.run(config.rounds)
    except TrainingStopped as e:
      stopped, state = e, loop.state
      rows = list(training.unreleased)  # The rounds it ran.
      training.work.submit('release_and_checkpoint', lambda: training.writers.write_rows(rows))
    training.work.wait()
  finally:
    training.work.close()
    if placement is not None:
      placement.close()
  work = training.work
  seconds = {'train': training.train_seconds, 'evaluate': work.seconds['evaluate'],
             'release_and_checkpoint': work.seconds['release_and_checkpoint'], 'waited': work.waited}
  return Trained(state, loop.round_num - start_round, seconds,
                 worker_datasets.DRIVER if placement is None else worker_datasets.WORKER, started, age,
                 training.non_finite_in_a_row, stopped)


def _run_round_within_deadline(training: Training) -> Optional[round_loop.RunRound]:
  """The method's round within `training.deadline` (`WorkerUnresponsive` past it), or None: the method's own."""
  if training.deadline is None:
    return None
  method, deadline = training.setup.method, training.deadline
  return lambda state, participants, datasets, number: deadline.call(
      f'round {number}', lambda: method.run_round(state, participants, datasets, number))


def process_age() -> Optional[float]:
  """Seconds since this process started (Linux's /proc; None where there is none). Not psutil's `create_time`:
  that adds the start to the boot time in whole seconds, and this is to the clock tick."""
  try:
    with open('/proc/self/stat') as f:
      start_ticks = int(f.read().rpartition(')')[2].split()[19])  # Field 22, starttime, after the command name.
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None
  return uptime - start_ticks / os.sysconf('SC_CLK_TCK')


def _pooled(data, client_ids):
  xs, ys = zip(*(data.train.client_arrays(c) for c in client_ids))
  return np.concatenate(xs), np.concatenate(ys)


def evaluate_weights(setup: run_setup.Setup, weights: tff.learning.models.ModelWeights, participants: list[str]
                     ) -> dict[str, float]:
  """The model `weights` on the central test split (the validation split instead, in a validation run), on the OOD
  clients where the partition has them, and on this round's participants vs the rest. No TFF call: it may run
  beside the next round (`training.runner.background`)."""
  central = 'validation' if setup.validation is not None else 'test'
  out = {f'{central}/{k}': v for k, v in setup.evaluator(weights).items()}
  if setup.data.ood_test is not None:
    ood = setup.evaluator.evaluate_arrays(weights, setup.data.ood_test_x, setup.data.ood_test_y)
    out.update({f'ood_test/{k}': v for k, v in ood.items()})
  out.update(setup.method.evaluate_clients(setup.evaluator, weights))
  others = [c for c in setup.data.train.client_ids if c not in set(participants)]
  # GMA paper Table 4: the global model on participating vs non-participating clients' data.
  if others and setup.participation_eval:
    for name, ids in (('participating', participants), ('non_participating', others)):
      metrics = setup.evaluator.evaluate_arrays(weights, *_pooled(setup.data, ids))
      out.update({f'{name}/{k}': v for k, v in metrics.items()})
  return out


def all_clients_dropped(row: dict[str, float], num_clients: int) -> Optional[str]:
  """Why the round whose flattened metrics are `row` counted no client's update, or None if some counted.

  Clients are dropped as non-finite in two places, and the signals differ:
  * TFF's model-delta client work (and `tff_gma.learning`'s, `client_lib.finish_client_update`) zero a client's
    non-finite update, give it weight 0 and reset its metrics; an aggregator then sees a finite zero update of
    weight 0, and does not count it as participating;
  * `tff_gma`'s aggregators drop what still reaches them non-finite (an update corruption, a non-finite weight).
  So a round dropped every client when its aggregator reports `participating_clients` = 0 (GMA, RFA, FedGMA's
  mask, the robust baselines), or `dropped_clients` equal to the round's clients. Aggregators without these
  measurements (TFF's `MeanFactory` behind mean, clip_mean and zeroing_mean; elastic, which reports only
  `dropped_clients`; SCAFFOLD's client work counts clients that ran, not finite ones): the client work's
  `train/num_examples` is 0, since it counts only the examples of the clients whose metrics were kept, i.e. the
  update weight sum under example weighting. (With the mean, the 0/0 aggregate is then non-finite and the
  server's finalizer skips it: `finalizer/update_non_finite` = 1.)
  """
  if num_clients < 1:
    return None
  aggregator = {k: v for k, v in row.items() if k.startswith('aggregator/')}
  for key, value in sorted(aggregator.items()):
    if key.endswith('/participating_clients') and value == 0:
      dropped = [v for k, v in aggregator.items() if k.endswith('/dropped_clients')]
      return (f'{key} = 0 of {num_clients} clients' + (f', dropped_clients = {dropped[0]:g}' if dropped else ''))
  for key, value in sorted(aggregator.items()):
    if key.endswith('/dropped_clients') and value >= num_clients:
      return f'{key} = {value:g} of {num_clients} clients'
  if not any(k.endswith('/participating_clients') for k in aggregator):
    examples = row.get('client_work/train/num_examples')
    if examples is not None and examples == 0:
      return f'client_work/train/num_examples = 0 over {num_clients} clients: every update had weight 0'
  return None
