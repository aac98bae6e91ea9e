"""The tuning protocol of the Fashion-MNIST GMA studies, and the first study's cells, which the second re-runs.

Both tune learning rates on `GRIDS`, with the edge rule along `CLIENT_LR_LADDER` and `SERVER_LR_LADDER`, on a
validation split and `TUNE_SEEDS` partitions, then tau in `TAUS`; finals on `FINAL_SEEDS`. The protocol in full:
docs/research/gma_fmnist_study.md
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from training import config as config_lib
from training.studies.shared import gma_protocol
from training.studies.shared import study_runs

TUNE_SEEDS = (0, 1)
FINAL_SEEDS = (2, 3, 4, 5, 6)
VALIDATION_FRACTION = 0.2
STAGE1_TAU = 0.4  # The paper's default threshold.
TAUS = (0.2, 0.6)  # The tau stage, besides STAGE1_TAU.

# The paper's grid (App. D.4) with one step beyond each end, for the edge rule.
CLIENT_LR_LADDER = (0.0001, 0.001, 0.01, 0.05, 0.1, 0.2)
SERVER_LR_LADDER = (0.001, 0.01, 0.1, 1.0, 1.5, 2.0, 3.0)
SGD_SERVERS = ('fedavg', 'fedprox')
ADAPTIVE_SERVERS = ('fedadam', 'fedyogi')
# The starting grids: the paper's (App. D.4) less the values a pilot on fmnist_label500 showed never win
# (archives/gma_fmnist_pilot.csv): client lr 0.001; server lr 0.01 and 0.1 for SGD servers, 1, 1.5 and 2 for
# adaptive ones. The edge rule brings a cut value back when a winner sits next to it.
GRIDS = {
    'sgd': ((0.01, 0.05, 0.1), (1.0, 1.5, 2.0)),
    'adaptive': ((0.01, 0.05, 0.1), (0.01, 0.1)),
}


def grid(algorithm: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """(client learning rates, server learning rates) of an algorithm's starting grid."""
  return GRIDS['sgd' if algorithm in SGD_SERVERS else 'adaptive']


def beyond(ladder: Sequence[float], values: Sequence[float], value: float) -> Optional[float]:
  """The ladder's next value past `value` when `value` is an end of `values` (None when inner or off the ladder)."""
  index = ladder.index(value)
  if value == max(values) and index + 1 < len(ladder):
    return ladder[index + 1]
  if value == min(values) and index > 0:
    return ladder[index - 1]
  return None


def edge_extension(best: NamedTuple, client_lrs: Sequence[float], server_lrs: Sequence[float]) -> list[Any]:
  """The edge rule's points: `best` (a point with client_lr and server_lr) one ladder step past each edge of the
  grid it sits on, the client lr's first."""
  extension = []
  next_client = beyond(CLIENT_LR_LADDER, client_lrs, best.client_lr)
  next_server = beyond(SERVER_LR_LADDER, server_lrs, best.server_lr)
  if next_client is not None:
    extension.append(best._replace(client_lr=next_client))
  if next_server is not None:
    extension.append(best._replace(server_lr=next_server))
  return extension


class PartitionTuning:
  """How the Fashion-MNIST studies score a tuning point: the mean best validation accuracy of its runs on the tuning
  partitions, each read back from its run directory. A subclass says which runs a point has, and their configs."""

  def config(self, run: Any) -> config_lib.ExperimentConfig:
    raise NotImplementedError

  def tuning_runs(self, setting: str, method: Any, point: Any) -> list[Any]:
    raise NotImplementedError

  def summary(self, run: Any) -> Optional[dict[str, Any]]:
    return study_runs.finished_summary(self.config(run))

  def score(self, setting: str, method: Any, point: Any) -> Optional[float]:
    """Mean best validation accuracy over the tuning partitions; None until all finished."""
    summaries = [self.summary(r) for r in self.tuning_runs(setting, method, point)]
    if any(s is None for s in summaries):
      return None
    # A run stopped before any evaluation (its update non-finite round after round) scores 0.
    return float(np.mean([s.get('best_validation_accuracy') or 0.0 for s in summaries]))

  def best(self, setting: str, method: Any, points: Sequence[Any]) -> Optional[Any]:
    """The best-scored point, None until every point's runs finished; ties: the first listed."""
    scores = [self.score(setting, method, p) for p in points]
    if any(s is None for s in scores):
      return None
    return points[int(np.argmax(scores))]


# ----------------------------------------------------------------------------------------------------------------
# The first study's cells (`gma_fmnist`; `gma_fmnist_claims` re-runs them with the papers' rules).


class Setting(NamedTuple):
  label: str
  config: dict[str, Any]  # ExperimentConfig fields.
  methods: tuple[tuple[str, str], ...]
  rounds: int
  paper_row: Optional[str]  # The key of the paper's Table 2 row in PAPER_TABLE2.


METHODS = (('fedavg', 'mean'), ('fedavg', 'gma'), ('fedprox', 'mean'), ('fedprox', 'gma'),
           ('fedadam', 'mean'), ('fedadam', 'gma'), ('fedadam', 'gma_dropin'),
           ('fedyogi', 'mean'), ('fedyogi', 'gma'), ('fedyogi', 'gma_dropin'))
# Evaluated every EVAL_EVERY-th round and in each of the last LAST_EVALS rounds: the best over rounds is the best of
# those evaluations, the last-10 mean is over 10 consecutive rounds. Why not every round: evaluating the 12,000
# validation (10,000 test) examples costs about as much as training a 500-client round; every 5th round keeps the
# part of a round that is not training small.
EVAL_EVERY = 5
LENET = dict(dataset='fashion_mnist', model='lenet', local_epochs=1, batch_size=16, eval_every=EVAL_EVERY,
             eval_last_rounds=gma_protocol.LAST_EVALS, participation_eval=False, clients_per_round=10)
SETTINGS = {
    # Pinned to TensorFlow's default thread count in the worker: this cell started before the runner's default
    # became 1, and one cell runs with one setting, so its runs differ only in what the study varies.
    'fmnist_label500': Setting('label skew k=2, 500 clients, 10 per round',
                               dict(LENET, partition='label_skew', classes_per_client=2, num_clients=500,
                                    worker_intra_op_threads=0),
                               METHODS, 150, 'non-iid 500'),
    'fmnist_label100': Setting('label skew k=2, 100 clients, 10 per round',
                               dict(LENET, partition='label_skew', classes_per_client=2, num_clients=100),
                               METHODS, 100, 'non-iid 100'),
    'fmnist_iid100': Setting('iid, 100 clients, 10 per round', dict(LENET, partition='iid', num_clients=100),
                             METHODS, 100, 'iid 100'),
}

# The paper's Table 2, Fashion-MNIST rows: best test accuracy %, (AVG, GMA) per algorithm.
PAPER_TABLE2 = {
    'non-iid 500': {'fedavg': (78.02, 78.82), 'fedprox': (76.21, 77.77), 'fedadam': (78.80, 81.28),
                    'fedyogi': (78.66, 80.58)},
    'non-iid 100': {'fedavg': (85.58, 86.27), 'fedprox': (85.14, 85.78), 'fedadam': (85.91, 87.18),
                    'fedyogi': (85.32, 86.40)},
    'non-iid 10': {'fedavg': (87.43, 88.37), 'fedprox': (88.25, 88.55), 'fedadam': (87.26, 87.50),
                   'fedyogi': (87.39, 88.60)},
    'iid 500': {'fedavg': (83.07, 83.94), 'fedprox': (83.47, 82.77), 'fedadam': (85.44, 86.73),
                'fedyogi': (85.55, 86.42)},
    'iid 100': {'fedavg': (88.03, 88.43), 'fedprox': (87.05, 87.46), 'fedadam': (88.66, 89.16),
                'fedyogi': (88.63, 89.70)},
    'iid 10': {'fedavg': (89.35, 89.65), 'fedprox': (89.92, 90.12), 'fedadam': (88.66, 88.86),
               'fedyogi': (88.85, 89.85)},
}
