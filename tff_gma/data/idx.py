"""The IDX file format of (Fashion-)MNIST, read with NumPy, and the Fashion-MNIST files Debian installs.

`read_idx` reads the header first and then at most the values it announces (refused above `MAX_VALUES`, gzip
decompressed in bounded chunks, regular files only), so a file cannot make it allocate more than it promised; every
error names the file. `fashion_mnist_arrays` reads and cross-checks the four files of Fashion-MNIST. No TensorFlow.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO, Optional

import numpy as np

DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'
INSTALL_HINT = ('install it with `apt-get install dataset-fashion-mnist` (as root; or `bash scripts/setup.sh '
                '--data=fashion_mnist` from the checkout), or pass --data_dir with the four IDX files '
                '(--fashion_mnist_source=tfds reads TFDS\'s copy instead, which TFDS downloads into --data_dir)')
FASHION_MNIST_FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}
FASHION_MNIST_CLASSES = 10
# The most values one file may announce: 5.7 times Fashion-MNIST's training images (60,000 x 28 x 28), 256 MiB
# read, 1 GiB as the float32 images the loader makes of them.
MAX_VALUES = 1 << 28
_UNSIGNED_BYTE = 0x08
_CHUNK = 1 << 20  # Bytes decompressed or read per call.


class IdxError(ValueError):
  """An IDX file is missing, truncated, too large or not IDX; the message names the file."""


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO'), (stat.S_ISCHR, 'a character device'),
                     (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket')):
    if test(mode):
      return name
  return 'not a regular file'


@contextlib.contextmanager
def _open(path: str) -> Iterator[tuple[BinaryIO, Optional[int]]]:
  """(the file's decompressed byte stream, its size on disk when it is raw, else None), for a regular file only.

  Opened with O_NONBLOCK and checked with fstat before any read: a FIFO (which would block), a device (which could
  stream forever) or a directory is refused, also when it replaced the file between the check and the open."""
  info = os.stat(path)  # FileNotFoundError when missing.
  if not stat.S_ISREG(info.st_mode):
    raise IdxError(f'{path}: {_kind(info.st_mode)}, not a regular file; an IDX file must be one')
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  with os.fdopen(fd, 'rb', buffering=0) as raw:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise IdxError(f'{path}: {_kind(info.st_mode)}, not a regular file; an IDX file must be one')
    if path.endswith('.gz'):
      with gzip.GzipFile(fileobj=raw, mode='rb') as unzipped:
        yield unzipped, None
    else:
      yield raw, info.st_size


def _read_into(f: BinaryIO, buffer: memoryview) -> int:
  """Fills `buffer` from `f` in chunks (so no temporary copy of the whole); returns the bytes read (fewer: EOF)."""
  got = 0
  while got < len(buffer):
    n = f.readinto(buffer[got:got + _CHUNK])
    if not n:
      break
    got += n
  return got


def _read(f: BinaryIO, disk_size: Optional[int], path: str, expected_ndim: Optional[int], max_values: int
          ) -> np.ndarray:
  magic = bytearray(4)
  got = _read_into(f, memoryview(magic))
  if got < 4 or magic[0] != 0 or magic[1] != 0:
    raise IdxError(f'{path}: not an IDX file (its magic number must start with two zero bytes)')
  value_type, ndim = magic[2], magic[3]
  if value_type != _UNSIGNED_BYTE:
    raise IdxError(f'{path}: IDX value type 0x{value_type:02x}; expected 0x08 (unsigned bytes)')
  if ndim == 0 or (expected_ndim is not None and ndim != expected_ndim):
    raise IdxError(f'{path}: {ndim} dimensions; expected {expected_ndim if expected_ndim is not None else ">= 1"}')
  header = 4 + 4 * ndim
  sizes = bytearray(4 * ndim)
  got = _read_into(f, memoryview(sizes))
  if got < len(sizes):
    raise IdxError(f'{path}: truncated header ({4 + got} bytes; the header of {ndim} dimensions has {header})')
  shape = struct.unpack(f'>{ndim}I', sizes)  # Python ints: their product cannot overflow.
  size = math.prod(shape)
  announced = f'{" x ".join(map(str, shape))} = {size}'
  if size > max_values:
    raise IdxError(f'{path}: the header announces {announced} values, more than the {max_values} this reader '
                   f'accepts in one file (not Fashion-MNIST\'s, whose largest file holds 60000 x 28 x 28)')
  if disk_size is not None and disk_size - header != size:  # A raw file: its size says it without reading.
    held = max(disk_size - header, 0)
    raise IdxError(f'{path}: holds {held} values after its header; the header announces {announced}'
                   + (' (truncated)' if held < size else ''))
  values = np.empty(size, np.uint8)
  got = _read_into(f, memoryview(values))
  if got < size:
    raise IdxError(f'{path}: holds {got} values after its header; the header announces {announced} (truncated)')
  if f.read(1):  # One byte past the announced values: the rest is never decompressed.
    raise IdxError(f'{path}: holds more values after its header than the {announced} it announces')
  return values.reshape(shape)


def read_idx(path: str, *, expected_ndim: Optional[int] = None, max_values: int = MAX_VALUES) -> np.ndarray:
  """The array of an IDX file of unsigned bytes (`.gz` or raw), shape as its header says.

  Reads the header, then at most the `size` values it announces (`size` <= `max_values`, else refused) and one
  byte more to tell that the file ends there. Raises `IdxError` naming `path` for a missing file, one that is not
  a regular file, not IDX of unsigned bytes (or not `expected_ndim`-dimensional), announces too many values,
  holds fewer or more values than announced, or whose gzip stream is damaged.
  """
  try:
    with _open(path) as (f, disk_size):
      return _read(f, disk_size, path, expected_ndim, max_values)
  except FileNotFoundError:
    raise IdxError(f'{path}: no such file') from None
  except (OSError, EOFError, zlib.error) as e:  # A damaged gzip stream; an unreadable file.
    raise IdxError(f'{path}: cannot be read ({e})') from None


def find_file(directory: str, name: str) -> Optional[str]:
  """`directory/name.gz` or `directory/name`, whichever exists (the gzipped one first), else None. Whatever exists
  under the name is returned, a FIFO or a directory too: `read_idx` then says what it is."""
  for candidate in (name + '.gz', name):
    path = os.path.join(directory, candidate)
    if os.path.exists(path):
      return path
  return None


def has_fashion_mnist(directory: str) -> bool:
  return all(find_file(directory, name) for name in FASHION_MNIST_FILES.values())


def fashion_mnist_paths(directory: Optional[str] = None) -> dict[str, str]:
  """The four files of Fashion-MNIST in `directory` (default `DEBIAN_DIR`) by key of `FASHION_MNIST_FILES`.

  Raises `IdxError` in one line naming the directory, every file it lacks and how to install them."""
  directory = directory or DEBIAN_DIR
  if not os.path.isdir(directory):
    what = 'not a directory' if os.path.exists(directory) else 'no such directory'
    raise IdxError(f'{directory}: {what}, so Fashion-MNIST is not there: {INSTALL_HINT}')
  paths = {key: find_file(directory, name) for key, name in FASHION_MNIST_FILES.items()}
  missing = [f'{FASHION_MNIST_FILES[key]}(.gz)' for key, path in paths.items() if path is None]
  if missing:
    raise IdxError(f'{directory} lacks {", ".join(missing)}: Fashion-MNIST is not there: {INSTALL_HINT}')
  return paths


def fashion_mnist_arrays(directory: Optional[str] = None, *, max_values: int = MAX_VALUES
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(x_train, y_train, x_test, y_test) of Fashion-MNIST from its IDX files in `directory` (default
  `DEBIAN_DIR`): images float32 [N, H, W, 1] in [0, 1] (28 x 28 for Fashion-MNIST), labels int32 [N].

  Raises `IdxError` naming the file (and, when some are missing, which and how to install them), or the files,
  when images and labels disagree in number, labels lie outside the classes, or the test images differ in shape
  from the training images (the model is built for the training images' shape; evaluation would fail after
  training)."""
  paths = fashion_mnist_paths(directory)
  out, image_shape = [], None
  for split in ('train', 'test'):
    images = read_idx(paths[f'{split}_images'], expected_ndim=3, max_values=max_values)
    labels = read_idx(paths[f'{split}_labels'], expected_ndim=1, max_values=max_values)
    if images.shape[0] != labels.shape[0]:
      raise IdxError(f'{paths[f"{split}_images"]} holds {images.shape[0]} images but '
                     f'{paths[f"{split}_labels"]} {labels.shape[0]} labels')
    if labels.size and labels.max() >= FASHION_MNIST_CLASSES:
      raise IdxError(f'{paths[f"{split}_labels"]}: label {int(labels.max())} outside 0..{FASHION_MNIST_CLASSES - 1}')
    if image_shape is None:
      image_shape = images.shape[1:]
    elif images.shape[1:] != image_shape:
      raise IdxError(f'{paths["test_images"]} holds images of {" x ".join(map(str, images.shape[1:]))} but '
                     f'{paths["train_images"]} of {" x ".join(map(str, image_shape))}; train and test images must '
                     f'agree in shape')
    out += [(images.astype(np.float32) / 255.0)[..., np.newaxis], labels.astype(np.int32)]
  return tuple(out)
