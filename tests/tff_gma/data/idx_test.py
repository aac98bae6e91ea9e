"""tff_gma.data.idx: the IDX parser on files the tests write (gzipped and raw, good and broken), the Fashion-MNIST
loader on a generated directory, and shape/label-count checks on the real files Debian installs."""

import gzip
import os
import struct

import numpy as np
import pytest

from tff_gma.data import idx
from tff_gma.data import loaders


def _idx_bytes(array: np.ndarray, *, magic_type: int = 0x08) -> bytes:
  header = bytes([0, 0, magic_type, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape)
  return header + array.astype(np.uint8).tobytes()


def _write(path, data: bytes) -> str:
  path = str(path)
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'wb') as f:
    f.write(data)
  return path


@pytest.mark.parametrize('suffix', ['', '.gz'])
def test_reads_images_and_labels(tmp_path, suffix):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)
  labels = np.array([0, 9, 3, 3, 1], np.uint8)
  np.testing.assert_array_equal(idx.read_idx(_write(tmp_path / f'i{suffix}', _idx_bytes(images))), images)
  np.testing.assert_array_equal(idx.read_idx(_write(tmp_path / f'l{suffix}', _idx_bytes(labels)), expected_ndim=1),
                                labels)


@pytest.mark.parametrize('data, message', [
    (b'\x01\x00\x08\x01' + struct.pack('>I', 2) + b'ab', 'not an IDX file'),
    (b'\x00\x00\x0d\x01' + struct.pack('>I', 2) + b'ab', 'IDX value type 0x0d'),
    (b'\x00\x00\x08\x03' + struct.pack('>I', 2), 'truncated header'),
    (b'\x00\x00\x08\x01' + struct.pack('>I', 5) + b'abc', r'holds 3 values .* announces 5 = 5 \(truncated\)'),
    (b'\x00\x00\x08\x01' + struct.pack('>I', 2) + b'abc', 'holds 3 values'),
    (b'\x00\x00', 'not an IDX file'),
])
@pytest.mark.parametrize('suffix', ['', '.gz'])
def test_broken_files_name_the_file(tmp_path, data, message, suffix):
  path = _write(tmp_path / f'broken{suffix}', data)
  with pytest.raises(idx.IdxError, match=f'{path}: {message}'):
    idx.read_idx(path)


def test_dimensions_and_damaged_gzip(tmp_path):
  path = _write(tmp_path / 'images', _idx_bytes(np.zeros((2, 3, 3))))
  with pytest.raises(idx.IdxError, match='3 dimensions; expected 1'):
    idx.read_idx(path, expected_ndim=1)
  damaged = tmp_path / 'damaged.gz'
  damaged.write_bytes(gzip.compress(_idx_bytes(np.zeros(10)))[:-12])
  with pytest.raises(idx.IdxError, match=f'{damaged}: cannot be read'):
    idx.read_idx(str(damaged))


def _fashion_dir(directory, train=12, test=6, gz=True, labels=None):
  rng = np.random.default_rng(1)
  arrays = {
      'train_images': rng.integers(0, 256, (train, 28, 28)), 'test_images': rng.integers(0, 256, (test, 28, 28)),
      'train_labels': np.arange(train) % 10 if labels is None else labels, 'test_labels': np.arange(test) % 10,
  }
  for key, name in idx.FASHION_MNIST_FILES.items():
    _write(os.path.join(directory, name + ('.gz' if gz else '')), _idx_bytes(np.asarray(arrays[key])))
  return arrays


@pytest.mark.parametrize('gz', [True, False])
def test_fashion_mnist_from_a_directory(tmp_path, gz):
  arrays = _fashion_dir(tmp_path, gz=gz)
  x_train, y_train, x_test, y_test = idx.fashion_mnist_arrays(str(tmp_path))
  assert x_train.shape == (12, 28, 28, 1) and x_train.dtype == np.float32 and x_test.shape == (6, 28, 28, 1)
  np.testing.assert_allclose(x_train[..., 0], arrays['train_images'] / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(y_train, arrays['train_labels'])
  np.testing.assert_array_equal(y_test, arrays['test_labels'])
  data = loaders.load_federated_data('fashion_mnist', 'iid', 3, seed=0, data_dir=str(tmp_path))
  assert data.input_shape == (28, 28, 1) and data.num_classes == 10 and len(data.train.client_ids) == 3
  assert sum(data.train.num_examples(c) for c in data.train.client_ids) == 12


def test_fashion_mnist_errors_name_the_file(tmp_path):
  with pytest.raises(idx.IdxError, match='train-images-idx3-ubyte.*no such file.*apt-get install dataset-fashion-mnist'):
    idx.fashion_mnist_arrays(str(tmp_path))
  _fashion_dir(tmp_path, labels=np.arange(11) % 10)
  with pytest.raises(idx.IdxError, match='holds 12 images but .*train-labels-idx1-ubyte.gz 11 labels'):
    idx.fashion_mnist_arrays(str(tmp_path))
  _fashion_dir(tmp_path, labels=np.full(12, 10))
  with pytest.raises(idx.IdxError, match='label 10 outside 0..9'):
    idx.fashion_mnist_arrays(str(tmp_path))


def test_the_real_files():
  """Debian's `dataset-fashion-mnist` (CI installs it: .ci/run runs `scripts/setup.sh --data=fashion_mnist`)."""
  if not idx.has_fashion_mnist(idx.DEBIAN_DIR):
    if os.environ.get('CI'):
      pytest.fail(f'{idx.DEBIAN_DIR}: Fashion-MNIST is not installed; {idx.INSTALL_HINT}')
    pytest.skip(f'{idx.DEBIAN_DIR}: not installed here; {idx.INSTALL_HINT}')
  x_train, y_train, x_test, y_test = idx.fashion_mnist_arrays()
  assert x_train.shape == (60_000, 28, 28, 1) and x_test.shape == (10_000, 28, 28, 1)
  assert np.bincount(y_train).tolist() == [6_000] * 10 and np.bincount(y_test).tolist() == [1_000] * 10
  assert x_train.min() == 0.0 and x_train.max() == 1.0
