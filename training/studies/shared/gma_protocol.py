"""What the GMA studies (`gma`, `gma_fmnist`, `gma_fmnist_claims`) share of the paper's protocol.

The run cell of the digits and Fashion-MNIST studies (its name is its run directory's), their command-line flags,
the convergence rule on a validation curve, what counts as chance, and App. D.6's equal-learning-rate question.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

from absl import flags
import numpy as np

from training import config as config_lib
from training.engine import client_execution
from training.runner import experiment
from training.studies.shared import study_runs

FLAGS = flags.FLAGS
# The flags `define_study_flags` defines are the calling study's: its --help lists them as its own.
flags.disclaim_key_flags()

LAST_EVALS = experiment.LAST_EVALS_FOR_FINAL  # 10: the paper's "last 10 rounds".
PLATEAU_POINTS = 0.5
# Ten classes: a model that predicts one class scores 10% on a balanced split (exactly on Fashion-MNIST's test split,
# 1,000 images a class; within a point on digits and on the validation splits). An accuracy within CHANCE_POINTS of
# that is chance: a tuning point where the model did not learn, or a final run that collapsed (on Fashion-MNIST:
# most ReLU units dead, one class predicted for every image; docs/research/gma_fmnist_study.md).
CHANCE_ACCURACY = 0.1
CHANCE_POINTS = 1.0
# App. D.6's claim in the paper's words, and the setting of the Table 10 it rests on.
PAPER_EQUAL_LR_CLAIM = ('App. D.6 / Table 10, FedAvg on non-iid Fashion-MNIST, 10 clients in full participation: '
                        '"across learning rates where the model learns, gradient masking outperforms naive averaging"')


def define_study_flags(settings: Sequence[str], output_dir: str) -> None:
  """The flags every GMA study takes (stages, settings, methods, rounds, output, shard, client execution)."""
  flags.DEFINE_enum('stage', 'all', ['all', 'tune', 'final', 'collect'],
                    'Which stages to run (all: tuning, then final; collect: none, only the results of finished runs).')
  flags.DEFINE_list('settings', list(settings), f'Settings (of {list(settings)}).')
  flags.DEFINE_list('methods', [], 'Restrict to these ALGORITHM/AGGREGATOR methods (default: each setting\'s).')
  flags.DEFINE_integer('rounds', 0, 'Rounds of every run (0: each setting\'s own; a small value for a smoke test).')
  flags.DEFINE_string('output_dir', output_dir, 'Where runs and results go.')
  flags.DEFINE_string('shard', '0/1', 'i/n: run only the cells whose name hashes to i mod n, so that n processes '
                      'share the study; a last call without --shard collects.')
  flags.DEFINE_enum('client_execution', client_execution.WORKER, list(client_execution.MODES),
                    "Where clients train (the runner's --client_execution).")


def checked_settings_and_shard(settings: Sequence[str]) -> tuple[int, int]:
  """`define_study_flags`' --settings checked against `settings`, and --shard parsed; ValueError naming the flag."""
  for name in FLAGS.settings:
    if name not in settings:
      raise ValueError(f'settings: unknown setting {name!r}; expected some of {list(settings)}')
  return study_runs.parse_shard(FLAGS.shard)


class Run(NamedTuple):
  """One cell of the study: a setting, a method, hyperparameters, a seed, tuning or final."""
  setting: str
  algorithm: str
  aggregator: str
  client_lr: float
  server_lr: float
  tau: float
  seed: int
  tuning: bool

  @property
  def method(self) -> str:
    return f'{self.algorithm}/{self.aggregator}'

  @property
  def name(self) -> str:
    kind = 'tune' if self.tuning else 'final'
    return (f'{self.setting}-{self.algorithm}-{self.aggregator}-clr{self.client_lr:g}-slr{self.server_lr:g}'
            f'-tau{self.tau:g}-{kind}-seed{self.seed}')


def is_gma(aggregator: str) -> bool:
  return aggregator.startswith('gma')


def adaptive_optimizer(algorithm: str) -> str:
  """The server optimizer of the archived studies' runs: their FedAdam/FedYogi arms ran TFF's bias-corrected
  build_adam/build_yogi (made before --adaptive_optimizer existed; docs/methods.md, "Adaptive server optimizers"),
  so their archives read back, and their runs resume, as what they ran; the SGD arms keep the default."""
  return 'tff' if algorithm in config_lib.ADAPTIVE_ALGORITHMS else config_lib.ExperimentConfig.adaptive_optimizer


def late_rise(values: Sequence[float]) -> Optional[float]:
  """Points by which the last 10 evaluations' mean lies above the 10 before's (None with fewer than 20)."""
  if len(values) < 2 * LAST_EVALS:
    return None
  last, before = np.mean(values[-LAST_EVALS:]), np.mean(values[-2 * LAST_EVALS:-LAST_EVALS])
  return float(100 * (last - before))


def converged(values: Sequence[float]) -> bool:
  """The convergence rule: the last 10 evaluations' mean within PLATEAU_POINTS points of the 10 before (one-sided:
  a fall counts as converged)."""
  rise = late_rise(values)
  return rise is not None and rise < PLATEAU_POINTS


def at_chance(accuracy: float) -> bool:
  return 100 * (accuracy - CHANCE_ACCURACY) <= CHANCE_POINTS


def equal_lr_line(pairs: Sequence[tuple[float, float]], where: str) -> str:
  """App. D.6's question on (AVG, GMA) accuracies at the same learning rates. As the paper compares them where the
  model learns, pairs where both arms are at chance are left out and pairs where one arm is are counted apart."""
  chance = [(at_chance(a), at_chance(g)) for a, g in pairs]  # (AVG's, GMA's)
  both = np.asarray([100 * (g - a) for (a, g), c in zip(pairs, chance) if c == (False, False)])
  line = (f'- "Robust to the learning rate" ({PAPER_EQUAL_LR_CLAIM}), {where}: where both arms learn (above '
          f'{100 * CHANCE_ACCURACY + CHANCE_POINTS:g}%), GMA above AVG in {int(np.sum(both > 0))} of {both.size} '
          f'pairs, below in {int(np.sum(both < 0))}, equal in {int(np.sum(both == 0))}')
  line += f'; median difference {np.median(both):+.2f} points' if both.size else ''
  return (line + f'. Only GMA learns in {chance.count((True, False))}, only AVG in {chance.count((False, True))}, '
          f'neither in {chance.count((True, True))}.')
