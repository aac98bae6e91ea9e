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

import asyncio
import dataclasses
import io
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, Optional

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma import models
from tff_gma import runtime
from tff_gma.data import idx
from tff_gma.data import loaders
from training import config as config_lib
from training import safe_files
from training.engine import client_execution as client_execution_lib
from training.engine import corruption as corruption_lib
from training.engine import evaluation
from training.engine import fedavg_family
from training.engine import membership_attack
from training.engine import methods
from training.engine import registry
from training.engine import rfa_weights
from training.engine import worker_datasets
from training.runner import background
from training.runner import checkpoints
from training.runner import dir_lock
from training.runner import progress
from training.runner import round_loop

LAST_EVALS_FOR_FINAL = 10  # "Final" figure: mean over the last 10 evaluated rounds (GMA paper).
PERSONAL_TEST_FRACTION = 0.2  # Personalized RFA: share of each client's examples held out to evaluate it.


NON_FINITE_ROUNDS_TO_STOP = 5  # Rounds in a row whose server update was rejected as non-finite before a run stops.
CONFIG_FILE = 'config.json'  # The run's settings: written once every check passed, the resume guard after that.
MAX_SEED = 2**32 - 1


class TrainingStopped(RuntimeError):
  """The run stopped before its last round because it cannot recover (the message says why); its summary.json
  is written, with `stopped` saying the same."""


class ConfigError(ValueError):
  """A setting is unknown or inconsistent (the message names it); raised before anything is written."""


# The output directory refuses the run (raised by `run` after the settings' checks, before training):
UnsafeOutputError = safe_files.UnsafeOutputError  # Writable by other users, or a link planted at an output's name.
DirectoryLockedError = dir_lock.DirectoryLockedError  # Another run holds it (names the directory and the pid).
CheckpointError = checkpoints.CheckpointError  # Checkpoints exist and none loads (names the damaged paths).


def validate(config: config_lib.ExperimentConfig) -> None:
  """Raises `ConfigError` naming the setting when something is unknown or inconsistent (nothing is written)."""
  try:
    _check(config)
  except ConfigError:
    raise
  except ValueError as e:  # The library's own argument checks name the argument too.
    raise ConfigError(str(e)) from None


def _check(config: config_lib.ExperimentConfig) -> None:
  loaders.check_config(config.dataset, config.partition, fashion_mnist_source=config.fashion_mnist_source)
  if config.model not in models.MODELS:
    raise ConfigError(f'model: unknown model {config.model!r}; expected one of {models.MODELS}')
  registry.check(config.algorithm, config.aggregator, config.corruption, config.client_execution, config.workers)
  if config.dataset_placement not in worker_datasets.PLACEMENTS:
    raise ConfigError(f'dataset_placement: unknown placement {config.dataset_placement!r}; expected one of '
                      f'{worker_datasets.PLACEMENTS}')
  try:
    runtime.intra_op_threads(config.worker_intra_op_threads)
  except ValueError as e:
    raise ConfigError(f'worker_{e}') from None  # runtime names it intra_op_threads.
  if config.workers is not None:
    targets = [t for t in config.workers.split(',') if t]
    host_port = lambda t: t.rpartition(':')[0] and t.rpartition(':')[2].isdigit()
    if not targets or not all(host_port(t) or t.startswith('unix:/') for t in targets):
      raise ConfigError(f'workers must be host:port or unix:/path[,...], got {config.workers!r}')
  # The method settings check their own values where their dataclasses are built (training.config), once.
  for build_part in (config.algorithm_config, config.aggregator_params, config.method_params):
    build_part()
  positive_ints = ('num_clients', 'clients_per_round', 'rounds', 'local_epochs', 'batch_size', 'eval_every',
                   'classes_per_client', 'checkpoint_every')
  for name in positive_ints:
    try:
      checks.check_positive_int(getattr(config, name), name)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  try:  # Before the finite-floats check, so that NaN gets the interval too.
    loaders.check_train_subset(config.dataset, config.partition, config.train_subset_fraction)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  last = config.eval_last_rounds
  if isinstance(last, bool) or not isinstance(last, (int, np.integer)) or last < 0:
    raise ConfigError(f'eval_last_rounds must be an integer >= 0, got {last!r}')
  if not isinstance(config.seed, (int, np.integer)) or not 0 <= config.seed <= MAX_SEED:
    raise ConfigError(f'seed must be an integer in [0, {MAX_SEED}] (NumPy\'s and Keras\' seeds are 32-bit), got '
                      f'{config.seed!r}')
  for field in dataclasses.fields(config):  # Every float setting: NaN or an infinity never trains anything.
    value = getattr(config, field.name)
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f'{field.name} must be finite, got {value!r}')
  _check_output_dir(config.output_dir)
  if config.clients_per_round > config.num_clients:
    raise ConfigError(f'clients_per_round ({config.clients_per_round}) exceeds num_clients ({config.num_clients})')
  for name in ('alpha', 'beta'):
    if not getattr(config, name) > 0:
      raise ConfigError(f'{name} must be positive, got {getattr(config, name)!r}')
  if config.secure and config.secure_bound is None:
    raise ConfigError('secure_bound: secure=True clips every float sum to [-secure_bound, secure_bound] before '
                      'the secure sum; set it (e.g. --secure_bound=1.0 for client updates of a small model)')
  if config.model == 'char_lstm' and config.dataset != 'shakespeare':
    raise ConfigError(f'model: char_lstm needs dataset=shakespeare, got dataset={config.dataset!r}')
  if config.dataset == 'shakespeare' and config.model != 'char_lstm':
    raise ConfigError(f'model: dataset=shakespeare needs model=char_lstm, got {config.model!r}')
  corruption_lib.check_corruption(config.corruption, config.corrupt_fraction)
  if config.corruption in corruption_lib.DATA_CORRUPTIONS and config.dataset == 'shakespeare':
    raise ConfigError(f'corruption: {config.corruption} applies to image classification, not {config.dataset}')
  # A method setting the method does not read, set to other than its default: refused (registry docstring).
  registry.check_settings(config.algorithm, config.aggregator, registry.settings_of(config), config.corruption)
  if config.aggregator in registry.MODEL_AGGREGATORS:
    registry.build(config.aggregator, config.aggregator_params())  # Raises on settings the aggregator refuses.
  if config.rfa_weight_bound is not None:
    rfa_weights.check_bound(config.rfa_weight_bound)
    if config.aggregator not in ('rfa', 'rfa_one_step') or config.algorithm not in config_lib.FEDAVG_FAMILY:
      raise ConfigError('rfa_weight_bound: the RFA weight audit replays rfa/rfa_one_step under fedavg, fedprox, '
                        f'fedadam or fedyogi, not aggregator={config.aggregator!r}, algorithm={config.algorithm!r}')
    if config.corruption in corruption_lib.UPDATE_CORRUPTIONS:
      raise ConfigError(f'rfa_weight_bound: the replay sees honest updates only, not corruption={config.corruption}')
  _check_validation(config)

def _check_output_dir(output_dir: str) -> None:
  """The output directory: a path, a directory (or creatable as one), writable, on a writable file system."""
  problem = safe_files.output_dir_problem(output_dir)
  if problem is not None:
    raise ConfigError(problem)


def _check_validation(config: config_lib.ExperimentConfig) -> None:
  fraction = config.validation_fraction
  if (isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.number))
      or not (math.isfinite(fraction) and 0.0 <= fraction < 1.0)):
    raise ConfigError(f'validation_fraction must lie in [0, 1) (the share of each client\'s examples held out '
                      f'for validation), got {fraction!r}')
  if fraction > 0 and registry.algorithm(config.algorithm).personal_evaluation:
    raise ConfigError(f'validation_fraction: algorithm=personalized already holds out {PERSONAL_TEST_FRACTION} '
                      f'of each client\'s examples for its own evaluation; use validation_fraction=0 with it, '
                      f'got validation_fraction={fraction!r}')
  if fraction > 0 and config.membership_inference:
    raise ConfigError('validation_fraction: membership_inference attacks with the test split as non-members, and a '
                      f'validation run never reads the test split; got validation_fraction={fraction!r} with '
                      'membership_inference=True')


# Settings a resumed run may change: they do not alter the state or what a round computes.
_RESUMABLE_CHANGES = ('rounds', 'eval_every', 'eval_last_rounds', 'output_dir', 'audit', 'data_dir', 'workers',
                      'rfa_weight_bound', 'membership_inference', 'participation_eval', 'dataset_placement',
                      'client_loop', 'worker_intra_op_threads', 'checkpoint_every')
# dataset_placement and client_loop change how, not what: the runs are bit-identical either way in the TFF worker
# (tested); with --client_execution=local the two loops agree to float32 rounding (a log line says so on resume).
# worker_intra_op_threads changes the last bits of what some kernels sum, as the machine's core count does under
# TensorFlow's default: a run may resume with another count (or on another machine), and the run says so in a log
# line; the summary records the count of its last session.


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
# fedprox: adaptive_optimizer arrived with the corrected FedProx client work (issue 36; docs/methods.md): a fedprox
# run whose config.json lacks it trained with TFF 0.87's proximal client work, whose term has the wrong sign.
_NOT_RESUMABLE_BEFORE_SETTING_EXISTED = (
    ('adaptive_optimizer', lambda saved: saved.get('algorithm') == 'fedprox',
     'its FedProx rounds were trained with TFF 0.87\'s proximal client work, whose term has the wrong sign (it pushes '
     'each client away from the server model; FedProx now pulls towards it), and cannot be continued with the '
     'corrected one: start the run again in a new --output_dir'),
    # scaffold: its clients now honour --client_momentum (issue 36, in the same change as adaptive_optimizer); a run
    # written before trained with plain SGD whatever its client_momentum said.
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
  path = os.path.join(config.output_dir, CONFIG_FILE)
  if not os.path.exists(path):
    if checkpoints.saved_rounds(config.output_dir):
      raise ConfigError(f'{config.output_dir} holds checkpoints but no {CONFIG_FILE}, so nothing says which settings '
                        f'they were trained with: resuming could continue another run under these flags. Use another '
                        f'--output_dir (or restore its {CONFIG_FILE})')
    return
  try:
    saved = safe_files.read_json_object(path)
  except ValueError as e:
    raise ConfigError(f'{path} is damaged ({e}): it cannot say which settings the run was trained with; use another '
                      f'--output_dir') from None
  check_not_superseded(config.output_dir, saved)
  saved = completed_config(saved)
  current = dataclasses.asdict(config)
  changed = sorted(k for k in current if k not in _RESUMABLE_CHANGES and saved.get(k) != current[k])
  if changed:
    details = ', '.join(f'{k}: {saved.get(k)!r} -> {current[k]!r}' for k in changed)
    raise ConfigError(f'{config.output_dir} holds a run with other settings ({details}); use another '
                      f'--output_dir or the same flags to resume it')
  # Settings a run may resume under that change the last bits of its rounds from here: one log line each.
  last_bits = ['worker_intra_op_threads'] if config.workers is None else []
  if config.client_execution == client_execution_lib.LOCAL:  # The local loops agree to float32 rounding only.
    last_bits.append('client_loop')
  for name in last_bits if 0 < trained < config.rounds else ():
    note = (config.output_dir, name, saved.get(name), current[name])
    if note[2] != note[3] and note not in _resume_notes:
      _resume_notes.add(note)
      logging.warning('%s: resumes with %s=%s (trained so far with %s): its rounds from here differ in the last '
                      'bits from an uninterrupted run\'s', config.output_dir, name, note[3], note[2])


_resume_notes: set[tuple[str, str, Any, Any]] = set()  # What check_resumable logged (it runs twice per run).


def prepare(config: config_lib.ExperimentConfig) -> None:
  """Every check of a run, before anything is written: the settings, then the output directory's."""
  validate(config)
  safe_files.check_output_dir(config.output_dir)  # Nobody else can plant a link the run would write through.
  check_resumable(config)
  checkpoints.check_resume_files(config.output_dir)  # checkpoints/ a directory, metrics.csv readable: one line.


def _process_age() -> Optional[float]:
  """Seconds since this process started (Linux's /proc; None where there is none)."""
  try:
    with open('/proc/self/stat') as f:
      start_ticks = int(f.read().rpartition(')')[2].split()[19])  # Field 22, starttime, after the command name.
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None
  return uptime - start_ticks / os.sysconf('SC_CLK_TCK')


def _run_async(coro):
  return asyncio.run(coro)


@dataclasses.dataclass
class Setup:
  """A run's data, model and method."""
  data: loaders.FederatedDataset
  build_keras: Callable[[], tf.keras.Model]
  model_fn: Callable[[], tff.learning.models.VariableModel]
  method: methods.Method
  evaluator: evaluation.CentralEvaluator  # On the test split; on the validation split when there is one.
  corrupted: tuple[str, ...] = ()
  validation: Optional[tuple[np.ndarray, np.ndarray]] = None  # The pooled held-out (x, y) of validation runs.
  participation_eval: bool = True  # Evaluate on the round's participants' vs the other clients' data too.

  @property
  def process(self) -> tff.learning.templates.LearningProcess:
    return self.method.process


def build_setup(config: config_lib.ExperimentConfig) -> Setup:
  """The data (partitioned; poisoned or held out where the settings say), the model and the method."""
  data = loaders.load_federated_data(
      config.dataset, config.partition, config.num_clients, config.seed, data_dir=config.data_dir,
      fashion_mnist_source=config.fashion_mnist_source, train_subset_fraction=config.train_subset_fraction,
      **config.partition_kwargs())
  validation = None
  if config.validation_fraction > 0:
    data, validation = _split_validation(data, config.validation_fraction, config.seed)
  corrupted = ()
  if config.corruption != corruption_lib.NONE:
    corrupted = tuple(corruption_lib.corrupted_clients(data.train.client_ids, config.corrupt_fraction, config.seed))
    data = dataclasses.replace(data, train=corruption_lib.poison_data(
        data.train, corrupted, config.corruption, data.num_classes))
  held_out = None
  if registry.algorithm(config.algorithm).personal_evaluation:
    train, held_out = evaluation.hold_out(data.train, PERSONAL_TEST_FRACTION, config.seed)
    data = dataclasses.replace(data, train=train)
  build_keras = models.keras_builder(config.model, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec, pad_id=data.pad_id)
  update_corruption = None
  if config.corruption in corruption_lib.UPDATE_CORRUPTIONS:
    update_corruption = corruption_lib.UpdateCorruption(config.corruption, corrupted, tuple(data.train.client_ids),
                                                 config.seed)
  method = methods.build(
      model_fn, config.algorithm, config.aggregator, algorithm_config=config.algorithm_config(),
      aggregator_params=config.aggregator_params(), method_params=config.method_params(),
      num_clients=config.num_clients,
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize if config.secure_metrics else None,
      update_corruption=update_corruption, held_out=held_out,
      cache_key=(config.dataset, config.model, data.input_shape, data.num_classes, data.pad_id),
      client_execution=config.client_execution, client_sources=_client_sources(config, data.train))
  eval_x, eval_y = validation if validation is not None else (data.test_x, data.test_y)
  evaluator = evaluation.CentralEvaluator(build_keras, eval_x, eval_y, pad_id=data.pad_id)
  return Setup(data, build_keras, model_fn, method, evaluator, corrupted, validation, config.participation_eval)


def _split_validation(data: loaders.FederatedDataset, fraction: float, seed: int
                      ) -> tuple[loaders.FederatedDataset, tuple[np.ndarray, np.ndarray]]:
  """Each client's held-out share, pooled in client order, and the data without it and without any test data
  (test split and OOD clients emptied, so nothing downstream can evaluate on them)."""
  train, held_out = evaluation.hold_out(data.train, fraction, seed)
  held = [held_out[c] for c in data.train.client_ids if c in held_out]
  if not held:
    raise ConfigError(f'validation_fraction={fraction} holds out no example: every client has fewer than '
                      f'{math.ceil(1 / fraction)} examples')
  pooled = (np.concatenate([x for x, _ in held]), np.concatenate([y for _, y in held]))
  data = dataclasses.replace(data, train=train, test_x=data.test_x[:0], test_y=data.test_y[:0], ood_test=None)
  return data, pooled


def _pooled(data, client_ids):
  xs, ys = zip(*(data.train.client_arrays(c) for c in client_ids))
  return np.concatenate(xs), np.concatenate(ys)


def evaluate_weights(setup: Setup, weights: tff.learning.models.ModelWeights, participants: list[str]
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


# The plot's series: (metrics.csv column prefix, legend label). Training metrics are the round's clients' own
# (TFF's `client_work/train`, every round); the others come from the evaluated rounds only.
_PLOT_SERIES = (('client_work/train', 'train (round\'s clients)'), ('test', 'test'), ('ood_test', 'OOD test'),
                ('validation', 'validation'))


def _plot_figure(rows: list[dict[str, float]], title: str):
  """Accuracy and loss against rounds (two panels), train and held-out alike; rounds on integer ticks."""
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  fig = figure.Figure(figsize=(10, 4))
  axes = fig.subplots(1, 2)
  for ax, metric in zip(axes, ('accuracy', 'loss')):
    for prefix, label in _PLOT_SERIES:
      key = f'{prefix}/{metric}'
      points = [(r['round'], r[key]) for r in rows if key in r and 'round' in r and math.isfinite(r[key])]
      if points:
        ax.plot(*zip(*points), label=label, marker='.' if len(points) < 30 else None)
    ax.set_xlabel('round')
    ax.set_ylabel(metric)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_lines():
      ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def _plot(rows: list[dict[str, float]], path: str, title: str) -> None:
  """Writes `_plot_figure` of the run's metrics rows (every round's) as a PNG at `path`."""
  image = io.BytesIO()
  _plot_figure(rows, title).savefig(image, format='png', dpi=100)
  safe_files.write_atomic(path, image.getvalue())


def _read_rows(csv_path: str) -> list[dict[str, float]]:
  """metrics.csv's rows, each {column: value} of its numeric values ([] when there is no file).

  Read with `safe_files.read_csv` (a regular file, bounded, UTF-8, no row longer than the header): a file that is
  not, or a row whose `round` is not a number, raises `safe_files.DamagedFileError` (a ValueError) naming the line.
  """
  if not os.path.exists(csv_path):
    return []
  rows = []
  for line, raw in safe_files.read_csv(csv_path)[1]:
    row = {}
    for k, v in raw.items():
      if v not in (None, ''):
        try:
          row[k] = float(v)
        except ValueError:
          pass
    if raw.get('round') not in (None, '') and 'round' not in row:
      raise safe_files.DamagedFileError(csv_path, f'line {line}: round {raw["round"]!r} is not a number')
    rows.append(row)
  return rows


def client_loop_used(config: config_lib.ExperimentConfig, model_fn) -> Optional[str]:
  """The loop the run's clients walk their batches with (`--client_loop`, or `iterator` where `in_graph` does not
  apply); None for the composed algorithms, which walk them with their own loop."""
  if registry.algorithm(config.algorithm).kind != registry.FEDAVG_FAMILY:
    return None
  return fedavg_family.client_loop(model_fn, config.algorithm_config()).name


def _client_sources(config: config_lib.ExperimentConfig, train) -> Optional[worker_datasets.ClientSources]:
  """What the clients build their datasets from when `dataset_placement=worker` applies (else None, with a log
  line saying why)."""
  if config.dataset_placement != worker_datasets.WORKER:
    return None
  reason = worker_datasets.applies(algorithm=config.algorithm, aggregator=config.aggregator,
                                   corruption=config.corruption, client_execution=config.client_execution,
                                   workers=config.workers, train=train)
  if reason is not None:
    logging.info('dataset_placement=worker does not apply (%s): each round sends its datasets', reason)
    return None
  try:
    worker_datasets.check_memory(train, config.clients_per_round)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return worker_datasets.ClientSources(train.element_type_structure, config.local_epochs, config.batch_size)


def place_datasets(method: methods.Method, inputs: round_loop.ClientInputs
                   ) -> Optional[worker_datasets.WorkerDatasets]:
  """The run's files for a method whose clients build their datasets from them (None for the others)."""
  if method.client_sources is None:
    return None
  placement = worker_datasets.WorkerDatasets(inputs)
  method.place_datasets_in_worker(placement)
  return placement


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
  try:
    setup = build_setup(config)
  except ConfigError:
    raise
  except ValueError as e:  # What only the data can tell (more clients than examples, k above the classes...).
    if isinstance(e, idx.IdxError):  # The data's files, not a setting: the runner says `error:`.
      raise
    raise ConfigError(str(e)) from None
  if config.workers is not None:
    try:
      runtime.check_single_aggregation_stage(setup.process)
    except ConfigError:
      raise
    except ValueError as e:
      raise ConfigError(f'workers: {e}') from None
    try:
      runtime.set_multi_worker_context([t for t in config.workers.split(',') if t])
    except (RuntimeError, ValueError) as e:  # No worker answers at an address: a flag error, nothing written.
      raise ConfigError(f'workers: {e}') from None
  elif runtime.simulation_context_applies():
    # The runner's own worker, with the run's intra-op threads (a running worker with another count is replaced).
    # A context the caller installed instead (e.g. several workers) is left alone.
    try:
      runtime.set_simulation_context(intra_op_threads=config.worker_intra_op_threads)
    except (RuntimeError, ValueError) as e:  # The worker did not start again: one line, nothing written yet.
      raise ConfigError(f'worker_intra_op_threads: the TFF worker did not start with '
                        f'{config.worker_intra_op_threads} thread(s): {" ".join(str(e).split())}') from None
  runtime.check_context_runs(setup.process)  # A context the caller installed that cannot run it: one line.
  # Every check has passed: only now is anything but the lock written. Atomically (a temporary file renamed over
  # it): an interrupted write leaves the old config.json or the new one, never a half that refuses the resume.
  safe_files.write_atomic(os.path.join(config.output_dir, CONFIG_FILE),
                          json.dumps(dataclasses.asdict(config), indent=2))
  if config.audit:
    from tff_gma import audit  # pylint: disable=g-import-not-at-top
    report = audit.audit_computation(setup.process)
    safe_files.write_atomic(os.path.join(config.output_dir, 'audit.md'), report.to_markdown())

  state_manager = tff.program.FileProgramStateManager(checkpoints.checkpoint_dir(config.output_dir),
                                                      keep_total=methods.KEEP_CHECKPOINTS)
  for path in checkpoints.remove_partial_saves(config.output_dir):
    logging.warning('%s: removed %s, a checkpoint whose save never finished', config.output_dir, path)
  initial_state = round_loop.seeded_initial_state(setup.process, setup.build_keras, config.seed)
  resumed = checkpoints.resume(state_manager, config.output_dir, initial_state,
                               lambda r: setup.method.restore_client_state(config.output_dir, r))
  if resumed.message():
    logging.warning('%s: %s', config.output_dir, resumed.message())
  state, start_round = resumed.state, resumed.round_num
  if state is None:
    state, start_round = initial_state, 0
    _run_async(state_manager.save(state, 0))
  csv_path = os.path.join(config.output_dir, 'metrics.csv')
  for path in checkpoints.remove_partial_releases(csv_path):
    logging.warning('%s: removed %s, a metrics.csv release that never finished', config.output_dir, path)
  if checkpoints.drop_partial_row(csv_path):
    logging.warning('%s: dropped the last row of metrics.csv, cut while it was written', config.output_dir)
  checkpoints.truncate_rows(csv_path, 'round', start_round)  # Rows after the checkpoint: of another timeline.
  csv_release = tff.program.CSVFileReleaseManager(csv_path, key_fieldname='round')
  tb_release = tff.program.TensorBoardReleaseManager(os.path.join(config.output_dir, 'tensorboard'))

  monitor = None
  if config.rfa_weight_bound is not None:  # Simulation harness only: it replays RFA on the round's updates.
    one_step = config.aggregator == 'rfa_one_step'
    monitor = rfa_weights.RfaWeightMonitor(
        setup.model_fn, config.algorithm_config(), config.rfa_weight_bound,
        rfa_weights.RfaSettings(num_passes=1 if one_step else config.num_passes, smoothing=config.smoothing,
                                one_step=one_step, secure=config.secure, value_bound=config.secure_bound,
                                init=None if one_step else config.rfa_init))

  accuracy_key = 'validation/accuracy' if setup.validation is not None else 'test/accuracy'
  bar = progress.RoundProgress(config.rounds, label=f'{config.algorithm}/{config.aggregator}') \
      if show_progress else None

  def before_round(round_num, state, participants, datasets):
    del round_num
    return rfa_weights.report_metrics(
        monitor(setup.process.get_model_weights(state), datasets, participants)) if monitor else {}

  non_finite = {'rounds_in_a_row': 0}

  def check_round(done: round_loop.Round) -> None:
    # A server update the finalizer rejected as non-finite leaves the model where it was: after
    # NON_FINITE_ROUNDS_TO_STOP such rounds in a row the run cannot recover, and stops saying why.
    rejected = any(k.endswith('update_non_finite') and v > 0 for k, v in done.row.items())
    non_finite['rounds_in_a_row'] = non_finite['rounds_in_a_row'] + 1 if rejected else 0
    if non_finite['rounds_in_a_row'] >= NON_FINITE_ROUNDS_TO_STOP:
      raise TrainingStopped(
          f'stopped after round {done.number} of {config.rounds}: the server update was non-finite in '
          f'{NON_FINITE_ROUNDS_TO_STOP} rounds in a row (finalizer/update_non_finite = 1), so the model no longer '
          f'moves. Likely cause: a setting too large for this model (--client_lr={config.client_lr:g}, '
          f'--server_lr={config.server_lr:g}, --proximal_strength={config.proximal_strength:g}, '
          f'--adaptive_epsilon={config.adaptive_epsilon:g}) or every client dropped as non-finite')
    dropped_all = all_clients_dropped(done.row, len(done.participants))
    done.row['all_clients_dropped'] = float(dropped_all is not None)
    if dropped_all is not None:
      logging.warning('round %d of %d: every client was dropped as non-finite (%s); no client update counted. A '
                      'diverging run? Try a smaller --client_lr or --server_lr.', done.number, config.rounds,
                      dropped_all)
    if config.corruption != corruption_lib.NONE:
      done.row['corrupted_participants'] = float(sum(c in setup.corrupted for c in done.participants))

  # Evaluations, rows and checkpoints beside the next round (`training.runner.background`), unless that work reads
  # what the next round changes (the clients' own values) or the next round trains in this process too.
  work = background.AfterRoundWork(
      background=setup.method.client_state is None and setup.method.client_execution == client_execution_lib.WORKER)
  unreleased = []  # The rows of the rounds since the last checkpoint, written with the next one.

  def write_rows(rows: list[tuple[int, dict[str, float]]]) -> None:
    for number, row in rows:
      _run_async(csv_release.release(row, number))
      _run_async(tb_release.release(row, number))

  def evaluate_round(done: round_loop.Round) -> None:
    work.check()  # A failed evaluation or write of an earlier round stops the run here.
    if round_loop.evaluation_due(done.number, config.eval_every, config.rounds, config.eval_last_rounds):
      weights, participants, row = setup.process.get_model_weights(done.state), done.participants, done.row
      work.submit('evaluate', lambda: row.update(evaluate_weights(setup, weights, participants)))

  def release_and_save(done: round_loop.Round) -> None:
    unreleased.append((done.number, done.row))
    if done.number % config.checkpoint_every == 0 or done.number == config.rounds:
      rows, number, state = list(unreleased), done.number, done.state
      unreleased.clear()

      def save() -> None:
        # The rows before the checkpoint: a crash in between re-runs their rounds on resume, and the CSV release
        # of a round replaces its row (it drops rows with keys >= the released key). Then the clients' values
        # before the server state: every saved state has its clients' values (SCAFFOLD, personalized RFA).
        write_rows(rows)
        setup.method.checkpoint_client_state(config.output_dir, number)
        _run_async(state_manager.save(state, number))

      work.submit('release_and_checkpoint', save)
    if bar is not None:
      bar.update(done.number, **({'acc': done.row[accuracy_key]} if accuracy_key in done.row else {}))
    if on_round is not None:
      work.wait()  # As each round's work had run in turn (tests interrupt here, after a checkpoint).
      on_round(done.number, done.state)

  inputs = round_loop.ClientInputs(setup.data.train, config.clients_per_round, config.local_epochs, config.batch_size,
                                   config.seed)
  placement = place_datasets(setup.method, inputs)
  train_seconds = [0.0]

  def count_training(done: round_loop.Round) -> None:
    train_seconds[0] += done.seconds

  loop = round_loop.RoundLoop(setup.method, state, inputs, round_num=start_round, before_round=before_round,
                              after_round=(count_training, check_round, evaluate_round, release_and_save))
  started = time.monotonic()
  process_age = _process_age()  # From the process's start to the first round (a one-run process's start-up).
  stopped = None
  try:
    try:
      state = loop.run(config.rounds)
    except TrainingStopped as e:
      stopped, state = e, loop.state
      work.submit('release_and_checkpoint', lambda rows=list(unreleased): write_rows(rows))  # The rounds it ran.
    work.wait()
  finally:  # On an error too: the task in progress finishes (a checkpoint is whole or absent), the rest is dropped.
    work.close()
    if placement is not None:
      placement.close()
  # The after-round work's own time (beside training where it ran in the background) and the rounds' wait for it.
  seconds = {'train': train_seconds[0], 'evaluate': work.seconds['evaluate'],
             'release_and_checkpoint': work.seconds['release_and_checkpoint'], 'waited': work.waited}

  rows = [r for r in _read_rows(csv_path) if r.get('round', 0) <= config.rounds]
  evaluated = [r for r in rows if accuracy_key in r]
  accuracy = [r['test/accuracy'] for r in evaluated if 'test/accuracy' in r]
  summary = {
      'final_accuracy': float(np.mean(accuracy[-LAST_EVALS_FOR_FINAL:])) if accuracy else None,
      'best_accuracy': float(np.max(accuracy)) if accuracy else None,
      'rounds_completed': int(max((r['round'] for r in rows), default=0)),
      'seconds_this_run': time.monotonic() - started,
      # How long the process had run when this run's rounds began: `python -m training.run`'s start-up (imports,
      # data, building the method, the worker). In a process that runs several runs (a study) it counts them all.
      'process_seconds_before_rounds': None if process_age is None else round(process_age, 2),
      # Where this run's time went, in seconds summed over its rounds: the method's round (client training and
      # aggregation), evaluations, metrics releases with checkpoints (their own time, which overlaps training where
      # they ran beside it: `training.runner.background`), `waited`: the rounds' wait for them; the rest: setup,
      # the summary.
      'seconds_by_part': {**{k: round(v, 3) for k, v in seconds.items()}, 'rounds': loop.round_num - start_round},
      # Where this run's client training ran: TensorFlow devices of this process (local), or the TFF worker's CPU.
      'client_execution': setup.method.client_execution,
      'dataset_placement': worker_datasets.DRIVER if placement is None else worker_datasets.WORKER,
      'client_loop': client_loop_used(config, setup.model_fn),
      'client_devices': setup.method.client_devices(),
      'config': dataclasses.asdict(config),
  }
  if setup.validation is not None:  # A tuning run: no test accuracy (final/best_accuracy stay None).
    validation = [r['validation/accuracy'] for r in evaluated]
    summary['final_validation_accuracy'] = (
        float(np.mean(validation[-LAST_EVALS_FOR_FINAL:])) if validation else None)
    summary['best_validation_accuracy'] = float(np.max(validation)) if validation else None
  if evaluated and 'ood_test/accuracy' in evaluated[-1]:
    summary['final_ood_accuracy'] = float(np.mean([r['ood_test/accuracy'] for r in evaluated
                                                   if 'ood_test/accuracy' in r][-LAST_EVALS_FOR_FINAL:]))
  for key in ('participating/accuracy', 'non_participating/accuracy', 'personalized/accuracy',
              'personalized/shared_accuracy'):
    values = [r[key] for r in evaluated if key in r]
    if values:
      summary[f'final_{key.replace("/", "_")}'] = float(np.mean(values[-LAST_EVALS_FOR_FINAL:]))
  if config.membership_inference:
    weights_now = setup.process.get_model_weights(state)
    # Members: every example the training clients hold; non-members: the central test split (balanced inside).
    xs, ys = zip(*(setup.data.train.client_arrays(c) for c in setup.data.train.client_ids))
    attack = membership_attack.membership_attack(
        setup.evaluator.logits(weights_now, np.concatenate(xs)), np.concatenate(ys),
        setup.evaluator.logits(weights_now, setup.data.test_x), setup.data.test_y, seed=config.seed)
    summary['membership_attack_accuracy'] = float(attack['attack_accuracy'])
    safe_files.write_atomic(os.path.join(config.output_dir, 'membership.json'),
                            json.dumps(attack, indent=2, default=float))
  summary['non_finite_update_rounds'] = non_finite['rounds_in_a_row']  # In a row, at the end.
  if stopped is not None:
    summary['stopped'] = str(stopped)
  safe_files.write_atomic(os.path.join(config.output_dir, 'summary.json'), json.dumps(summary, indent=2))
  if evaluated:
    _plot(rows, os.path.join(config.output_dir, 'accuracy.png'),
          f'{config.dataset}/{config.partition}: {config.algorithm} + {config.aggregator}')
  if stopped is not None:
    raise stopped
  return RunResult(summary, setup.process.get_model_weights(state))
