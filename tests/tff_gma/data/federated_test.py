"""`FederatedDataset` and `from_arrays` (`tff_gma.data.federated`) on a small synthetic pool: the partitions
against `partition`'s reference split, the colourings recovered from the pixels, and the PARTITION_KWARGS
contract (a keyword changes the data set exactly for the partitions listed for it)."""

import collections
import dataclasses
import inspect

import numpy as np
import pytest
import tensorflow as tf

from tff_gma.data import client_data
from tff_gma.data import colored
from tff_gma.data import federated
from tff_gma.data import partition as partition_lib

NUM_CLASSES = 4


def _pool(n, seed):
  """Grey [n, 2, 2, 1] images with every pixel in [0.2, 1] (so the colour is readable), balanced labels."""
  rng = np.random.default_rng(seed)
  x = rng.uniform(0.2, 1.0, size=(n, 2, 2, 1)).astype(np.float32)
  y = rng.permutation(np.arange(n) % NUM_CLASSES).astype(np.int32)
  return x, y


X_TRAIN, Y_TRAIN = _pool(120, 0)
X_TEST, Y_TEST = _pool(40, 1)


def _from_arrays(partition, num_clients=4, seed=3, **kwargs):
  return federated.from_arrays('toy', X_TRAIN, Y_TRAIN, X_TEST, Y_TEST, num_classes=NUM_CLASSES,
                               partition=partition, num_clients=num_clients, seed=seed, **kwargs)


def _color_ids(images):
  """Palette index of each painted image: the pixels are grey * colour with every grey pixel positive."""
  grey_sum = images.max(axis=-1).reshape(len(images), -1).sum(axis=1, keepdims=True)
  rgb = images.reshape(len(images), -1, 3).sum(axis=1) / grey_sum
  distances = np.linalg.norm(rgb[:, None, :] - colored.palette(NUM_CLASSES)[None], axis=-1)
  assert np.all(distances.min(axis=1) < 1e-5), 'an image is not one palette colour'
  return distances.argmin(axis=1)


def _mapping(labels, color_ids):
  """label -> colour of a client with correlation 1 (asserting it is a function), as a dict."""
  mapping = {}
  for label, color in zip(labels, color_ids):
    assert mapping.setdefault(int(label), int(color)) == color
  return mapping


def _sorted_rows(images):
  flat = images.reshape(len(images), -1)
  return flat[np.lexsort(flat.T)]


def _fingerprint(fd):
  arrays = [np.asarray(fd.train.client_ids)]
  for cid in fd.train.client_ids:
    arrays += list(fd.train.client_arrays(cid))
  arrays += [fd.test_x, fd.test_y]
  if fd.ood_test is not None:
    arrays += [np.asarray(fd.ood_test.client_ids), fd.ood_test_x, fd.ood_test_y]
  return arrays


def _same(a, b):
  return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def test_partition_names():
  assert federated.COLOR_PARTITIONS == ('feature_skew', 'mixed_skew')
  assert federated.ARRAY_PARTITIONS == (
      'iid', 'label_skew', 'dirichlet', 'quantity_skew', 'feature_skew', 'mixed_skew', 'feature_skew_shared',
      'mixed_skew_shared')


@pytest.mark.parametrize('partition', partition_lib.PARTITIONS)
def test_label_partitions_deal_the_reference_partition(partition):
  fd = _from_arrays(partition, classes_per_client=3, alpha=0.7, beta=0.9)
  parts = partition_lib.split(Y_TRAIN, partition, 4, 3, classes_per_client=3, alpha=0.7, beta=0.9)
  assert (fd.dataset, fd.partition, fd.input_shape, fd.num_classes) == ('toy', partition, (2, 2, 1), NUM_CLASSES)
  assert fd.train.client_ids == ['client_000', 'client_001', 'client_002', 'client_003']
  for cid, part in zip(fd.train.client_ids, parts):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_array_equal(x, X_TRAIN[part])
    np.testing.assert_array_equal(y, Y_TRAIN[part])
  np.testing.assert_array_equal(fd.test_x, X_TEST)
  np.testing.assert_array_equal(fd.test_y, Y_TEST)
  assert fd.ood_test is None and fd.ood_test_x is None and fd.ood_test_y is None and fd.pad_id is None
  assert fd.element_spec == collections.OrderedDict(
      x=tf.TensorSpec([2, 2, 1], tf.float32), y=tf.TensorSpec([], tf.int32))
  assert fd.input_spec == collections.OrderedDict(
      x=tf.TensorSpec([None, 2, 2, 1], tf.float32), y=tf.TensorSpec([None], tf.int32))


def test_federated_dataset_fields_for_sequences_and_ood_clients():
  x = np.arange(30, dtype=np.int32).reshape(6, 5)
  train = client_data.from_partition(x, x + 1, [np.array([0, 1]), np.array([2, 3, 4, 5])])
  ood = client_data.from_client_arrays({'o1': (x[:2], x[:2] + 1), 'o0': (x[2:3], x[2:3] + 1)})
  fd = federated.FederatedDataset(dataset='seq', partition='iid', train=train, test_x=x, test_y=x + 1,
                                  input_shape=(5,), num_classes=31, ood_test=ood, pad_id=0)
  assert fd.pad_id == 0 and fd.ood_test is ood
  assert fd.input_spec == collections.OrderedDict(
      x=tf.TensorSpec([None, 5], tf.int32), y=tf.TensorSpec([None, 5], tf.int32))
  np.testing.assert_array_equal(fd.ood_test_x, x[:3])  # Pooled in the OOD clients' order.
  np.testing.assert_array_equal(fd.ood_test_y, x[:3] + 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    fd.num_classes = 3


@pytest.mark.parametrize('partition', federated.COLOR_PARTITIONS)
def test_colour_partitions_paint_the_grey_images(partition):
  fd = _from_arrays(partition, classes_per_client=2, num_test_clients=2, train_correlation=(1.0, 1.0),
                    test_correlation=1.0)
  parts = (partition_lib.iid(Y_TRAIN, 4, 3) if partition == 'feature_skew'
           else partition_lib.label_skew(Y_TRAIN, 4, 2, 3))
  assert fd.input_shape == (2, 2, 3) and fd.element_spec['x'] == tf.TensorSpec([2, 2, 3], tf.float32)
  assert fd.num_classes == NUM_CLASSES and fd.pad_id is None
  train_mappings = []
  for cid, part in zip(fd.train.client_ids, parts):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_allclose(x.max(axis=-1), X_TRAIN[part][..., 0], atol=1e-6)  # The grey image survives.
    np.testing.assert_array_equal(y, Y_TRAIN[part])
    mapping = _mapping(y, _color_ids(x))
    assert len(set(mapping.values())) == len(mapping)  # Colours identify the client's classes.
    assert len(mapping) == (NUM_CLASSES if partition == 'feature_skew' else 2)
    train_mappings.append(mapping)
  if partition == 'feature_skew':
    assert len({tuple(sorted(m.items())) for m in train_mappings}) == 4  # Every client its own colouring.

  # Central test split: the test images, each coloured as some train client holding its class colours it.
  np.testing.assert_allclose(fd.test_x.max(axis=-1), X_TEST[..., 0], atol=1e-6)
  np.testing.assert_array_equal(fd.test_y, Y_TEST)
  for label, color in zip(fd.test_y, _color_ids(fd.test_x)):
    assert color in {m[label] for m in train_mappings if label in m}

  # OOD clients: the same test images dealt iid over 2 clients, with colourings no train client uses.
  assert fd.ood_test.client_ids == ['ood_client_000', 'ood_client_001']
  sizes = [fd.ood_test.num_examples(c) for c in fd.ood_test.client_ids]
  assert sum(sizes) == len(Y_TEST) and max(sizes) - min(sizes) <= 1
  ood_grey = fd.ood_test_x.max(axis=-1).reshape(len(Y_TEST), -1)
  np.testing.assert_allclose(ood_grey[np.lexsort(ood_grey.T)], _sorted_rows(X_TEST[..., 0]), atol=1e-6)
  np.testing.assert_array_equal(np.sort(fd.ood_test_y), np.sort(Y_TEST))
  ood_mappings = []
  for cid in fd.ood_test.client_ids:
    x, y = fd.ood_test.client_arrays(cid)
    mapping = _mapping(y, _color_ids(x))
    assert len(mapping) == NUM_CLASSES and sorted(mapping.values()) == list(range(NUM_CLASSES))
    ood_mappings.append(mapping)
    # Distinct from every train colouring (visible in full where a train client holds every class).
    assert all(mapping != m for m in train_mappings if len(m) == NUM_CLASSES)
  assert ood_mappings[0] != ood_mappings[1]


@pytest.mark.parametrize('partition', federated.ARRAY_PARTITIONS)
def test_deterministic_given_the_seed(partition):
  a, b, c = (_from_arrays(partition, seed=s, num_test_clients=2) for s in (5, 5, 6))
  assert _same(_fingerprint(a), _fingerprint(b))
  assert not _same(_fingerprint(a), _fingerprint(c))


def test_partition_kwargs_are_the_keywords_of_from_arrays():
  parameters = inspect.signature(federated.from_arrays).parameters
  keywords = {name for name, p in parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty}
  # train_subset_fraction is no partition's keyword: it thins the pool before any partition.
  assert set(federated.PARTITION_KWARGS) | {'train_subset_fraction'} == keywords
  for users in federated.PARTITION_KWARGS.values():
    assert users and set(users) <= set(federated.ARRAY_PARTITIONS)
  # Every partition with a hyperparameter has it listed.
  assert {p for users in federated.PARTITION_KWARGS.values() for p in users} == {
      'label_skew', 'dirichlet', 'quantity_skew', 'feature_skew', 'mixed_skew', 'feature_skew_shared',
      'mixed_skew_shared'}


# A value other than the default, for each partition keyword.
_CHANGED = dict(classes_per_client=3, alpha=50.0, beta=5.0, num_test_clients=3, train_correlation=(0.2, 0.3),
                test_correlation=0.1)


@pytest.mark.parametrize('partition', federated.ARRAY_PARTITIONS)
def test_a_partition_keyword_matters_exactly_for_the_partitions_listed(partition):
  assert set(_CHANGED) == set(federated.PARTITION_KWARGS)
  default = _fingerprint(_from_arrays(partition))
  for name, value in _CHANGED.items():
    changed = _fingerprint(_from_arrays(partition, **{name: value}))
    assert _same(default, changed) == (partition not in federated.PARTITION_KWARGS[name]), name


@pytest.mark.parametrize('partition,kwargs,match', [
    ('natural', {}, "unknown partition 'natural'"),
    ('by_writer', {}, 'unknown partition'),
    ('mixed_skew', dict(num_test_clients=0), 'num_test_clients'),
    ('feature_skew', dict(train_correlation=(0.9, 0.8)), 'train_correlation'),
    ('feature_skew', dict(test_correlation=1.5), 'test_correlation'),
    ('mixed_skew', dict(classes_per_client=5), 'classes_per_client'),
    ('dirichlet', dict(alpha=0.0), 'alpha'),
    ('quantity_skew', dict(beta=-1.0), 'beta'),
    ('iid', dict(num_clients=121), 'num_clients'),
])
def test_invalid_arguments(partition, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _from_arrays(partition, **kwargs)


@pytest.mark.parametrize('partition', federated.COLOR_PARTITIONS)
def test_more_ood_clients_than_test_examples(partition):
  with pytest.raises(ValueError, match='num_test_clients=4 exceeds the test split'):
    federated.from_arrays('toy', X_TRAIN, Y_TRAIN, X_TEST[:3], Y_TEST[:3], num_classes=NUM_CLASSES,
                          partition=partition, num_clients=4, seed=0, num_test_clients=4)


@pytest.mark.parametrize('partition', federated.COLOR_PARTITIONS)
def test_colour_partitions_need_grey_images(partition):
  for x in (X_TRAIN.reshape(120, 4), np.repeat(X_TRAIN, 3, axis=-1)):
    with pytest.raises(ValueError, match='grey-scale'):
      federated.from_arrays('toy', x, Y_TRAIN, X_TEST, Y_TEST, num_classes=NUM_CLASSES, partition=partition,
                            num_clients=4, seed=0)


# ----------------------------------------------------------------------------------------------------------------
# The training pool's stratified subset (train_subset_fraction).


def test_stratified_subset_keeps_a_rounded_share_of_each_class_in_order():
  labels = np.random.default_rng(0).permutation(np.repeat([0, 1, 2, 3], [10, 3, 1, 7]))
  kept = federated.stratified_subset(labels, 0.3)
  assert np.all(np.diff(kept) > 0)  # Ascending and distinct: the examples keep their original order.
  # round(3.0), round(0.9), round(0.3) raised to one, round(2.1).
  assert np.bincount(labels[kept], minlength=4).tolist() == [3, 1, 1, 2]
  np.testing.assert_array_equal(kept, federated.stratified_subset(labels, 0.3))  # SUBSET_SEED: always the same.
  assert not np.array_equal(kept, federated.stratified_subset(labels, 0.3, seed=federated.SUBSET_SEED + 1))
  np.testing.assert_array_equal(federated.stratified_subset(labels, 1.0), np.arange(len(labels)))


@pytest.mark.parametrize('partition', federated.ARRAY_PARTITIONS)
def test_the_default_fraction_keeps_the_pool(partition):
  default = _fingerprint(_from_arrays(partition, num_test_clients=2))
  assert _same(default, _fingerprint(_from_arrays(partition, num_test_clients=2, train_subset_fraction=1.0)))
  assert not _same(default, _fingerprint(_from_arrays(partition, num_test_clients=2, train_subset_fraction=0.5)))


@pytest.mark.parametrize('partition', partition_lib.PARTITIONS)
def test_a_subset_is_dealt_as_a_pool_of_its_own(partition):
  fd = _from_arrays(partition, classes_per_client=3, alpha=0.7, beta=0.9, train_subset_fraction=0.5)
  kept = federated.stratified_subset(Y_TRAIN, 0.5)
  x_pool, y_pool = X_TRAIN[kept], Y_TRAIN[kept]
  parts = partition_lib.split(y_pool, partition, 4, 3, classes_per_client=3, alpha=0.7, beta=0.9)
  for cid, part in zip(fd.train.client_ids, parts):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_array_equal(x, x_pool[part])
    np.testing.assert_array_equal(y, y_pool[part])
  np.testing.assert_array_equal(fd.test_x, X_TEST)  # The test split is whole.
  np.testing.assert_array_equal(fd.test_y, Y_TEST)


@pytest.mark.parametrize('partition', federated.ARRAY_PARTITIONS)
def test_a_subset_has_the_stated_class_counts_and_the_same_examples_for_every_seed(partition):
  kept = federated.stratified_subset(Y_TRAIN, 0.5)
  for seed in (3, 4):
    fd = _from_arrays(partition, seed=seed, num_test_clients=2, train_subset_fraction=0.5)
    x, y = fd.train.pooled_arrays()
    assert np.bincount(y).tolist() == [15] * NUM_CLASSES  # Each class's 30 examples, halved.
    grey = x.max(axis=-1, keepdims=True)  # The colour partitions paint the grey image; max recovers it.
    np.testing.assert_allclose(_sorted_rows(grey), _sorted_rows(X_TRAIN[kept]), atol=1e-6)
    assert len(fd.test_y) == len(Y_TEST) and (fd.ood_test is None or len(fd.ood_test_y) == len(Y_TEST))


@pytest.mark.parametrize('value', [0, 0.0, -0.1, 1.5, float('nan'), True, '0.5'])
def test_an_invalid_fraction_names_the_argument(value):
  with pytest.raises(ValueError, match='train_subset_fraction'):
    _from_arrays('iid', train_subset_fraction=value)
  with pytest.raises(ValueError, match='train_subset_fraction'):
    federated.stratified_subset(Y_TRAIN, value)
