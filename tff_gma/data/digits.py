"""scikit-learn's handwritten digits as the embedded, offline default federated data set.

1,797 real 8x8 grey-scale digits (10 classes) ship inside scikit-learn, so this loads with no network. Pixels
are scaled from [0, 16] to [0, 1] and shaped [8, 8, 1]. The train/test split is fixed (stratified, 20% test,
independent of the run's seed) so that results of different runs are comparable.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow_federated as tff

from tff_gma.data import client_data
from tff_gma.data import partition

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
TEST_FRACTION = 0.2
_SPLIT_SEED = 20_220_601  # Fixed: the split never depends on a run's seed.
PARTITIONS = ('iid', 'label_skew')


@dataclasses.dataclass(frozen=True)
class CentralSplit:
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


@functools.lru_cache(maxsize=1)
def load_split() -> CentralSplit:
  """The fixed stratified train/test split of the digits, as float32 images in [0, 1] and int32 labels."""
  from sklearn import datasets  # Imported here: only this loader needs scikit-learn.
  digits = datasets.load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[..., np.newaxis]
  y = digits.target.astype(np.int32)
  rng = np.random.default_rng(_SPLIT_SEED)
  test = np.zeros(len(y), dtype=bool)
  for c in range(NUM_CLASSES):
    members = rng.permutation(np.flatnonzero(y == c))
    test[members[:int(round(TEST_FRACTION * len(members)))]] = True
  return CentralSplit(x[~test], y[~test], x[test], y[test])


def partition_indices(
    labels: np.ndarray, partition_name: str, num_clients: int, seed: int, classes_per_client: int = 2,
) -> list[np.ndarray]:
  if partition_name == 'iid':
    return partition.iid(labels, num_clients, seed)
  if partition_name == 'label_skew':
    return partition.label_skew(labels, num_clients, classes_per_client, seed)
  raise ValueError(f'unknown partition {partition_name!r}; expected one of {PARTITIONS}')


def federated_train_data(
    partition_name: str = 'iid', num_clients: int = 10, seed: int = 0, classes_per_client: int = 2,
) -> tff.simulation.datasets.ClientData:
  """The digits' training split as a `ClientData` of `num_clients` clients partitioned as named."""
  split = load_split()
  parts = partition_indices(split.y_train, partition_name, num_clients, seed, classes_per_client)
  return client_data.from_partition(split.x_train, split.y_train, parts)
