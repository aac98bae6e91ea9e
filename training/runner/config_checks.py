"""A run's settings checked, before anything is written: each unknown or inconsistent one refused by name.

`validate` raises `errors.ConfigError` naming the setting. The method settings check their own values where their
dataclasses are built (`training.config`); what only the data can tell (more clients than examples) is checked
when the run's setup is built (`run_setup.build_checked_setup`), and the output directory's run by
`resume_checks.check_resumable`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tff_gma import checks
from tff_gma import models
from tff_gma.runtime import worker_process
from tff_gma.data import loaders
from training import config as config_lib
from training import safe_files
from training.engine import attacks
from training.engine import corruption as corruption_lib
from training.engine import registry
from training.engine import rfa_weights
from training.engine import worker_datasets
from training.runner import run_setup
from training.runner.errors import ConfigError

MAX_SEED = 2**32 - 1

# Settings that must be integers >= 1.
_POSITIVE_INTS = ('num_clients', 'clients_per_round', 'rounds', 'local_epochs', 'batch_size', 'eval_every',
                  'classes_per_client', 'checkpoint_every')

# The attack settings (`config.AttackParams`) and the corruptions that read them: set to other than its default
# under any other corruption, one is refused (it could not take effect), as a method setting the method does not read.
ATTACK_READERS = {
    'alie_z': (attacks.ALIE,),
    'ipm_epsilon': (attacks.IPM,),
    'large_norm_scale': (attacks.LARGE_NORM,),
    'minmax_perturbation': (attacks.MIN_MAX, attacks.MIN_SUM),
    'minmax_gamma_init': (attacks.MIN_MAX, attacks.MIN_SUM),
}


def validate(config: config_lib.ExperimentConfig) -> None:
  """Raises `ConfigError` naming the setting when something is unknown or inconsistent (nothing is written)."""
  try:
    _check(config)
  except ConfigError:
    raise
  except ValueError as e:  # The library's own argument checks name the argument too.
    raise ConfigError(str(e)) from None


def _check(config: config_lib.ExperimentConfig) -> None:
  """The checks in turn (the first that fails names its setting)."""
  _check_names(config)
  _check_numbers(config)
  _check_output_dir(config.output_dir)
  _check_combinations(config)
  _check_validation(config)


def _check_names(config: config_lib.ExperimentConfig) -> None:
  """The data set, model, method, placement and workers are known ones; the method settings build."""
  loaders.check_config(config.dataset, config.partition, fashion_mnist_source=config.fashion_mnist_source)
  if config.model not in models.MODELS:
    raise ConfigError(f'model: unknown model {config.model!r}; expected one of {models.MODELS}')
  registry.check(config.algorithm, config.aggregator, config.corruption, config.client_execution, config.workers)
  if config.dataset_placement not in worker_datasets.PLACEMENTS:
    raise ConfigError(f'dataset_placement: unknown placement {config.dataset_placement!r}; expected one of '
                      f'{worker_datasets.PLACEMENTS}')
  try:
    worker_process.intra_op_threads(config.worker_intra_op_threads)
  except ValueError as e:
    raise ConfigError(f'worker_{e}') from None  # runtime names it intra_op_threads.
  if config.workers is not None:
    targets = [t for t in config.workers.split(',') if t]
    host_port = lambda t: t.rpartition(':')[0] and t.rpartition(':')[2].isdigit()
    if not targets or not all(host_port(t) or t.startswith('unix:/') for t in targets):
      raise ConfigError(f'workers must be host:port or unix:/path[,...], got {config.workers!r}')
  # The method and attack settings check their own values where their dataclasses are built (training.config), once.
  for build_part in (config.algorithm_config, config.aggregator_params, config.method_params, config.attack_params):
    build_part()


def _check_numbers(config: config_lib.ExperimentConfig) -> None:
  """The counts are positive integers, the fractions and the seed in range, every float finite."""
  for name in _POSITIVE_INTS:
    try:
      checks.check_positive_int(getattr(config, name), name)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  try:  # Before the finite-floats check, so that NaN gets the interval too.
    loaders.check_train_subset(config.dataset, config.partition, config.train_subset_fraction)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  for name in ('eval_last_rounds', 'max_frozen_rounds'):  # 0: none (no extra evaluations; never stop).
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ConfigError(f'{name} must be an integer >= 0, got {value!r}')
  for name in ('first_round_deadline_s', 'min_round_deadline_s'):  # first_round_deadline_s=0: no deadline.
    if not getattr(config, name) >= 0:
      raise ConfigError(f'{name} must be >= 0 seconds, got {getattr(config, name)!r}')
  if not config.round_deadline_factor >= 1:
    raise ConfigError(f'round_deadline_factor must be >= 1 (a round may take at least as long as the slowest so far), '
                      f'got {config.round_deadline_factor!r}')
  if not isinstance(config.seed, (int, np.integer)) or not 0 <= config.seed <= MAX_SEED:
    raise ConfigError(f'seed must be an integer in [0, {MAX_SEED}] (NumPy\'s and Keras\' seeds are 32-bit), got '
                      f'{config.seed!r}')
  for field in dataclasses.fields(config):  # Every other float setting: NaN or an infinity never trains anything.
    if field.name in registry.SETTINGS:
      continue  # A method setting: its dataclass checked it (`_check_names`).
    value = getattr(config, field.name)
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f'{field.name} must be finite, got {value!r}')


def _check_output_dir(output_dir: str) -> None:
  """The output directory: a path, a directory (or creatable as one), writable, on a writable file system."""
  problem = safe_files.output_dir_problem(output_dir)
  if problem is not None:
    raise ConfigError(problem)


def _check_combinations(config: config_lib.ExperimentConfig) -> None:
  """Settings that each are valid but not together (data and model, corruption and method, the RFA audit)."""
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
  corruption_lib.check_corruption(config.corruption)
  defaults = config_lib.AttackParams()
  for name, readers in ATTACK_READERS.items():
    value = getattr(config, name)
    if config.corruption not in readers and value != getattr(defaults, name):
      raise ConfigError(f'{name}: corruption={config.corruption} does not read it (read by --corruption='
                        f'{" or ".join(readers)}), so {name}={value!r} cannot take effect; leave it at its default '
                        f'{getattr(defaults, name)!r}')
  if config.corruption in corruption_lib.DATA_CORRUPTIONS and config.dataset == 'shakespeare':
    raise ConfigError(f'corruption: {config.corruption} applies to image classification, not {config.dataset}')
  # A method setting the method does not read, set to other than its default: refused (registry docstring).
  registry.check_settings(config.algorithm, config.aggregator, registry.settings_of(config), config.corruption)
  if config.rfa_weight_bound is not None:
    rfa_weights.check_bound(config.rfa_weight_bound)
    if (registry.aggregator(config.aggregator).weight_replay is None
        or registry.algorithm(config.algorithm).kind != registry.FEDAVG_FAMILY):
      raise ConfigError('rfa_weight_bound: the RFA weight audit replays rfa/rfa_one_step under fedavg, fedprox, '
                        f'fedadam or fedyogi, not aggregator={config.aggregator!r}, algorithm={config.algorithm!r}')
    if config.corruption in corruption_lib.UPDATE_CORRUPTIONS:
      raise ConfigError(f'rfa_weight_bound: the replay sees honest updates only, not corruption={config.corruption}')


def _check_validation(config: config_lib.ExperimentConfig) -> None:
  """`validation_fraction` in [0, 1), and not with the modes that hold out or read the test split themselves."""
  fraction = config.validation_fraction
  if (isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.number))
      or not (math.isfinite(fraction) and 0.0 <= fraction < 1.0)):
    raise ConfigError(f'validation_fraction must lie in [0, 1) (the share of each client\'s examples held out '
                      f'for validation), got {fraction!r}')
  if fraction > 0 and registry.algorithm(config.algorithm).personal_evaluation:
    raise ConfigError(f'validation_fraction: algorithm=personalized already holds out '
                      f'{run_setup.PERSONAL_TEST_FRACTION} of each client\'s examples for its own evaluation; use '
                      f'validation_fraction=0 with it, got validation_fraction={fraction!r}')
  if fraction > 0 and config.membership_inference:
    raise ConfigError('validation_fraction: membership_inference attacks with the test split as non-members, and a '
                      f'validation run never reads the test split; got validation_fraction={fraction!r} with '
                      'membership_inference=True')
