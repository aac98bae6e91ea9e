"""GMA where the paper says it helps most: Table 3's OOD skew, Table 9's epochs and re-runs, on Fashion-MNIST.

    python -m training.studies.gma_fmnist_claims [--stage=all|tune|final|collect] [--settings=...] [--shard=i/n]

`gma_fmnist`'s protocol plus mu tuned, Reddi's servers, GMA at tau 0.4; `--check_construction` checks that the colour
bites. Cells, rounds, budget, commands: docs/research/gma_fmnist_claims.md"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import json  # pylint: disable=g-import-not-at-top
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

from tff_gma import models
from tff_gma.data import loaders
from training import command_line
from training import config as config_lib
from training.engine import client_execution
from training.runner import experiment
from training.studies.shared import claims_report
from training.studies.shared import fmnist_protocol
from training.studies.shared import gma_protocol
from training.studies.shared import study_runs

TUNE_SEEDS = fmnist_protocol.TUNE_SEEDS
FINAL_SEEDS = fmnist_protocol.FINAL_SEEDS
FINAL_SEEDS_LONG_EPOCHS = FINAL_SEEDS[:3]  # The fewest seeds a cell may have, for E >= 10 if the budget forces it.
STAGE1_TAU = fmnist_protocol.STAGE1_TAU
TAUS = fmnist_protocol.TAUS
FEDPROX_MU = 0.01  # Stage 1's mu (the runner's default), then the rest of FedProx's grid at the lr winner.
MUS = (0.001, 0.1, 1.0)  # Stage 2 (FedProx), besides FEDPROX_MU: FedProx's grid {0.001, 0.01, 0.1, 1}.
LAST_EVALS = gma_protocol.LAST_EVALS
TAU_FIXED = 'tau0.4'  # A method variant: GMA at the paper's default tau, the learning rates tuned at it.


class Method(NamedTuple):
  algorithm: str
  aggregator: str
  variant: str = ''  # '' (tau tuned for GMA) or TAU_FIXED.

  @property
  def key(self) -> str:
    return f'{self.algorithm}/{self.aggregator}' + (f'@{self.variant}' if self.variant else '')


class Point(NamedTuple):
  client_lr: float
  server_lr: float
  tau: float
  mu: Optional[float]  # FedProx's mu; None for the other algorithms.


class Run(NamedTuple):
  """One run: gma_protocol.Run's fields and FedProx's mu (the runner directory's name says it for FedProx)."""
  setting: str
  algorithm: str
  aggregator: str
  client_lr: float
  server_lr: float
  tau: float
  mu: Optional[float]
  seed: int
  tuning: bool

  @property
  def name(self) -> str:
    mu = '' if self.mu is None else f'-mu{self.mu:g}'
    return (f'{self.setting}-{self.algorithm}-{self.aggregator}-clr{self.client_lr:g}-slr{self.server_lr:g}'
            f'-tau{self.tau:g}{mu}-{"tune" if self.tuning else "final"}-seed{self.seed}')


class Setting(NamedTuple):
  label: str
  config: dict[str, Any]  # ExperimentConfig fields.
  methods: tuple[Method, ...]
  rounds: int
  ood: bool  # Primary metric: the OOD test clients' accuracy (else the central test split's).
  paper: Optional[tuple[str, Any]]  # (table, key) into PAPER_TABLE3 / PAPER_TABLE9.
  tuned_at: Optional[str] = None  # Another setting whose choices its methods take (those not in `fixed`).
  check_tuning: bool = False  # With tuned_at: also score the source's learning rates and their client-lr
  # neighbours here (tau 0.4), reported only.
  seeds: Optional[tuple[int, ...]] = None  # Final seeds when not the study's.
  fixed: Optional[dict[str, Point]] = None  # Method key -> its hyperparameters, not tuned here.


def _methods(algorithms: Sequence[str], dropin: bool = True, tau_fixed: bool = False) -> tuple[Method, ...]:
  out = []
  for algorithm in algorithms:
    out += [Method(algorithm, 'mean'), Method(algorithm, 'gma')]
    if tau_fixed:
      out.append(Method(algorithm, 'gma', TAU_FIXED))
    if dropin and algorithm in fmnist_protocol.ADAPTIVE_SERVERS:
      out.append(Method(algorithm, 'gma_dropin'))
  return tuple(out)


ALL_ALGORITHMS = ('fedavg', 'fedprox', 'fedadam', 'fedyogi')
# The re-runs: the rows that FedProx's corrected sign and Reddi et al.'s adaptive servers change.
RERUN_METHODS = _methods(('fedprox', 'fedadam', 'fedyogi'))
# Table 3: AVG and GMA (Algorithm 2 for the adaptive ones), GMA also at the paper's tau 0.4 (App. D.1: "Throughout
# the experiments we have maintained tau = 0.4"): tau is tuned on the training clients' own validation split, which
# cannot see what masking does out of distribution (in cfm100_mixed every algorithm took the grid's smallest, 0.2).
# The variant shares GMA's learning-rate (and mu) tuning runs, which run at tau 0.4: it adds only its finals.
OOD_METHODS = _methods(ALL_ALGORITHMS, dropin=False, tau_fixed=True)
EPOCH_METHODS = _methods(('fedavg',), tau_fixed=True)
# The re-run cells and the archived study's cells they re-run (its results: docs/research/gma_fmnist_study.json).
ARCHIVED = {'rerun_label500': 'fmnist_label500', 'rerun_label100': 'fmnist_label100', 'rerun_iid100': 'fmnist_iid100'}
_LABEL = dict(fmnist_protocol.LENET, partition='label_skew', classes_per_client=2)
# The 10-client cells train a tenth of the training split: 60,000 examples a round (days a cell) do not fit the
# budget. One stated class-stratified subset (6,000 examples, 600 of each class, drawn from a fixed seed:
# `federated.SUBSET_SEED`) for both arms, every seed and every E; the test split and the OOD test clients stay
# whole. The cells at 100 and 500 clients train all of it.
TEN_CLIENT_SUBSET = 0.1
_FULL10 = dict(num_clients=10, clients_per_round=10, train_subset_fraction=TEN_CLIENT_SUBSET)
# The archived study's fmnist_label100 choices (docs/research/gma_fmnist_study.json), for the horizon and batch
# cells' FedAvg.
_LABEL100_FEDAVG = {'fedavg/mean': Point(0.01, 1.0, STAGE1_TAU, None), 'fedavg/gma': Point(0.01, 1.5, 0.2, None)}


def _settings() -> dict[str, Setting]:
  """The cells in priority order (the budget cuts from the end: batch, horizon, E = 20, ...)."""
  out = {}
  for name, source in ARCHIVED.items():  # The re-runs.
    archived = fmnist_protocol.SETTINGS[source]
    config = {k: v for k, v in archived.config.items() if k != 'worker_intra_op_threads'}
    out[name] = Setting(archived.label + ' (FedProx / adaptive re-run)', config, RERUN_METHODS, archived.rounds,
                        False, ('table2', archived.paper_row))
  for skew, partition, mixed in (('feature', 'feature_skew_shared', 'No'), ('mixed', 'mixed_skew_shared', 'Yes')):
    extra = dict(fmnist_protocol.LENET, partition=partition, **({'classes_per_client': 2} if mixed == 'Yes' else {}))
    out[f'cfm10_{skew}'] = Setting(f'coloured FMNIST, {skew} skew, 10 clients, all per round',
                                   dict(extra, **_FULL10), OOD_METHODS, 100, True, ('table3', (mixed, 10)))
    out[f'cfm100_{skew}'] = Setting(f'coloured FMNIST, {skew} skew, 100 clients, 10 per round',
                                    dict(extra, num_clients=100), OOD_METHODS, 100, True, ('table3', (mixed, 100)))
  # Table 9's axis; learning rates from E = 1, checked at the long E: at E = 20 and at E = 10, so that the check
  # stands when the budget cuts E = 20.
  for epochs in (1, 3, 5, 10, 20):
    out[f'epochs{epochs}'] = Setting(
        f'label skew k=2, 10 clients, all per round, E={epochs}', dict(_LABEL, **_FULL10, local_epochs=epochs),
        EPOCH_METHODS, 100, False, ('table9', epochs), None if epochs == 1 else 'epochs1', epochs >= 10,
        FINAL_SEEDS_LONG_EPOCHS if epochs >= 10 else None)
  label100 = dict(_LABEL, num_clients=100)
  out['horizon_label100'] = Setting(  # The horizon: FedAvg at the archived choices, FedYogi at the re-run's.
      'label skew k=2, 100 clients, 10 per round, 300 rounds', label100, _methods(('fedavg', 'fedyogi'), False), 300,
      False, ('table2', 'non-iid 100'), 'rerun_label100', fixed=_LABEL100_FEDAVG)
  # The batch: batch 16 is the archived study's fmnist_label100 FedAvg rows (the same configs); batch 64 is new, at
  # the batch-16 choices (a retuning at batch 64 would cost a cell's tuning: the first thing the budget cuts).
  out['batch64_label100'] = Setting('label skew k=2, 100 clients, 10 per round, batch 64',
                                    dict(label100, batch_size=64), _methods(('fedavg',)), 100, False,
                                    ('table2', 'non-iid 100'), fixed=_LABEL100_FEDAVG)
  return out


SETTINGS = _settings()


def check_construction(partition: str, num_clients: int, seed: int = 0, epochs: int = 2, batch_size: int = 64,
                       model: str = 'lenet', data_dir: Optional[str] = None,
                       train_subset_fraction: float = 1.0) -> dict[str, Any]:
  """Does a coloured Fashion-MNIST construction bite? Trains `model` centrally (plain Keras, Adam, `epochs` epochs)
  on the union of the training clients' coloured examples and returns its accuracy on the in-distribution test
  split and on the held-out OOD test clients, with the gap in points (in-distribution minus OOD). A construction
  bites when the gap is clearly positive: the model learnt the colour where the training clients' colour predicts
  the label, and the OOD clients' colourings punish it. `train_subset_fraction`: the cell's training subset."""
  kwargs = {'classes_per_client': 2} if partition.startswith('mixed') else {}
  data = loaders.load_federated_data('fashion_mnist', partition, num_clients, seed, data_dir,
                                     train_subset_fraction=train_subset_fraction, **kwargs)
  if data.ood_test is None:
    raise ValueError(f'partition {partition!r} has no OOD test clients; expected a colour partition')
  x, y = data.train.pooled_arrays()
  tf.keras.utils.set_random_seed(seed)
  net = models.keras_builder(model, data.input_shape, data.num_classes)()
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # The models end in logits.
  net.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss=loss, metrics=['accuracy'])
  order = np.random.default_rng(seed).permutation(len(y))
  net.fit(x[order], y[order], batch_size=batch_size, epochs=epochs, verbose=0)
  in_distribution = float(net.evaluate(data.test_x, data.test_y, batch_size=1000, verbose=0)[1])
  ood = float(net.evaluate(data.ood_test_x, data.ood_test_y, batch_size=1000, verbose=0)[1])
  return {'partition': partition, 'num_clients': num_clients, 'seed': seed, 'epochs': epochs, 'model': model,
          'train_examples': len(y), 'in_distribution': in_distribution, 'ood': ood,
          'gap_points': 100 * (in_distribution - ood)}


# The paper's Table 3 (001_*.txt; 000_*.txt's extraction agrees), FedCMNIST block, best test accuracy %: (mean, std)
# of AVG and of GMA per algorithm. Keys (Mixed, # clients): its "Mixed Non-IID" column is "Yes" for the first three
# rows (500, 100, 10 clients) and the next three rows, "No" (feature skew alone); 10 sampled a round, i.e. all of
# them in the 10-client rows. (001's extraction prints a stray dataset label "CMMS1" at the first "No" row; the
# caption names FedRotMNIST too, which Table 1 does not list: we read all six rows as FedCMNIST's.)
PAPER_TABLE3 = {
    ('Yes', 500): {'fedavg': ((84.48, 0.27), (86.22, 0.22)), 'fedprox': ((83.15, 0.17), (86.25, 0.28)),
                   'fedadam': ((84.22, 0.42), (87.16, 0.37)), 'fedyogi': ((84.06, 0.36), (87.05, 0.44))},
    ('Yes', 100): {'fedavg': ((85.62, 0.28), (88.32, 0.32)), 'fedprox': ((83.3, 0.33), (86.92, 0.28)),
                   'fedadam': ((84.19, 0.42), (86.26, 0.38)), 'fedyogi': ((83.32, 0.48), (84.79, 0.22))},
    ('Yes', 10): {'fedavg': ((86.77, 0.43), (89.17, 0.38)), 'fedprox': ((86.84, 0.38), (89.33, 0.34)),
                  'fedadam': ((85.75, 0.53), (89.28, 0.44)), 'fedyogi': ((86.67, 0.53), (89.76, 0.37))},
    ('No', 500): {'fedavg': ((89.03, 0.46), (90.12, 0.26)), 'fedprox': ((87.13, 0.44), (87.15, 0.32)),
                  'fedadam': ((87.02, 0.08), (87.18, 0.05)), 'fedyogi': ((87.78, 0.08), (88.44, 0.08))},
    ('No', 100): {'fedavg': ((89.88, 0.32), (91.37, 0.16)), 'fedprox': ((90.62, 0.16), (90.83, 0.22)),
                  'fedadam': ((87.38, 0.12), (88.24, 0.16)), 'fedyogi': ((90.27, 0.08), (91.10, 0.06))},
    ('No', 10): {'fedavg': ((89.37, 0.83), (90.36, 0.61)), 'fedprox': ((89.61, 0.88), (90.22, 0.78)),
                 'fedadam': ((88.39, 0.86), (89.4, 0.84)), 'fedyogi': ((88.78, 0.83), (89.88, 0.75))},
}
# The paper's Table 9 (App. D.5): FedAvg on non-iid Fashion-MNIST, 10 clients in full participation, average test
# accuracy % over the last 10 rounds "on convergence", (AVG, GMA) per number of local epochs. E = 1 is not in it.
PAPER_TABLE9 = {3: (89.91, 91.73), 5: (85.71, 87.29), 10: (84.13, 87.11), 20: (80.27, 86.66)}


def paper_numbers(setting: str, algorithm: str) -> Optional[tuple[float, float]]:
  """(AVG, GMA) the paper gives for a cell's algorithm (Table 3 best, Table 9 last-10, Table 2 best), or None."""
  paper = SETTINGS[setting].paper
  if paper is None:
    return None
  table, key = paper
  if table == 'table3':
    row = PAPER_TABLE3[key].get(algorithm)
    return None if row is None else (row[0][0], row[1][0])
  if table == 'table9':
    return PAPER_TABLE9.get(key) if algorithm == 'fedavg' else None
  return fmnist_protocol.PAPER_TABLE2.get(key, {}).get(algorithm)


class Study(fmnist_protocol.PartitionTuning):
  """The cells' runs and what is known of them; gma_fmnist.Study's protocol with FedProx's mu tuned (a stage at the
  learning-rate winner, before tau), GMA at a fixed tau as a variant, and cells that take another's choices."""

  def __init__(self, settings: Sequence[str], methods: Sequence[str], tune_seeds: Sequence[int],
               final_seeds: Sequence[int], output_dir: str, rounds: Optional[int] = None,
               execution: str = client_execution.WORKER):
    self.settings, self.tune_seeds, self.seeds = list(settings), tuple(tune_seeds), tuple(final_seeds)
    self.methods = {s: [m for m in SETTINGS[s].methods if not methods or m.key in methods] for s in settings}
    self.output_dir, self.rounds, self.execution = output_dir, rounds, execution

  def config(self, run: Run) -> config_lib.ExperimentConfig:
    setting = SETTINGS[run.setting]
    extra = {} if run.mu is None else {'proximal_strength': run.mu}
    return config_lib.ExperimentConfig(
        **setting.config, **extra, algorithm=run.algorithm, aggregator=run.aggregator, client_lr=run.client_lr,
        server_lr=run.server_lr, tau=run.tau, seed=run.seed, rounds=self.rounds or setting.rounds,
        validation_fraction=fmnist_protocol.VALIDATION_FRACTION if run.tuning else 0.0, client_execution=self.execution,
        adaptive_optimizer='reddi', output_dir=os.path.join(self.output_dir, 'runs', run.name))

  def tuning_runs(self, setting: str, method: Method, point: Point) -> list[Run]:
    return [Run(setting, method.algorithm, method.aggregator, *point, seed, True) for seed in self.tune_seeds]

  def final_runs(self, setting: str, method: Method, point: Point) -> list[Run]:
    seeds = SETTINGS[setting].seeds or self.seeds
    return [Run(setting, method.algorithm, method.aggregator, *point, seed, False) for seed in seeds]

  def tuned(self, setting: str, method: Method) -> tuple[list[Point], Optional[Point], dict[str, Any]]:
    """(this cell's tuning points known so far, the chosen point or None while incomplete, what the tuning found)."""
    cell = SETTINGS[setting]
    if cell.fixed and method.key in cell.fixed:
      return [], cell.fixed[method.key], {'from': 'fixed', 'edge': False}
    if cell.tuned_at is None:
      return self._tune(setting, method)
    _, chosen, found = self.tuned(cell.tuned_at, method)
    found = dict(found, **{'from': cell.tuned_at})
    if not cell.check_tuning:
      return [], chosen, found
    if chosen is None:
      return [], None, found
    ladder = fmnist_protocol.CLIENT_LR_LADDER
    index = ladder.index(chosen.client_lr)
    centre = chosen._replace(tau=STAGE1_TAU)
    points = [centre] + [centre._replace(client_lr=ladder[i]) for i in (index - 1, index + 1) if 0 <= i < len(ladder)]
    own = self.best(setting, method, points)
    found['check'] = None if own is None else {'own_winner': own._asdict(), 'same_learning_rates': own == centre}
    return points, chosen if own is not None else None, found

  def _tune(self, setting: str, method: Method) -> tuple[list[Point], Optional[Point], dict[str, Any]]:
    """Learning rates on the study's grid with its edge rule (tau 0.4, mu 0.01), then FedProx's mu, then GMA's tau."""
    client_lrs, server_lrs = fmnist_protocol.grid(method.algorithm)
    mu = FEDPROX_MU if method.algorithm == 'fedprox' else None
    points = [Point(c, s, STAGE1_TAU, mu) for c in client_lrs for s in server_lrs]
    best = self.best(setting, method, points)
    if best is None:
      return points, None, {}
    extension = fmnist_protocol.edge_extension(best, client_lrs, server_lrs)
    points += extension
    chosen = self.best(setting, method, [best] + extension)
    if chosen is None:
      return points, None, {}
    found = {'grid_winner': best._asdict(), 'edge': chosen in extension}
    for stage, values in (('mu', MUS if mu is not None else ()),
                          ('tau', TAUS if gma_protocol.is_gma(method.aggregator) and not method.variant else ())):
      candidates = [chosen._replace(**{stage: v}) for v in values]
      points += candidates
      chosen = self.best(setting, method, [chosen] + candidates)
      if chosen is None:
        return points, None, {}
    return points, chosen, found

  def runnable(self, stages: str) -> tuple[list[Run], int]:
    """(runs whose inputs are known, number of (setting, method) cells still blocked on unfinished tuning)."""
    runs, blocked = [], 0
    for setting in self.settings:
      for method in self.methods[setting]:
        points, chosen, _ = self.tuned(setting, method)
        if stages in ('all', 'tune'):
          source = SETTINGS[setting].tuned_at  # Its tuning runs, also when the source is not among the settings.
          if source is not None and not (SETTINGS[setting].fixed or {}).get(method.key):
            runs += [r for p in self.tuned(source, method)[0] for r in self.tuning_runs(source, method, p)]
          runs += [r for p in points for r in self.tuning_runs(setting, method, p)]
        if chosen is None:
          blocked += 1
        elif stages in ('all', 'final'):
          runs += self.final_runs(setting, method, chosen)
    return list(dict.fromkeys(runs)), blocked


# ----------------------------------------------------------------------------------------------------------------
# Results.

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The archived study's collected results.
ARCHIVED_RESULTS = os.path.join(_ROOT, 'docs', 'research', 'gma_fmnist_study.json')
_ACCURACIES = {'test': 'test/accuracy', 'ood': 'ood_test/accuracy'}  # A record's prefix -> its metrics.csv column.

FMNIST_TRAIN_EXAMPLES = 60_000
# Items 4 and 5 set beside the 100-round, batch-16 runs of the same methods: FedAvg's are the archived study's
# fmnist_label100 runs (the horizon and batch cells take its choices), FedYogi's the re-run's (it takes its choices).
BESIDE = {
    'horizon_label100': claims_report.Beside(
        {'fedavg': ('archived', 'fmnist_label100'), 'fedyogi': ('study', 'rerun_label100')}, '100 rounds'),
    'batch64_label100': claims_report.Beside({'fedavg': ('archived', 'fmnist_label100')}, 'batch 16'),
}


def _subset_note(config: dict[str, Any]) -> str:
  """A cell on the stated subset trains a fraction of the examples a client, so that fraction of the local steps the
  paper's clients take at the same E: said under the cell's heading, beside the paper's numbers."""
  fraction = config.get('train_subset_fraction', 1.0)
  if fraction == 1.0:
    return ''
  per_client = fraction * FMNIST_TRAIN_EXAMPLES / config['num_clients']
  steps = per_client * config['local_epochs'] / config['batch_size']
  return (f"Trains the stated {fraction:g} stratified subset: ~{per_client:,.0f} examples a client, ~{steps:,.0f} "
          f"local steps a round at E = {config['local_epochs']} and batch {config['batch_size']}, where the "
          f"full training split (the paper's) would give ~{steps / fraction:,.0f}: at the same E, fewer local steps "
          f"than the paper's clients take.")
# What the report needs to know of each cell.
REPORT_CELLS = {name: claims_report.Cell(
    cell.label, ('ood', 'test') if cell.ood else ('test',), cell.paper[0] if cell.paper else None,
    {a: paper_numbers(name, a) for a in ALL_ALGORITHMS}, cell.config['local_epochs'], ARCHIVED.get(name),
    _subset_note(cell.config), BESIDE.get(name)) for name, cell in SETTINGS.items()}


class Collected(NamedTuple):
  records: list[dict[str, Any]]  # One per (setting, method) of the whole cells.
  unscored: list[str]  # Final runs that finished with no evaluation (stopped early): their cells are left out.


def collect(study: Study) -> Collected:
  """One record per (setting, method) of the settings whose final runs all finished (a cell whole or not at all):
  per accuracy (the central test split's; the OOD test clients' for the coloured cells) and final seed, the best and
  last-10 accuracy, the convergence rule's rise and verdict, whether it ended at chance, whether the run stopped
  early (non-finite updates: scored on the rounds it ran), and the curves (for the figures only). A cell with a
  final run stopped before its first evaluation has nothing to score: left out, the run named in `unscored`."""
  records, unscored = [], []
  for setting in study.settings:
    cell, empty = [], []
    for method in study.methods[setting]:
      _, chosen, found = study.tuned(setting, method)
      finals = [] if chosen is None else study.final_runs(setting, method, chosen)
      summaries = [study.summary(r) for r in finals]  # Each a read of the run's summary.json: once.
      if chosen is None or any(summary is None for summary in summaries):
        break
      record = {'setting': setting, 'method': method.key, 'algorithm': method.algorithm,
                'aggregator': method.aggregator, 'variant': method.variant, **chosen._asdict(),
                'tuning': found, 'rounds': study.config(finals[0]).rounds, 'seeds': [r.seed for r in finals],
                'stopped': ['stopped' in summary for summary in summaries]}
      if not gma_protocol.is_gma(method.aggregator):
        record['tau'] = None
      read = [study_runs.curves_with_rounds(study.config(r).output_dir, list(_ACCURACIES.values())) for r in finals]
      prefixes = REPORT_CELLS[setting].accuracies
      empty += [r.name for r, run in zip(finals, read) if not all(run[_ACCURACIES[p]][1] for p in prefixes)]
      for prefix in prefixes:
        tested = [run[_ACCURACIES[prefix]] for run in read]
        if all(values for _, values in tested):
          record.update(_accuracy(prefix, tested))
      cell.append(record)
    else:  # No method stopped short: the cell is whole.
      records += [] if empty else cell
      unscored += empty
  return Collected(records, unscored)


def _accuracy(prefix: str, tested: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
  """A method's final runs on one accuracy ((evaluated rounds, accuracies) per seed), as a record's fields."""
  values = [v for _, v in tested]
  last10 = [float(np.mean(v[-LAST_EVALS:])) for v in values]
  return {f'{prefix}_best': [float(np.max(v)) for v in values], f'{prefix}_last10': last10,
          f'{prefix}_rise': [gma_protocol.late_rise(v) for v in values],
          f'{prefix}_converged': [gma_protocol.converged(v) for v in values],
          f'{prefix}_collapsed': [gma_protocol.at_chance(v) for v in last10], f'{prefix}_curves': tested}


def write_results(study: Study, collected: Collected, archived_path: str = ARCHIVED_RESULTS) -> str:
  """results.md, results.json and a figure per finished cell under the study's output directory
  (`shared.claims_report`); the cost table reads every finished run of the study's settings."""
  cost = study_runs.cost_rows(study.settings, study.runnable('all')[0], study.summary)
  return claims_report.write(study.output_dir, study.settings, collected.records, REPORT_CELLS, cost, archived_path,
                             collected.unscored)


FLAGS = flags.FLAGS


def define_flags() -> None:
  gma_protocol.define_study_flags(SETTINGS, 'outputs/gma_fmnist_claims')
  flags.DEFINE_list('tune_seeds', [str(s) for s in TUNE_SEEDS], 'Tuning partitions (seeds).')
  flags.DEFINE_list('seeds', [str(s) for s in FINAL_SEEDS], 'Seeds of the final runs.')
  flags.DEFINE_boolean('check_construction', False, 'Only the construction check: central LeNet on the training '
                       'clients\' union, in-distribution vs OOD accuracy, for each coloured setting; then exit.')
  flags.DEFINE_integer('check_epochs', 2, 'Epochs of the construction check\'s central training.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  try:
    shard, num_shards = gma_protocol.checked_settings_and_shard(SETTINGS)
    if FLAGS.check_epochs < 1:
      raise ValueError(f'check_epochs must be at least 1, got {FLAGS.check_epochs}')
    study = Study(FLAGS.settings, FLAGS.methods, [int(s) for s in FLAGS.tune_seeds], [int(s) for s in FLAGS.seeds],
                  FLAGS.output_dir, FLAGS.rounds or None, FLAGS.client_execution)
    for setting in study.settings:  # Every setting is checked before anything runs.
      for method in study.methods[setting]:
        experiment.validate(study.config(Run(setting, method.algorithm, method.aggregator, 0.01, 1.0, STAGE1_TAU,
                                             FEDPROX_MU if method.algorithm == 'fedprox' else None, 0, True)))
  except ValueError as e:
    raise app.UsageError(f'invalid study settings: {e}') from e
  if FLAGS.check_construction:
    for setting in [s for s in study.settings if SETTINGS[s].ood]:
      config = SETTINGS[setting].config
      print(setting, json.dumps(check_construction(
          config['partition'], config['num_clients'], epochs=FLAGS.check_epochs,
          train_subset_fraction=config.get('train_subset_fraction', 1.0))), flush=True)
    return
  if FLAGS.stage != 'collect':
    command_line.start_simulation()
    study_runs.run_all(study, FLAGS.stage, shard, num_shards)
  print(write_results(study, collect(study)))
  print(f'Results: {os.path.abspath(study.output_dir)}/results.md')


if __name__ == '__main__':
  define_flags()
  command_line.run(main, command_line.STUDY_RESUMES)
