"""The embedded digits as a `FederatedDataset`, for every partition (`tff_gma.data.digits`)."""

import numpy as np
import pytest
import tensorflow as tf

from tff_gma.data import colored
from tff_gma.data import digits
from tff_gma.data import partition

LABEL_PARTITIONS = ('iid', 'label_skew', 'dirichlet', 'quantity_skew')


def _color_ids(images, colors):
  """The palette colour of each painted image: the palette direction nearest to its summed RGB."""
  total = images.reshape(len(images), -1, 3).sum(axis=1)
  total /= np.linalg.norm(total, axis=1, keepdims=True)
  unit = colors / np.linalg.norm(colors, axis=1, keepdims=True)
  return np.argmax(total @ unit.T, axis=1)


def _majority_mapping(labels, color_ids):
  """class -> most frequent colour among that class's examples (-1 for absent classes), and the agreement."""
  mapping = np.full(10, -1)
  for c in np.unique(labels):
    mapping[c] = np.bincount(color_ids[labels == c], minlength=10).argmax()
  return mapping, float(np.mean(mapping[labels] == color_ids))


def _sorted_rows(images):
  flat = images.reshape(len(images), -1)
  return flat[np.lexsort(flat.T[::-1])]


def test_fixed_stratified_split():
  split = digits.load_split()
  assert split.x_train.shape == (1438, 8, 8, 1) and split.x_test.shape == (359, 8, 8, 1)
  assert split.x_train.dtype == np.float32 and split.y_train.dtype == np.int32
  assert split.x_train.min() == 0.0 and split.x_train.max() == 1.0
  for c in range(10):
    n_test, n_train = np.sum(split.y_test == c), np.sum(split.y_train == c)
    assert n_test == round(0.2 * (n_test + n_train))


@pytest.mark.parametrize('name', LABEL_PARTITIONS)
def test_label_partitions_hold_the_reference_partition(name):
  split = digits.load_split()
  fd = digits.federated_data(name, 8, seed=5, alpha=0.3, beta=0.7, classes_per_client=3)
  parts = partition.split(split.y_train, name, 8, 5, alpha=0.3, beta=0.7, classes_per_client=3)
  assert fd.dataset == 'digits' and fd.partition == name
  assert fd.train.client_ids == [f'client_{i:03d}' for i in range(8)]
  for cid, part in zip(fd.train.client_ids, parts):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_array_equal(x, split.x_train[part])
    np.testing.assert_array_equal(y, split.y_train[part])
    ds_y = np.array([e['y'] for e in fd.train.create_tf_dataset_for_client(cid).as_numpy_iterator()])
    np.testing.assert_array_equal(ds_y, split.y_train[part])
  np.testing.assert_array_equal(fd.test_x, split.x_test)
  np.testing.assert_array_equal(fd.test_y, split.y_test)
  assert fd.input_shape == (8, 8, 1) and fd.num_classes == 10
  assert fd.ood_test is None and fd.ood_test_x is None and fd.pad_id is None
  assert fd.input_spec['x'] == tf.TensorSpec([None, 8, 8, 1], tf.float32)
  assert fd.input_spec['y'] == tf.TensorSpec([None], tf.int32)


def test_federated_train_data_is_the_train_split_of_federated_data():
  a = digits.federated_train_data('label_skew', 6, 2, classes_per_client=2)
  b = digits.federated_data('label_skew', 6, 2).train
  assert a.client_ids == b.client_ids
  for cid in a.client_ids:
    np.testing.assert_array_equal(a.client_arrays(cid)[1], b.client_arrays(cid)[1])


@pytest.mark.parametrize('name', ['feature_skew', 'mixed_skew'])
def test_colored_partitions_keep_the_digits(name):
  split = digits.load_split()
  fd = digits.federated_data(name, 10, seed=0)
  parts = (partition.iid(split.y_train, 10, 0) if name == 'feature_skew'
           else partition.label_skew(split.y_train, 10, 2, 0))
  assert fd.input_shape == (8, 8, 3) and fd.element_spec['x'].shape == (8, 8, 3)
  for cid, part in zip(fd.train.client_ids, parts):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_allclose(x.max(axis=-1), split.x_train[part][..., 0], atol=1e-6)
    np.testing.assert_array_equal(y, split.y_train[part])
    if name == 'mixed_skew':
      assert len(np.unique(y)) == 2
  np.testing.assert_allclose(fd.test_x.max(axis=-1), split.x_test[..., 0], atol=1e-6)
  np.testing.assert_array_equal(fd.test_y, split.y_test)
  # The OOD clients hold exactly the test images, recoloured.
  assert len(fd.ood_test.client_ids) == 5
  np.testing.assert_allclose(_sorted_rows(fd.ood_test_x.max(axis=-1)), _sorted_rows(split.x_test[..., 0]))
  np.testing.assert_array_equal(np.sort(fd.ood_test_y), np.sort(split.y_test))


def test_feature_skew_gives_each_client_its_own_spurious_colouring():
  fd = digits.federated_data('feature_skew', 10, seed=0)
  colors = colored.palette(10)
  train_mappings, agreements = [], []
  for cid in fd.train.client_ids:
    x, y = fd.train.client_arrays(cid)
    mapping, agreement = _majority_mapping(y, _color_ids(x, colors))
    np.testing.assert_array_equal(np.sort(mapping), np.arange(10))  # Colour identifies the label.
    train_mappings.append(tuple(mapping))
    agreements.append(agreement)
  assert len(set(train_mappings)) == 10
  assert 0.7 < min(agreements) and max(agreements) < 0.98 and abs(np.mean(agreements) - 0.85) < 0.05
  # Pooled over clients, colour is a poor cue: the spurious correlation is per client only.
  x, y = fd.train.pooled_arrays()
  _, pooled_agreement = _majority_mapping(y, _color_ids(x, colors))
  assert pooled_agreement < 0.45
  # Held-out clients: colourings no train client has, applied with probability 0.9.
  for cid in fd.ood_test.client_ids:
    x, y = fd.ood_test.client_arrays(cid)
    mapping, agreement = _majority_mapping(y, _color_ids(x, colors))
    assert tuple(mapping) not in train_mappings
    assert agreement > 0.75


def test_mixed_skew_central_test_is_coloured_like_the_train_clients_and_ood_is_not():
  fd = digits.federated_data('mixed_skew', 10, seed=1)
  colors = colored.palette(10)
  held_colors = {c: set() for c in range(10)}  # label -> the colours its holders paint it.
  for cid in fd.train.client_ids:
    x, y = fd.train.client_arrays(cid)
    mapping, _ = _majority_mapping(y, _color_ids(x, colors))
    for c in np.unique(y):
      held_colors[c].add(mapping[c])
  def in_distribution(x, y):
    ids = _color_ids(x, colors)
    return np.mean([ids[i] in held_colors[y[i]] for i in range(len(y))])
  assert in_distribution(fd.test_x, fd.test_y) > 0.8
  assert in_distribution(fd.ood_test_x, fd.ood_test_y) < 0.5


def test_colored_partitions_are_deterministic_given_the_seed():
  a = digits.federated_data('feature_skew', 4, seed=3, num_test_clients=2)
  b = digits.federated_data('feature_skew', 4, seed=3, num_test_clients=2)
  c = digits.federated_data('feature_skew', 4, seed=4, num_test_clients=2)
  np.testing.assert_array_equal(a.train.pooled_arrays()[0], b.train.pooled_arrays()[0])
  np.testing.assert_array_equal(a.test_x, b.test_x)
  np.testing.assert_array_equal(a.ood_test_x, b.ood_test_x)
  assert a.ood_test.client_ids == ['ood_client_000', 'ood_client_001']
  assert not np.array_equal(a.test_x, c.test_x)


def test_correlation_arguments_are_used():
  fd = digits.federated_data('feature_skew', 4, seed=0, train_correlation=(1.0, 1.0), test_correlation=1.0)
  colors = colored.palette(10)
  for data in (fd.train, fd.ood_test):
    for cid in data.client_ids:
      x, y = data.client_arrays(cid)
      assert _majority_mapping(y, _color_ids(x, colors))[1] == 1.0


@pytest.mark.parametrize('kwargs,argument', [
    (dict(partition_name='by_writer'), 'by_writer'),
    (dict(partition_name='natural'), 'partition'),
    (dict(partition_name='feature_skew', num_test_clients=360), 'num_test_clients'),
    (dict(partition_name='mixed_skew', classes_per_client=0), 'classes_per_client'),
    (dict(partition_name='dirichlet', alpha=0), 'alpha'),
    (dict(partition_name='iid', num_clients=5000), 'num_clients'),
])
def test_invalid_arguments(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    digits.federated_data(**kwargs)
