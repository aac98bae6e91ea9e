"""scikit-learn's handwritten digits as the embedded, offline default federated data set.

1,797 real 8x8 grey-scale digits (10 classes) ship inside scikit-learn, so this loads with no network; pixels in
[0, 1], shaped [8, 8, 1], with a fixed stratified 20% test split (independent of the run's seed) so that runs are
comparable. Every array partition applies (`federated.ARRAY_PARTITIONS`); feature and mixed skew make them colour
images [8, 8, 3] with held-out OOD test clients (`tff_gma.data.colored`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow_federated as tff

from tff_gma.data import federated
from tff_gma.data import partition

NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
TEST_FRACTION = 0.2
_SPLIT_SEED = 20_220_601  # Fixed: the split never depends on a run's seed.
PARTITIONS = federated.ARRAY_PARTITIONS


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
    labels: np.ndarray, partition_name: str, num_clients: int, seed: int,
    classes_per_client: int = partition.DEFAULT_CLASSES_PER_CLIENT, **kwargs,
) -> list[np.ndarray]:
  """The label/quantity partitions (`partition.PARTITIONS`) of `labels`; `kwargs`: `alpha`, `beta`."""
  if partition_name not in partition.PARTITIONS:
    raise ValueError(f'unknown partition {partition_name!r}; expected one of {partition.PARTITIONS}')
  return partition.split(labels, partition_name, num_clients, seed, classes_per_client=classes_per_client,
                         **kwargs)


def federated_data(
    partition_name: str = 'iid', num_clients: int = 10, seed: int = 0, **partition_kwargs,
) -> federated.FederatedDataset:
  """The digits as a `FederatedDataset`: the training split over `num_clients` clients, the fixed test split.

  `partition_kwargs` are those of `federated.from_arrays` (`classes_per_client`, `alpha`, `beta`,
  `num_test_clients`, `train_correlation`, `test_correlation`).
  """
  if partition_name == 'by_writer':
    raise ValueError("partition 'by_writer' needs writer identities, which only dataset 'emnist' has; the digits "
                     f'support {PARTITIONS}')
  split = load_split()
  return federated.from_arrays(
      'digits', split.x_train, split.y_train, split.x_test, split.y_test, num_classes=NUM_CLASSES,
      partition=partition_name, num_clients=num_clients, seed=seed, **partition_kwargs)


def federated_train_data(
    partition_name: str = 'iid', num_clients: int = 10, seed: int = 0,
    classes_per_client: int = partition.DEFAULT_CLASSES_PER_CLIENT,
) -> tff.simulation.datasets.ClientData:
  """The digits' training split as a `ClientData` of `num_clients` clients partitioned as named."""
  return federated_data(partition_name, num_clients, seed, classes_per_client=classes_per_client).train
