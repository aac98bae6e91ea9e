"""`FederatedDataset`: what the experiment runner trains and evaluates on, built from arrays and a partition.

`from_arrays` handles every partition over a labelled pool (digits, the TFDS images, pooled EMNIST): those of
`partition` and the colourings of `colored`, which add held-out OOD test clients. `train_subset_fraction` < 1
partitions a class-stratified subset drawn with a fixed seed (`SUBSET_SEED`), so every seed, method and partition
of a study trains on the same examples; the test split stays whole.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from tff_gma import checks
from tff_gma.data import client_data
from tff_gma.data import colored
from tff_gma.data import partition as partition_lib

COLOR_PARTITIONS = ('feature_skew', 'mixed_skew')
# The same skews with colored MNIST's shared colouring (`colored.Coloring.create_shared`): one class -> colour
# permutation at every train client (client-specific strengths), derangements of it at the OOD test clients.
SHARED_COLOR_PARTITIONS = ('feature_skew_shared', 'mixed_skew_shared')
ALL_COLOR_PARTITIONS = COLOR_PARTITIONS + SHARED_COLOR_PARTITIONS
ARRAY_PARTITIONS = partition_lib.PARTITIONS + ALL_COLOR_PARTITIONS
DEFAULT_NUM_TEST_CLIENTS = 5
# `load_federated_data`'s partition keyword arguments and the partitions that use them.
PARTITION_KWARGS = {
    'classes_per_client': ('label_skew', 'mixed_skew', 'mixed_skew_shared'),
    'alpha': ('dirichlet',),
    'beta': ('quantity_skew',),
    'num_test_clients': ALL_COLOR_PARTITIONS,
    'train_correlation': ALL_COLOR_PARTITIONS,
    'test_correlation': ALL_COLOR_PARTITIONS,
}
_COLOR_STREAM = 1  # Seeds the colouring's generator as (seed, _COLOR_STREAM): independent of the partition's.
# Seeds `stratified_subset`'s draw. Fixed, not the run's seed: every seed and method of a study cell trains on the
# same subset, so seeds vary the partition and the model, never which examples exist.
SUBSET_SEED = 20_261_125


@dataclasses.dataclass(frozen=True)
class FederatedDataset:
  """A federated training set with its central test split and, for feature/mixed skew, OOD test clients.

  Attributes:
    dataset: the data set's name (`digits`, `mnist`, ..., `shakespeare`).
    partition: how the training examples were dealt to clients.
    train: the training clients; every client is non-empty. Elements are `OrderedDict(x=..., y=...)`.
    test_x, test_y: the central (in-distribution) test split.
    input_shape: the shape of one `x` (no batch dimension), for the model builders.
    num_classes: the number of classes (for Shakespeare: the vocabulary size, targets being character ids).
    ood_test: held-out test clients whose data comes from a distribution no train client has (feature and mixed
      skew: colourings no train client uses); None for partitions without them.
    pad_id: for sequence data, the target id of padding positions that loss and accuracy must ignore.
  """
  dataset: str
  partition: str
  train: client_data.ArrayClientData
  test_x: np.ndarray
  test_y: np.ndarray
  input_shape: tuple[int, ...]
  num_classes: int
  ood_test: Optional[client_data.ArrayClientData] = None
  pad_id: Optional[int] = None

  @property
  def ood_test_x(self) -> Optional[np.ndarray]:
    """The OOD test clients' inputs, pooled in client order; None without OOD clients."""
    return None if self.ood_test is None else self.ood_test.pooled_arrays()[0]

  @property
  def ood_test_y(self) -> Optional[np.ndarray]:
    return None if self.ood_test is None else self.ood_test.pooled_arrays()[1]

  @property
  def element_spec(self):
    """The structure of one (unbatched) example of a client dataset."""
    return self.train.element_type_structure

  @property
  def input_spec(self):
    """The spec of a batch of examples, as `tff.learning.models.from_keras_model` wants it."""
    return collections.OrderedDict(
        (k, tf.TensorSpec([None, *s.shape], s.dtype)) for k, s in self.element_spec.items())


def stratified_subset(labels: np.ndarray, fraction: float, seed: int = SUBSET_SEED) -> np.ndarray:
  """Indices, ascending, of a class-stratified subset of `labels`: of each class's n examples, round(fraction * n)
  (at least one), drawn without replacement by a NumPy generator seeded with `seed`, one class after another."""
  fraction = checks.check_fraction(fraction, 'train_subset_fraction', low_open=True)
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  kept = []
  for label in np.unique(labels):
    members = np.flatnonzero(labels == label)
    kept.append(rng.choice(members, size=max(1, round(fraction * len(members))), replace=False))
  return np.sort(np.concatenate(kept))


def from_arrays(
    dataset: str,
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
    num_classes: int, partition: str, num_clients: int, seed: int,
    classes_per_client: int = partition_lib.DEFAULT_CLASSES_PER_CLIENT,
    alpha: float = partition_lib.DEFAULT_ALPHA,
    beta: float = partition_lib.DEFAULT_BETA,
    num_test_clients: int = DEFAULT_NUM_TEST_CLIENTS,
    train_correlation: tuple[float, float] = colored.DEFAULT_TRAIN_CORRELATION,
    test_correlation: float = colored.DEFAULT_TEST_CORRELATION,
    train_subset_fraction: float = 1.0,
) -> FederatedDataset:
  """Partitions a labelled train pool over `num_clients` clients as `partition` names (`ARRAY_PARTITIONS`).

  For `feature_skew` (iid labels) and `mixed_skew` (`classes_per_client` classes per client) the grey-scale
  images are coloured as `colored` describes: each train client with its own colouring; the central test split
  in-distribution, each test example painted by the colouring of a train client drawn in proportion to how many
  examples of its class that client holds (so the test split's (label, colour) distribution is the train pool's);
  and the same test images, dealt iid over `num_test_clients` held-out clients with colourings no train client
  has, as `ood_test`. Deterministic given `seed`. `feature_skew_shared` and `mixed_skew_shared` are the same with
  colored MNIST's shared colouring (`colored.Coloring.create_shared`).

  `train_subset_fraction` < 1 partitions (and colours) only `stratified_subset(y_train, train_subset_fraction)` of
  the training pool; the test split is used whole.
  """
  if partition not in ARRAY_PARTITIONS:
    raise ValueError(f'unknown partition {partition!r} for dataset {dataset!r}; expected one of {ARRAY_PARTITIONS}')
  x_train, y_train = np.asarray(x_train), np.asarray(y_train)
  if checks.check_fraction(train_subset_fraction, 'train_subset_fraction', low_open=True) < 1:
    kept = stratified_subset(y_train, train_subset_fraction)
    x_train, y_train = x_train[kept], y_train[kept]
  x_test, y_test = np.asarray(x_test), np.asarray(y_test)
  if partition not in ALL_COLOR_PARTITIONS:
    parts = partition_lib.split(
        y_train, partition, num_clients, seed, classes_per_client=classes_per_client, alpha=alpha, beta=beta)
    return FederatedDataset(
        dataset=dataset, partition=partition, train=client_data.from_partition(x_train, y_train, parts),
        test_x=x_test, test_y=y_test, input_shape=tuple(x_train.shape[1:]), num_classes=num_classes)

  return _colored_from_arrays(
      dataset, partition, x_train, y_train, x_test, y_test, num_classes=num_classes, num_clients=num_clients,
      seed=seed, classes_per_client=classes_per_client, num_test_clients=num_test_clients,
      train_correlation=train_correlation, test_correlation=test_correlation)


def _colored_from_arrays(
    dataset: str, partition: str,
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
    num_classes: int, num_clients: int, seed: int, classes_per_client: int, num_test_clients: int,
    train_correlation: tuple[float, float], test_correlation: float,
) -> FederatedDataset:
  """`from_arrays` for the colour partitions (`ALL_COLOR_PARTITIONS`), on arrays already subset."""
  if x_train.ndim != 4 or x_train.shape[-1] != 1:
    raise ValueError(
        f'partition {partition!r} colours grey-scale images [N, H, W, 1]; dataset {dataset!r} has examples of '
        f'shape {x_train.shape[1:]}')
  if partition in ('feature_skew', 'feature_skew_shared'):
    parts = partition_lib.iid(y_train, num_clients, seed)
  else:
    parts = partition_lib.label_skew(y_train, num_clients, classes_per_client, seed)
  # One generator, drawn from in this order: the colouring, the train colours, the test split's, the OOD clients'.
  rng = np.random.default_rng([seed, _COLOR_STREAM])
  create = colored.Coloring.create_shared if partition in SHARED_COLOR_PARTITIONS else colored.Coloring.create
  coloring = create(
      num_clients, num_test_clients, num_classes, rng, train_correlation, test_correlation)
  if num_test_clients > len(y_test):
    raise ValueError(f'num_test_clients={num_test_clients} exceeds the test split ({len(y_test)} examples)')
  train_colors = train_color_ids(y_train, parts, coloring, rng)
  train = client_data.from_partition(colored.colorize(x_train, train_colors, coloring.colors), y_train, parts)
  test_colors = central_test_color_ids(y_train, parts, y_test, num_classes, coloring, rng)
  ood_test = _ood_test_clients(x_test, y_test, num_test_clients, coloring, rng)
  return FederatedDataset(
      dataset=dataset, partition=partition, train=train,
      test_x=colored.colorize(x_test, test_colors, coloring.colors), test_y=y_test,
      input_shape=tuple(x_train.shape[1:3]) + (3,), num_classes=num_classes, ood_test=ood_test)


def train_color_ids(y_train: np.ndarray, parts: list[np.ndarray], coloring: colored.Coloring,
                    rng: np.random.Generator) -> np.ndarray:
  """The palette index of each training example: each client's examples drawn with its own colouring."""
  train_colors = np.zeros(len(y_train), np.int64)
  for client, part in enumerate(parts):
    train_colors[part] = colored.sample_color_ids(
        y_train[part], coloring.train_mappings[client], coloring.train_correlations[client], rng)
  return train_colors


def central_test_color_ids(y_train: np.ndarray, parts: list[np.ndarray], y_test: np.ndarray, num_classes: int,
                           coloring: colored.Coloring, rng: np.random.Generator) -> np.ndarray:
  """The palette index of each central (in-distribution) test example.

  Each example takes the colouring of a train client drawn in proportion to how many examples of its class the
  client holds (uniformly when no client holds the class).
  """
  num_clients = len(parts)
  class_counts = np.zeros([num_classes, num_clients])
  for client, part in enumerate(parts):
    class_counts[:, client] = np.bincount(y_train[part], minlength=num_classes)
  test_clients = np.zeros(len(y_test), np.int64)
  for label in np.unique(y_test):
    members = np.flatnonzero(y_test == label)
    weights = class_counts[label] if class_counts[label].sum() > 0 else np.ones(num_clients)
    test_clients[members] = rng.choice(num_clients, size=len(members), p=weights / weights.sum())
  return colored.sample_color_ids(
      y_test, coloring.train_mappings[test_clients], coloring.train_correlations[test_clients], rng)


def _ood_test_clients(x_test: np.ndarray, y_test: np.ndarray, num_test_clients: int, coloring: colored.Coloring,
                      rng: np.random.Generator) -> client_data.ArrayClientData:
  """The OOD test clients: the test images dealt iid, coloured by mappings no train client has."""
  ood_parts = partition_lib.iid(y_test, num_test_clients, int(rng.integers(2**31)))
  ood_colors = np.zeros(len(y_test), np.int64)
  for client, part in enumerate(ood_parts):
    ood_colors[part] = colored.sample_color_ids(
        y_test[part], coloring.test_mappings[client], coloring.test_correlation, rng)
  width = max(3, len(str(num_test_clients - 1)))
  return client_data.from_partition(
      colored.colorize(x_test, ood_colors, coloring.colors), y_test, ood_parts,
      ids=[f'ood_client_{i:0{width}d}' for i in range(num_test_clients)])
