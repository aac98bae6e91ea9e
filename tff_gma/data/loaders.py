"""Loaders for the real data sets, and `load_federated_data`, the one entry point of the experiment runner.

`digits` (embedded), `fashion_mnist` (Debian's IDX files, never the network; TFDS only when asked), `mnist`,
`cifar10`, `cifar100` (TFDS), `emnist` and `shakespeare` (TFF's, their natural clients with `by_writer`). The
loaders of TFF data sets take TFF's loading function as an argument (`load_fn`), so tests inject synthetic data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.data import client_data
from tff_gma.data import digits
from tff_gma.data import federated
from tff_gma.data import idx
from tff_gma.data import partition as partition_lib
from tff_gma.data import shakespeare

TFDS_DATASETS = ('mnist', 'fashion_mnist', 'cifar10', 'cifar100')
DATASETS = ('digits',) + TFDS_DATASETS + ('emnist', 'shakespeare')
NATURAL_PARTITION = 'by_writer'
_GREY_DATASETS = ('digits', 'mnist', 'fashion_mnist', 'emnist')
_SEQUENCE_PARTITIONS = (NATURAL_PARTITION, 'iid', 'quantity_skew')
# Where Fashion-MNIST comes from: its IDX files (offline), or TFDS's copy (downloaded when not in data_dir).
IDX_SOURCE, TFDS_SOURCE = 'idx', 'tfds'
FASHION_MNIST_SOURCES = (IDX_SOURCE, TFDS_SOURCE)

FederatedDataset = federated.FederatedDataset
TffLoadFn = Callable[..., tuple[tff.simulation.datasets.ClientData, tff.simulation.datasets.ClientData]]


def supported_partitions(dataset: str) -> tuple[str, ...]:
  """The partitions `load_federated_data` accepts for `dataset`."""
  if dataset not in DATASETS:
    raise ValueError(f'unknown dataset {dataset!r}; expected one of {DATASETS}')
  if dataset == 'shakespeare':
    return _SEQUENCE_PARTITIONS
  # Feature/mixed skew colour grey-scale images; writers exist only in EMNIST.
  partitions = federated.ARRAY_PARTITIONS if dataset in _GREY_DATASETS else partition_lib.PARTITIONS
  return partitions + ((NATURAL_PARTITION,) if dataset == 'emnist' else ())


def check_config(dataset: str, partition: str, partition_kwargs: Sequence[str] = (),
                 fashion_mnist_source: str = IDX_SOURCE) -> None:
  """Raises `ValueError` naming the argument if `dataset`, `partition`, a partition keyword or
  `fashion_mnist_source` is not valid."""
  if fashion_mnist_source not in FASHION_MNIST_SOURCES:
    raise ValueError(f'fashion_mnist_source must be one of {FASHION_MNIST_SOURCES}, got {fashion_mnist_source!r}')
  if fashion_mnist_source != IDX_SOURCE and dataset != 'fashion_mnist':
    raise ValueError(f'fashion_mnist_source={fashion_mnist_source} applies to dataset=fashion_mnist only, got '
                     f'dataset={dataset!r}')
  partitions = supported_partitions(dataset)
  if partition not in partitions:
    raise ValueError(f'partition {partition!r} is not supported for dataset {dataset!r}; expected one of '
                     f'{partitions}')
  for name in partition_kwargs:
    if name not in federated.PARTITION_KWARGS:
      raise ValueError(f'unknown partition argument {name!r}; expected one of {sorted(federated.PARTITION_KWARGS)}')


def check_train_subset(dataset: str, partition: str, fraction: float) -> None:
  """Raises `ValueError` naming `train_subset_fraction` unless it is in (0, 1], or below 1 where the training
  examples are not one array pool (Shakespeare; EMNIST's writers, `by_writer`)."""
  fraction = checks.check_fraction(fraction, 'train_subset_fraction', low_open=True)
  if fraction < 1 and (dataset == 'shakespeare' or partition == NATURAL_PARTITION):
    raise ValueError(f'train_subset_fraction applies to array pools, not dataset={dataset!r} with '
                     f'partition={partition!r}; got {fraction!r}')


def _select_clients(ids: Sequence[str], num_clients: int, seed: int) -> list[str]:
  """All of `ids` (sorted) if `num_clients` equals their number, else a seeded random subset, sorted."""
  ids = sorted(ids)
  if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or not (
      1 <= num_clients <= len(ids)):
    raise ValueError(f'num_clients must be an integer in [1, {len(ids)}] (the natural clients), got {num_clients!r}')
  if num_clients == len(ids):
    return ids
  chosen = np.random.default_rng(seed).choice(len(ids), size=num_clients, replace=False)
  return [ids[i] for i in sorted(chosen)]


def _dataset_to_numpy(ds: tf.data.Dataset, batch_size: int = 8192):
  """Every element of `ds`, stacked: the element structure with NumPy arrays of a leading example axis."""
  batches = list(ds.batch(batch_size).as_numpy_iterator())
  if not batches:
    raise ValueError('the data set is empty')
  return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)


# ----------------------------------------------------------------------------------------------------------- TFDS


def tfds_arrays(name: str, split: str, data_dir: Optional[str] = None) -> tuple[np.ndarray, np.ndarray, int]:
  """One TFDS split as (images float32 [N, H, W, C] in [0, 1], labels int32 [N], number of classes)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  # Only these loaders need TFDS.
  ds, info = tfds.load(name, split=split, data_dir=data_dir, as_supervised=True, with_info=True)
  x, y = _dataset_to_numpy(ds)
  return (x.astype(np.float32) / 255.0), y.astype(np.int32), int(info.features['label'].num_classes)


def load_tfds(
    name: str, partition: str, num_clients: int, seed: int, data_dir: Optional[str] = None, *,
    fashion_mnist_source: str = IDX_SOURCE, train_subset_fraction: float = 1.0, **partition_kwargs,
) -> FederatedDataset:
  """TFDS `name` (one of `TFDS_DATASETS`): the `train` split partitioned, the `test` split central.

  Fashion-MNIST comes from its IDX files (`idx.fashion_mnist_arrays`: `data_dir`, else Debian's directory; an
  `idx.IdxError` when they are not there, never a download) unless `fashion_mnist_source` is 'tfds'.
  """
  if name not in TFDS_DATASETS:
    raise ValueError(f'dataset must be one of {TFDS_DATASETS} for TFDS, got {name!r}')
  check_config(name, partition, partition_kwargs, fashion_mnist_source)
  if name == 'fashion_mnist' and fashion_mnist_source == IDX_SOURCE:
    x_train, y_train, x_test, y_test = idx.fashion_mnist_arrays(data_dir)
    num_classes = idx.FASHION_MNIST_CLASSES
  else:
    x_train, y_train, num_classes = tfds_arrays(name, 'train', data_dir)
    x_test, y_test, _ = tfds_arrays(name, 'test', data_dir)
  return federated.from_arrays(
      name, x_train, y_train, x_test, y_test, num_classes=num_classes, partition=partition,
      num_clients=num_clients, seed=seed, train_subset_fraction=train_subset_fraction, **partition_kwargs)


# --------------------------------------------------------------------------------------------------------- EMNIST


def _emnist_example(element):
  """TFF EMNIST element -> OrderedDict(x=[28, 28, 1] float32 with 0 = background, y=int32 scalar)."""
  return dict(x=1.0 - tf.expand_dims(tf.cast(element['pixels'], tf.float32), -1),
              y=tf.reshape(tf.cast(element['label'], tf.int32), []))


def _emnist_arrays(
    cd: tff.simulation.datasets.ClientData, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The examples of clients `ids`, in that order, in one pass: (x, y, index into `ids` of each's writer)."""

  def client_examples(client_id, index):
    return cd.serializable_dataset_fn(client_id).map(lambda e: (_emnist_example(e), index))

  ds = tf.data.Dataset.from_tensor_slices((list(ids), np.arange(len(ids), dtype=np.int64)))
  examples, owner = _dataset_to_numpy(ds.flat_map(client_examples))
  return examples['x'], examples['y'], owner


def load_emnist(
    partition: str, num_clients: int, seed: int, data_dir: Optional[str] = None, only_digits: bool = True,
    load_fn: Optional[TffLoadFn] = None, train_subset_fraction: float = 1.0, **partition_kwargs,
) -> FederatedDataset:
  """Federated EMNIST (10 digit classes, or 62 with `only_digits=False`), partitioned as `partition`."""
  check_config('emnist', partition, partition_kwargs)
  load_fn = load_fn or tff.simulation.datasets.emnist.load_data
  train, test = load_fn(only_digits=only_digits, cache_dir=data_dir)
  num_classes = 10 if only_digits else 62
  if partition != NATURAL_PARTITION:
    x_train, y_train, _ = _emnist_arrays(train, sorted(train.client_ids))
    x_test, y_test, _ = _emnist_arrays(test, sorted(test.client_ids))
    return federated.from_arrays(
        'emnist', x_train, y_train, x_test, y_test, num_classes=num_classes, partition=partition,
        num_clients=num_clients, seed=seed, train_subset_fraction=train_subset_fraction, **partition_kwargs)
  writers = _select_clients(train.client_ids, num_clients, seed)
  x_train, y_train, owner = _emnist_arrays(train, writers)
  # flat_map keeps the writers' order, so the pool is already grouped by writer.
  train_data = client_data.ArrayClientData(
      writers, x_train, y_train, np.bincount(owner, minlength=len(writers)))
  test_writers = sorted(set(writers) & set(test.client_ids))
  if not test_writers:
    raise ValueError('none of the selected writers has test examples')
  x_test, y_test, _ = _emnist_arrays(test, test_writers)
  return FederatedDataset(
      dataset='emnist', partition=partition, train=train_data, test_x=x_test, test_y=y_test,
      input_shape=tuple(x_test.shape[1:]), num_classes=num_classes)


# ---------------------------------------------------------------------------------------------------- Shakespeare


def _snippets(cd: tff.simulation.datasets.ClientData, client_id: str) -> list[bytes]:
  return [e['snippets'] for e in cd.create_tf_dataset_for_client(client_id).as_numpy_iterator()]


def load_shakespeare(
    partition: str, num_clients: int, seed: int, data_dir: Optional[str] = None,
    sequence_length: int = shakespeare.DEFAULT_SEQUENCE_LENGTH, load_fn: Optional[TffLoadFn] = None,
    beta: float = partition_lib.DEFAULT_BETA, **unused_partition_kwargs,
) -> FederatedDataset:
  """TFF's Shakespeare as next-character sequences: `by_writer` (one client per role), `iid`, `quantity_skew`."""
  check_config('shakespeare', partition, unused_partition_kwargs)
  load_fn = load_fn or tff.simulation.datasets.shakespeare.load_data
  train, test = load_fn(cache_dir=data_dir)
  if partition == NATURAL_PARTITION:
    roles = _select_clients(train.client_ids, num_clients, seed)
  else:
    roles = sorted(train.client_ids)
  per_role = {r: shakespeare.to_sequences(_snippets(train, r), sequence_length) for r in roles}
  if partition == NATURAL_PARTITION:
    train_data = client_data.from_client_arrays(per_role)
  else:
    x = np.concatenate([per_role[r][0] for r in roles])
    y = np.concatenate([per_role[r][1] for r in roles])
    dummy_labels = np.zeros(len(x), np.int32)  # Sequences have no class; these partitions ignore labels.
    parts = (partition_lib.iid(dummy_labels, num_clients, seed) if partition == 'iid'
             else partition_lib.quantity_skew(dummy_labels, num_clients, beta, seed))
    train_data = client_data.from_partition(x, y, parts)
  test_roles = sorted(set(roles) & set(test.client_ids))
  test_snippets = [s for r in test_roles for s in _snippets(test, r)]
  if not test_snippets:
    raise ValueError('none of the selected roles has test snippets')
  test_x, test_y = shakespeare.to_sequences(test_snippets, sequence_length)
  return FederatedDataset(
      dataset='shakespeare', partition=partition, train=train_data, test_x=test_x, test_y=test_y,
      input_shape=(sequence_length,), num_classes=shakespeare.VOCAB_SIZE, pad_id=shakespeare.PAD)


# ------------------------------------------------------------------------------------------------------- dispatch


def load_federated_data(
    dataset: str, partition: str, num_clients: int, seed: int, data_dir: Optional[str] = None, *,
    only_digits: bool = True, sequence_length: int = shakespeare.DEFAULT_SEQUENCE_LENGTH,
    fashion_mnist_source: str = IDX_SOURCE, train_subset_fraction: float = 1.0, **partition_kwargs,
) -> FederatedDataset:
  """The federated data set `dataset` (one of `DATASETS`) partitioned as `partition` over `num_clients` clients.

  Args:
    dataset: digits | mnist | fashion_mnist | cifar10 | cifar100 | emnist | shakespeare.
    partition: iid | label_skew | dirichlet | quantity_skew | feature_skew | mixed_skew | by_writer, as far as
      `supported_partitions(dataset)` allows.
    num_clients: the number of training clients (natural partitions: how many writers/roles to use).
    seed: makes the partition (and colourings, client selection) deterministic.
    data_dir: Fashion-MNIST's IDX files (None: Debian's directory); TFDS `data_dir` / TFF `cache_dir` (None: the
      libraries' defaults). The digits ignore it.
    only_digits: EMNIST's 10 digit classes (True) or all 62 classes.
    sequence_length: Shakespeare's sequence length.
    fashion_mnist_source: 'idx' (its IDX files, offline) or 'tfds' (TFDS's copy, downloaded when missing).
    train_subset_fraction: in (0, 1]; below 1, only a class-stratified subset of the training pool is partitioned
      (`federated.stratified_subset`: the same examples for every `seed`); the test split stays whole. Array pools
      only: Shakespeare and EMNIST's `by_writer` refuse a value below 1.
    **partition_kwargs: `classes_per_client`, `alpha`, `beta`, `num_test_clients`, `train_correlation`,
      `test_correlation` (see `federated.from_arrays`); those the partition does not use are ignored.

  Raises:
    ValueError: naming the argument, for an unknown data set or partition, a partition the data set does not
      support, an unknown partition argument, or an invalid value; raised before any data is loaded where the
      combination alone is wrong.
    idx.IdxError: naming the file, when Fashion-MNIST's IDX files are missing, damaged or inconsistent.
  """
  check_config(dataset, partition, partition_kwargs, fashion_mnist_source)
  check_train_subset(dataset, partition, train_subset_fraction)
  if dataset == 'digits':
    return digits.federated_data(partition, num_clients, seed, train_subset_fraction=train_subset_fraction,
                                 **partition_kwargs)
  if dataset in TFDS_DATASETS:
    return load_tfds(dataset, partition, num_clients, seed, data_dir, fashion_mnist_source=fashion_mnist_source,
                     train_subset_fraction=train_subset_fraction, **partition_kwargs)
  if dataset == 'emnist':
    return load_emnist(partition, num_clients, seed, data_dir, only_digits=only_digits,
                       train_subset_fraction=train_subset_fraction, **partition_kwargs)
  return load_shakespeare(partition, num_clients, seed, data_dir, sequence_length=sequence_length,
                          **partition_kwargs)
