"""tff_gma.data.idx: the IDX parser on files the tests write (gzipped and raw, good and broken), the Fashion-MNIST
loader on a generated directory, and shape/label-count checks on the real files Debian installs.

Hostile files (issue 40) are read within bounds: a header announcing more than `MAX_VALUES` (2^31 x 2^31 x 4 among
them) is refused before any value is read, and a gzip bomb or a large sparse raw file is read in a child process
whose address space is limited (RLIMIT_AS), without TensorFlow (idx.py imports NumPy only)."""

import gzip
import os
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tff_gma.data import federated
from tff_gma.data import idx
from tff_gma.data import loaders
from tff_gma.data import partition


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
    (b'\x00\x00\x08\x01' + struct.pack('>I', 2) + b'abc', 'holds (3|more) values'),
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
  with pytest.raises(idx.IdxError, match='lacks train-images-idx3-ubyte.*apt-get install dataset-fashion-mnist'):
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


def test_the_real_files_whole_and_a_tenth():
  """The default keeps the whole pool (the reference partition of all 60,000 examples); a tenth is 600 of each
  class's 6,000, the same examples for every seed, with the whole test split."""
  if not idx.has_fashion_mnist(idx.DEBIAN_DIR):
    pytest.skip(f'{idx.DEBIAN_DIR}: not installed here; {idx.INSTALL_HINT}')  # test_the_real_files fails on CI.
  x_train, y_train, _, y_test = idx.fashion_mnist_arrays()
  whole = loaders.load_federated_data('fashion_mnist', 'label_skew', 10, 0, classes_per_client=2)
  for cid, part in zip(whole.train.client_ids, partition.label_skew(y_train, 10, 2, 0)):
    np.testing.assert_array_equal(whole.train.client_arrays(cid)[0], x_train[part])
  kept = federated.stratified_subset(y_train, 0.1)
  for seed in (0, 1):
    tenth = loaders.load_federated_data('fashion_mnist', 'label_skew', 10, seed, classes_per_client=2,
                                        train_subset_fraction=0.1)
    x, y = tenth.train.pooled_arrays()
    assert np.bincount(y).tolist() == [600] * 10 and len(tenth.test_y) == len(y_test)
    assert sorted(map(bytes, x)) == sorted(map(bytes, x_train[kept]))  # The same examples, however dealt.


# ------------------------------------------------------------------------------------------ hostile files (issue 40)


@pytest.mark.parametrize('suffix', ['', '.gz'])
@pytest.mark.parametrize('shape, announced', [
    ((2**31, 2**31, 4), '2147483648 x 2147483648 x 4 = 18446744073709551616'),  # np.prod overflowed this to 0.
    ((2**32 - 1,), '4294967295 = 4294967295'),
    ((idx.MAX_VALUES + 1,), f'{idx.MAX_VALUES + 1} = {idx.MAX_VALUES + 1}'),
])
def test_a_header_announcing_too_many_values_is_refused_before_reading(tmp_path, suffix, shape, announced):
  header = bytes([0, 0, 8, len(shape)]) + struct.pack(f'>{len(shape)}I', *shape)
  path = _write(tmp_path / f'huge{suffix}', header + b'\0' * 16)
  with pytest.raises(idx.IdxError, match=f'^{path}: the header announces {announced} values, more than the '
                                         f'{idx.MAX_VALUES} this reader accepts'):
    idx.read_idx(path)


def test_max_values_bounds_what_a_file_may_announce(tmp_path):
  path = _write(tmp_path / 'images.gz', _idx_bytes(np.zeros((3, 4, 4))))
  assert idx.read_idx(path, max_values=48).shape == (3, 4, 4)
  with pytest.raises(idx.IdxError, match='more than the 47 this reader accepts'):
    idx.read_idx(path, max_values=47)


@pytest.mark.parametrize('make, kind', [
    (os.mkfifo, 'a FIFO'),
    (os.mkdir, 'a directory'),
    (lambda path: os.symlink('/dev/zero', path), 'a character device'),
])
def test_only_regular_files_are_read(tmp_path, make, kind):
  """A FIFO would block the reader, /dev/zero feed it forever: both are refused before any read."""
  path = str(tmp_path / 'train-images-idx3-ubyte.gz')
  make(path)
  began = time.monotonic()
  with pytest.raises(idx.IdxError, match=f'^{path}: {kind}, not a regular file'):
    idx.read_idx(path)
  assert time.monotonic() - began < 5


# Reads `path` with idx.py (loaded from its file, so neither TensorFlow nor the package is imported) in an address
# space of `limit` bytes; prints the IdxError's message, or exits 3 on a MemoryError.
_CHILD = textwrap.dedent("""
    import importlib.util, resource, sys
    module_path, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = importlib.util.spec_from_file_location('idx_under_test', module_path)
    idx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(idx)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
      idx.read_idx(path)
    except idx.IdxError as e:
      print(e)
      sys.exit(0)
    except MemoryError:
      sys.exit(3)
    print('read without error')
    sys.exit(4)
""")
_LIMIT = 1 << 30  # 1 GiB of address space: Python, NumPy and the announced 47 MB fit; the files' gigabytes do not.
_BOMB_BYTES = 3 << 30


def _read_in_a_bounded_child(path, module_path=idx.__file__):
  env = dict(os.environ, OPENBLAS_NUM_THREADS='1', OMP_NUM_THREADS='1')
  return subprocess.run([sys.executable, '-c', _CHILD, module_path, str(path), str(_LIMIT)], capture_output=True,
                        text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)


def _gzip_bomb(path, header: bytes) -> str:
  """A gzip file of a few MB whose stream is `header` then 3 GiB of zeros: concatenated gzip members (which gzip
  readers join into one stream), each 16 MiB of zeros compressed to 16 kB; written in well under a second."""
  member = gzip.compress(b'\0' * (16 << 20), compresslevel=9, mtime=0)
  with open(path, 'wb') as f:
    f.write(gzip.compress(header, mtime=0))
    for _ in range(_BOMB_BYTES // (16 << 20)):
      f.write(member)
  return str(path)


def test_a_gzip_bomb_is_read_in_bounded_memory(tmp_path):
  """A 3 MB .gz expanding to 3 GiB (the issue's peaked at 6.9 GB): its header announces Fashion-MNIST's 60000 x 28
  x 28, read in a 1 GiB address space, refused at the first byte past them. (The reader before this change, which
  read the whole stream first, fails with a MemoryError in that child: checked against HEAD's idx.py.)"""
  path = _gzip_bomb(tmp_path / 'train-images-idx3-ubyte.gz', bytes([0, 0, 8, 3]) + struct.pack('>3I', 60000, 28, 28))
  assert os.path.getsize(path) < 4 << 20
  began = time.monotonic()
  child = _read_in_a_bounded_child(path)
  assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
  assert child.stdout == (f'{path}: holds more values after its header than the 60000 x 28 x 28 = 47040000 it '
                          f'announces\n')
  assert time.monotonic() - began < 20


def test_a_large_sparse_raw_file_is_refused_by_its_size(tmp_path):
  """A 3 GiB sparse raw file (the issue's peaked at 3.7 GB) announcing 10 x 28 x 28: refused from its size on disk,
  before any value is read."""
  path = tmp_path / 'train-images-idx3-ubyte'
  with open(path, 'wb') as f:
    f.write(bytes([0, 0, 8, 3]) + struct.pack('>3I', 10, 28, 28))
    f.truncate(_BOMB_BYTES)
  child = _read_in_a_bounded_child(path)
  assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
  assert child.stdout == (f'{path}: holds {_BOMB_BYTES - 16} values after its header; the header announces 10 x 28 '
                          f'x 28 = 7840\n')


def test_test_images_of_another_shape_than_the_training_images_are_refused(tmp_path):
  """Checked when the data is read: a run would otherwise train, write its outputs and fail in evaluation."""
  _fashion_dir(tmp_path)
  _write(tmp_path / 't10k-images-idx3-ubyte.gz', _idx_bytes(np.zeros((6, 32, 32))))
  with pytest.raises(idx.IdxError, match=f'^{tmp_path}/t10k-images-idx3-ubyte.gz holds images of 32 x 32 but '
                                         f'{tmp_path}/train-images-idx3-ubyte.gz of 28 x 28; train and test images '
                                         f'must agree in shape$'):
    idx.fashion_mnist_arrays(str(tmp_path))


def _no_tfds(monkeypatch):
  """Makes any use of TFDS fail the test: the IDX source must never reach it (nor the network)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def refuse(*args, **kwargs):
    raise AssertionError(f'TFDS was called: {args} {kwargs}')

  monkeypatch.setattr(tfds, 'load', refuse)
  monkeypatch.setattr(tfds, 'builder', refuse)


def test_a_data_dir_without_the_files_is_one_line_and_no_download(tmp_path, monkeypatch):
  """Issue 40: an incomplete --data_dir fell back to a TFDS download (downloads/ created, ~210 s of retries)."""
  _no_tfds(monkeypatch)
  _fashion_dir(tmp_path)
  os.remove(tmp_path / 'train-labels-idx1-ubyte.gz')
  os.remove(tmp_path / 't10k-images-idx3-ubyte.gz')
  before = sorted(os.listdir(tmp_path))
  with pytest.raises(idx.IdxError) as raised:
    loaders.load_federated_data('fashion_mnist', 'iid', 3, seed=0, data_dir=str(tmp_path))
  message = str(raised.value)
  assert '\n' not in message
  assert message.startswith(f'{tmp_path} lacks train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz): '
                            f'Fashion-MNIST is not there: install it with `apt-get install dataset-fashion-mnist`')
  assert '--fashion_mnist_source=tfds' in message
  assert sorted(os.listdir(tmp_path)) == before  # No downloads/ or anything else.
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(idx.IdxError, match=f'^{empty} lacks train-images-idx3-ubyte\\(.gz\\), train-labels'):
    loaders.load_federated_data('fashion_mnist', 'iid', 3, seed=0, data_dir=str(empty))
  assert os.listdir(empty) == []
  with pytest.raises(idx.IdxError, match=f'^{tmp_path}/nowhere: no such directory, so Fashion-MNIST is not there'):
    loaders.load_federated_data('fashion_mnist', 'iid', 3, seed=0, data_dir=str(tmp_path / 'nowhere'))
  assert not (tmp_path / 'nowhere').exists()


def test_the_tfds_source_is_asked_for_explicitly(tmp_path):
  with pytest.raises(ValueError, match='fashion_mnist_source must be one of'):
    loaders.load_federated_data('fashion_mnist', 'iid', 3, seed=0, data_dir=str(tmp_path), fashion_mnist_source='x')
  with pytest.raises(ValueError, match='fashion_mnist_source=tfds applies to dataset=fashion_mnist only'):
    loaders.load_federated_data('digits', 'iid', 3, seed=0, fashion_mnist_source='tfds')
