"""What a benchmark run measures: its settings, presets, default entries, targets and the digits setup.

`Settings` with the full, --quick and --smoke presets; `training.bench.cli` turns the flags into them and the sections
(`training.bench.sections`, `small_rounds`, `runner_runs`, `multi_worker`) read them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from training import config as config_lib
from training.engine import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = 'mean'
# Parameter variants benchmarked by default besides every aggregator of `registry.AGGREGATORS` (the targets
# concern secure GMA and RFA's number of passes).
VARIANTS = ('gma+secure', 'gma_binary+secure', 'rfa+num_passes=1', 'rfa+num_passes=5')
AGGREGATORS = tuple(registry.AGGREGATORS) + VARIANTS
PIPELINE = ('stock_fedavg', 'stock_fedavg_iterator', 'project_pipeline')
SECTIONS = ('rounds', 'aggregation', 'scaling', 'client_execution', 'floor', 'breakdown', 'peers', 'runner',
            'multi_worker')
GIB = 1024**3
MEMORY_LIMIT_GIB = 24.0
# Round-time targets (ratios to `mean` in the same run).
GMA_TARGET, RFA_3_TARGET, ELASTIC_TARGET = 1.10, 1.5, 1.3
ROUND_TARGETS = {'gma': GMA_TARGET, 'gma_binary': GMA_TARGET, 'rfa': RFA_3_TARGET, 'elastic': ELASTIC_TARGET}
PIPELINE_TARGET = 0.95

# The digits setup (the runner's defaults: client SGD 0.05 with momentum 0.9, server SGD 1).
ALGORITHM_CONFIG = config_lib.AlgorithmConfig()
BATCH_SIZE = config_lib.ExperimentConfig.batch_size  # The runner's default client batch.
SECURE_VALUE_BOUND = 1.0  # Per-coordinate bound of a model update for secure entries (digits models: |d| << 1).
PROBE_VALUE_BOUND = 4.0  # The probe's values are standard normal.
DIGITS_TRAIN_EXAMPLES = 1437
FLOOR_SHAPES = {'cnn': (8, 8, 1), 'logistic': (8, 8, 1), 'lenet': (28, 28, 1)}  # The digits' and Fashion-MNIST's.


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one run measures; --quick and --smoke pick smaller ones."""
  sections: tuple[str, ...] = SECTIONS
  aggregators: tuple[str, ...] = AGGREGATORS  # Candidate entries (see `training.bench.candidates`).
  model: str = 'cnn'
  # The candidates' client training loop: the project's (`fedavg_family.build_client_work`), recorded; TFF's
  # default DATASET_REDUCE loop is measured by the `stock_fedavg` / `stock_fedavg_iterator` pair.
  loop: str = 'iterator'
  round_clients: int = 10
  round_repetitions: int = 7
  aggregation_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
  aggregation_clients: tuple[int, ...] = (10, 100)
  aggregation_repetitions: int = 5
  scaling_clients: tuple[int, ...] = (10, 50, 100, 500)
  scaling_aggregators: tuple[str, ...] = ('mean', 'gma', 'rfa')
  scaling_repetitions: int = 3
  # client_execution: models (cnn: the digits; resnet18_gn: generated CIFAR-10-shaped examples), clients, the
  # generated examples per client, interleaved repetitions.
  client_execution_models: tuple[str, ...] = ('cnn', 'resnet18_gn')
  client_execution_clients: int = 10
  client_execution_examples: int = 300
  client_execution_repetitions: int = 3
  # floor: models, each on its data shape (FLOOR_SHAPES), clients x generated examples, the batch, sweeps.
  floor_models: tuple[str, ...] = ('cnn', 'lenet')
  floor_clients: int = 10
  floor_examples: tuple[int, ...] = (144, 600)  # Per model: the digits' 1,437 / 10; Fashion-MNIST's 6,000 / 10.
  floor_batch_size: int = 16
  floor_repetitions: int = 7
  # breakdown and peers (`training.bench.small_rounds`): (model, generated examples per client) cases, on the floor's
  # shapes and batch; clients; sweeps.
  breakdown_cases: tuple[tuple[str, int], ...] = (('lenet', 120), ('cnn', 144))
  peers_cases: tuple[tuple[str, int], ...] = (('lenet', 120), ('lenet', 600), ('cnn', 144))
  small_rounds_clients: int = 10
  breakdown_repetitions: int = 9
  peers_repetitions: int = 7
  # runner (`training.bench.runner_runs`): `python -m training.run` at its defaults for `runner_default_rounds`,
  # and shaped as the label500 study cell for `runner_study_rounds`, beside that many floor rounds; repetitions;
  # smoke: the digits and a logistic model instead of Fashion-MNIST and LeNet.
  runner_default_rounds: int = 30
  runner_study_rounds: int = 150
  runner_repetitions: int = 2
  runner_smoke: bool = False
  # multi_worker (`training.bench.multi_worker`): (model, clients, generated examples per client) cases on the floor's
  # shapes and batch; worker counts (worker i pinned to core i mod cores); sweeps.
  multi_worker_cases: tuple[tuple[str, int, int], ...] = (('lenet', 10, 600), ('lenet', 100, 30))
  multi_worker_counts: tuple[int, ...] = (1, 2, 4)
  multi_worker_repetitions: int = 7
  seed: int = 0


QUICK = Settings(
    round_repetitions=3,
    aggregation_sizes=(10_000, 1_000_000),
    aggregation_clients=(10,),
    aggregation_repetitions=3,
    scaling_clients=(10, 100, 500),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
    client_execution_examples=100,
    client_execution_repetitions=2,
    floor_repetitions=3,
    breakdown_repetitions=5,
    peers_repetitions=5,
    runner_repetitions=1,
    multi_worker_repetitions=5,
)
# For the tests: every section and key, on sizes that take seconds.
SMOKE = Settings(
    aggregators=('mean', 'gma'),
    model='logistic',
    round_clients=3,
    round_repetitions=1,
    aggregation_sizes=(1000,),
    aggregation_clients=(3,),
    aggregation_repetitions=1,
    scaling_clients=(2, 4),
    scaling_aggregators=('mean',),
    scaling_repetitions=1,
    client_execution_models=('logistic',),  # The section's test adds resnet18_gn (its build takes a minute).
    client_execution_clients=2,
    client_execution_examples=4,
    client_execution_repetitions=1,
    floor_models=('logistic',),
    floor_clients=2,
    floor_examples=(20,),
    floor_repetitions=1,
    breakdown_cases=(('logistic', 20),),
    peers_cases=(('logistic', 20),),
    small_rounds_clients=2,
    breakdown_repetitions=1,
    peers_repetitions=1,
    runner_default_rounds=2,
    runner_study_rounds=3,
    runner_repetitions=1,
    runner_smoke=True,
    multi_worker_cases=(('logistic', 4, 20),),
    multi_worker_counts=(1, 2),
    multi_worker_repetitions=1,
)
MODES = {'full': Settings(), 'quick': QUICK, 'smoke': SMOKE}


def log(message: str) -> None:
  """A progress line on stderr, with the time."""
  print(f'[bench {time.strftime("%H:%M:%S")}] {message}', file=sys.stderr, flush=True)
