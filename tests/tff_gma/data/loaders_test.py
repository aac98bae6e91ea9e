"""The real-data loaders and `load_federated_data`, on data the tests create: TFDS's mock data and TFF's
synthetic EMNIST and Shakespeare client data. Nothing here needs a network, and nothing is skipped."""

import numpy as np
import pytest
import tensorflow_datasets as tfds
import tensorflow_federated as tff
from tensorflow_federated.python.simulation.baselines.shakespeare import char_prediction_preprocessing

from tff_gma.data import digits
from tff_gma.data import federated
from tff_gma.data import loaders
from tff_gma.data import partition

MOCK_EXAMPLES = 40


def _tfds_reference(name, split, data_dir):
  """The split's examples as TFDS yields them, one by one."""
  examples = list(tfds.load(name, split=split, data_dir=data_dir, as_supervised=True).as_numpy_iterator())
  return (np.stack([x for x, _ in examples]).astype(np.float32) / 255,
          np.array([y for _, y in examples], np.int32))


@pytest.mark.parametrize('name,shape,num_classes,part', [
    ('mnist', (28, 28, 1), 10, 'iid'),
    ('fashion_mnist', (28, 28, 1), 10, 'quantity_skew'),
    ('cifar10', (32, 32, 3), 10, 'dirichlet'),
    ('cifar100', (32, 32, 3), 100, 'iid'),
])
def test_tfds_loaders_partition_the_train_split(tmp_path, name, shape, num_classes, part):
  data_dir = str(tmp_path)
  # Fashion-MNIST reads its IDX files unless TFDS's copy is asked for.
  source = {'fashion_mnist_source': 'tfds'} if name == 'fashion_mnist' else {}
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    fd = loaders.load_federated_data(name, part, 4, seed=1, data_dir=data_dir, **source)
    x_train, y_train = _tfds_reference(name, 'train', data_dir)
    x_test, y_test = _tfds_reference(name, 'test', data_dir)
  assert len(y_train) == MOCK_EXAMPLES
  assert (fd.dataset, fd.partition, fd.input_shape, fd.num_classes) == (name, part, shape, num_classes)
  assert fd.element_spec['x'].shape == shape and fd.element_spec['x'].dtype == np.float32
  for cid, p in zip(fd.train.client_ids, partition.split(y_train, part, 4, 1)):
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_allclose(x, x_train[p])
    np.testing.assert_array_equal(y, y_train[p])
  np.testing.assert_allclose(fd.test_x, x_test)
  np.testing.assert_array_equal(fd.test_y, y_test)
  assert 0.0 <= fd.test_x.min() and fd.test_x.max() <= 1.0 and fd.ood_test is None


def test_tfds_grey_images_support_feature_skew(tmp_path):
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    fd = loaders.load_federated_data('mnist', 'feature_skew', 3, seed=0, data_dir=str(tmp_path),
                                     num_test_clients=2)
    x_train, y_train = _tfds_reference('mnist', 'train', str(tmp_path))
  assert fd.input_shape == (28, 28, 3) and fd.test_x.shape == (MOCK_EXAMPLES, 28, 28, 3)
  assert len(fd.ood_test.client_ids) == 2 and fd.ood_test_x.shape == (MOCK_EXAMPLES, 28, 28, 3)
  x, _ = fd.train.client_arrays(fd.train.client_ids[0])
  np.testing.assert_allclose(x.max(axis=-1), x_train[partition.iid(y_train, 3, 0)[0]][..., 0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------- EMNIST


class _FakeTffLoader:
  """Stands in for a TFF `load_data`: records its arguments and returns synthetic (train, test)."""

  def __init__(self, synthetic):
    self.synthetic = synthetic
    self.calls = []

  def __call__(self, **kwargs):
    self.calls.append(kwargs)
    return self.synthetic(), self.synthetic()


def _emnist_reference(client_id):
  ds = tff.simulation.datasets.emnist.get_synthetic().create_tf_dataset_for_client(client_id)
  examples = list(ds.as_numpy_iterator())
  return (1.0 - np.stack([e['pixels'] for e in examples])[..., np.newaxis],
          np.array([e['label'] for e in examples], np.int32))


def test_emnist_by_writer_keeps_the_writers():
  fake = _FakeTffLoader(tff.simulation.datasets.emnist.get_synthetic)
  fd = loaders.load_emnist('by_writer', 2, seed=0, data_dir='/cache', load_fn=fake)
  assert fake.calls == [dict(only_digits=True, cache_dir='/cache')]
  assert fd.train.client_ids == ['synthetic1', 'synthetic2']
  for cid in fd.train.client_ids:
    x_ref, y_ref = _emnist_reference(cid)
    x, y = fd.train.client_arrays(cid)
    np.testing.assert_allclose(x, x_ref)
    np.testing.assert_array_equal(y, y_ref)
  assert fd.input_shape == (28, 28, 1) and fd.num_classes == 10 and fd.test_x.shape == (20, 28, 28, 1)
  assert fd.element_spec['y'].shape == () and fd.ood_test is None
  # Ink is bright, as in MNIST (the synthetic digits are mostly background).
  assert np.mean(fd.test_x < 0.5) > 0.5


def test_emnist_fewer_clients_than_writers_selects_writers_by_seed():
  fake = _FakeTffLoader(tff.simulation.datasets.emnist.get_synthetic)
  chosen = {tuple(loaders.load_emnist('by_writer', 1, seed=s, load_fn=fake).train.client_ids) for s in range(6)}
  assert chosen == {('synthetic1',), ('synthetic2',)}
  with pytest.raises(ValueError, match='num_clients'):
    loaders.load_emnist('by_writer', 3, seed=0, load_fn=fake)


def test_emnist_other_partitions_repartition_the_pool():
  fake = _FakeTffLoader(tff.simulation.datasets.emnist.get_synthetic)
  fd = loaders.load_emnist('iid', 4, seed=2, load_fn=fake)
  x_ref = np.concatenate([_emnist_reference(c)[0] for c in ('synthetic1', 'synthetic2')])
  y_ref = np.concatenate([_emnist_reference(c)[1] for c in ('synthetic1', 'synthetic2')])
  for cid, p in zip(fd.train.client_ids, partition.iid(y_ref, 4, 2)):
    np.testing.assert_allclose(fd.train.client_arrays(cid)[0], x_ref[p])
    np.testing.assert_array_equal(fd.train.client_arrays(cid)[1], y_ref[p])
  fd = loaders.load_emnist('mixed_skew', 5, seed=2, load_fn=fake, num_test_clients=2)
  assert fd.input_shape == (28, 28, 3) and len(fd.ood_test.client_ids) == 2


def test_load_federated_data_uses_tffs_emnist_loader(monkeypatch):
  fake = _FakeTffLoader(tff.simulation.datasets.emnist.get_synthetic)
  monkeypatch.setattr(tff.simulation.datasets.emnist, 'load_data', fake)
  fd = loaders.load_federated_data('emnist', 'by_writer', 2, seed=0, data_dir='/d', only_digits=False)
  assert fake.calls == [dict(only_digits=False, cache_dir='/d')]
  assert fd.num_classes == 62 and fd.train.client_ids == ['synthetic1', 'synthetic2']


# ----------------------------------------------------------------------------------------------- Shakespeare


def _tff_baseline_sequences(ds, sequence_length):
  """TFF's own Shakespeare preprocessing, an independent reference for the tokenisation."""
  spec = tff.simulation.baselines.ClientSpec(num_epochs=1, batch_size=10_000, shuffle_buffer_size=1)
  batches = list(char_prediction_preprocessing.create_preprocess_fn(spec, sequence_length)(ds).as_numpy_iterator())
  return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


def test_shakespeare_by_writer_keeps_the_roles():
  fake = _FakeTffLoader(tff.simulation.datasets.shakespeare.get_synthetic)
  fd = loaders.load_shakespeare('by_writer', 3, seed=0, sequence_length=10, load_fn=fake)
  assert fake.calls == [dict(cache_dir=None)]
  synthetic = tff.simulation.datasets.shakespeare.get_synthetic()
  assert fd.train.client_ids == sorted(synthetic.client_ids)
  for cid in fd.train.client_ids:
    x_ref, y_ref = _tff_baseline_sequences(synthetic.create_tf_dataset_for_client(cid), 10)
    np.testing.assert_array_equal(fd.train.client_arrays(cid)[0], x_ref)
    np.testing.assert_array_equal(fd.train.client_arrays(cid)[1], y_ref)
  assert fd.input_shape == (10,) and fd.num_classes == 90 and fd.pad_id == 0
  assert fd.test_x.shape == (12 + 15 + 4, 10) and fd.test_x.dtype == np.int32
  assert fd.element_spec['x'].shape == (10,) and fd.element_spec['y'].shape == (10,)


def test_shakespeare_repartitions_pooled_sequences():
  fake = _FakeTffLoader(tff.simulation.datasets.shakespeare.get_synthetic)
  by_role = loaders.load_shakespeare('by_writer', 3, seed=0, sequence_length=10, load_fn=fake)
  pooled_x = np.concatenate([by_role.train.client_arrays(c)[0] for c in by_role.train.client_ids])
  for part in ('iid', 'quantity_skew'):
    fd = loaders.load_shakespeare(part, 5, seed=3, sequence_length=10, load_fn=fake, beta=0.5)
    assert len(fd.train.client_ids) == 5
    reference = partition.split(np.zeros(len(pooled_x)), part, 5, 3, beta=0.5)
    for cid, p in zip(fd.train.client_ids, reference):
      np.testing.assert_array_equal(fd.train.client_arrays(cid)[0], pooled_x[p])


def test_load_federated_data_uses_tffs_shakespeare_loader(monkeypatch):
  fake = _FakeTffLoader(tff.simulation.datasets.shakespeare.get_synthetic)
  monkeypatch.setattr(tff.simulation.datasets.shakespeare, 'load_data', fake)
  fd = loaders.load_federated_data('shakespeare', 'by_writer', 2, seed=0, data_dir='/d', sequence_length=20)
  assert fake.calls == [dict(cache_dir='/d')]
  assert len(fd.train.client_ids) == 2 and fd.input_shape == (20,)


# -------------------------------------------------------------------------------------------------- dispatch


def test_load_federated_data_digits_is_the_embedded_digits():
  fd = loaders.load_federated_data('digits', 'mixed_skew', 6, seed=2, classes_per_client=3)
  ref = digits.federated_data('mixed_skew', 6, 2, classes_per_client=3)
  np.testing.assert_array_equal(fd.train.pooled_arrays()[0], ref.train.pooled_arrays()[0])
  np.testing.assert_array_equal(fd.ood_test_x, ref.ood_test_x)


def _pooled_labels(fd):
  return fd.train.pooled_arrays()[1]


def test_every_array_pool_takes_the_subset(monkeypatch, tmp_path):
  fd = loaders.load_federated_data('digits', 'iid', 4, seed=2, train_subset_fraction=0.25)
  ref = digits.federated_data('iid', 4, 2, train_subset_fraction=0.25)
  np.testing.assert_array_equal(fd.train.pooled_arrays()[0], ref.train.pooled_arrays()[0])
  y = digits.load_split().y_train
  assert np.sort(_pooled_labels(fd)).tolist() == np.sort(y[federated.stratified_subset(y, 0.25)]).tolist()
  assert len(fd.test_y) == len(digits.load_split().y_test)
  with tfds.testing.mock_data(num_examples=MOCK_EXAMPLES):
    fd = loaders.load_federated_data('mnist', 'iid', 2, seed=0, data_dir=str(tmp_path), train_subset_fraction=0.5)
    _, y = _tfds_reference('mnist', 'train', str(tmp_path))
  assert np.sort(_pooled_labels(fd)).tolist() == np.sort(y[federated.stratified_subset(y, 0.5)]).tolist()
  assert len(fd.test_y) == MOCK_EXAMPLES
  monkeypatch.setattr(tff.simulation.datasets.emnist, 'load_data',
                      _FakeTffLoader(tff.simulation.datasets.emnist.get_synthetic))
  whole = loaders.load_federated_data('emnist', 'iid', 2, seed=0)
  fd = loaders.load_federated_data('emnist', 'iid', 2, seed=0, train_subset_fraction=0.5)
  y = np.sort(_pooled_labels(whole))  # The pool's order does not change which examples a class keeps how many of.
  assert np.bincount(_pooled_labels(fd)).tolist() == [max(1, round(0.5 * n)) if n else 0 for n in np.bincount(y)]


def test_supported_partitions():
  assert loaders.supported_partitions('emnist') == (
      'iid', 'label_skew', 'dirichlet', 'quantity_skew', 'feature_skew', 'mixed_skew', 'feature_skew_shared',
      'mixed_skew_shared', 'by_writer')
  assert loaders.supported_partitions('cifar100') == ('iid', 'label_skew', 'dirichlet', 'quantity_skew')
  assert loaders.supported_partitions('shakespeare') == ('by_writer', 'iid', 'quantity_skew')
  assert 'by_writer' not in loaders.supported_partitions('digits')


@pytest.mark.parametrize('args,kwargs,argument', [
    (('imagenet', 'iid'), {}, 'dataset'),
    (('digits', 'by_writer'), {}, 'partition'),
    (('mnist', 'by_writer'), {}, 'partition'),
    (('shakespeare', 'label_skew'), {}, 'partition'),
    (('shakespeare', 'mixed_skew'), {}, 'partition'),
    (('cifar10', 'feature_skew'), {}, 'partition'),
    (('digits', 'iid'), dict(alpah=0.1), 'alpah'),
    (('digits', 'dirichlet'), dict(alpha=-1.0), 'alpha'),
    (('digits', 'iid'), dict(train_subset_fraction=0.0), 'train_subset_fraction'),
    (('mnist', 'iid'), dict(train_subset_fraction=1.5), 'train_subset_fraction'),
    (('emnist', 'by_writer'), dict(train_subset_fraction=0.5), 'train_subset_fraction'),  # Writers, not a pool.
    (('shakespeare', 'iid'), dict(train_subset_fraction=0.5), 'train_subset_fraction'),
])
def test_inconsistent_arguments_fail_before_loading(monkeypatch, args, kwargs, argument):
  def no_loading(*unused_args, **unused_kwargs):
    raise AssertionError('nothing may be loaded for an invalid combination')
  monkeypatch.setattr(tfds, 'load', no_loading)
  monkeypatch.setattr(tff.simulation.datasets.emnist, 'load_data', no_loading)
  monkeypatch.setattr(tff.simulation.datasets.shakespeare, 'load_data', no_loading)
  with pytest.raises(ValueError, match=argument):
    loaders.load_federated_data(*args, num_clients=3, seed=0, **kwargs)
