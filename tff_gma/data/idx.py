"""The IDX file format of (Fashion-)MNIST, read with NumPy, and the Fashion-MNIST files Debian installs.

IDX (LeCun et al.): a big-endian header, then the values. The header is a magic number `0x0000TTNN` (two zero
bytes, the value type `TT`, 0x08 for unsigned bytes, and the number of dimensions `NN`), then one 32-bit size per
dimension. MNIST's images are `0x00000803` (2051: N x 28 x 28), its labels `0x00000801` (2049: N).

`read_idx` checks the magic number, the value type, the dimensions and that the file holds exactly the values its
header announces, gzipped or not, and names the file in every error. `fashion_mnist_arrays` reads the four files
of Fashion-MNIST from a directory (Debian's package `dataset-fashion-mnist` puts the original files in
`DEBIAN_DIR`), with their names gzipped or not.
"""

from __future__ import annotations

import gzip
import os
from typing import Optional

import numpy as np

DEBIAN_DIR = '/usr/share/datasets/fashion-mnist'
INSTALL_HINT = ('install it with `apt-get install dataset-fashion-mnist` (as root; or `bash scripts/setup.sh '
                '--data=fashion_mnist` from the checkout), or pass --data_dir with the four IDX files')
FASHION_MNIST_FILES = {
    'train_images': 'train-images-idx3-ubyte',
    'train_labels': 'train-labels-idx1-ubyte',
    'test_images': 't10k-images-idx3-ubyte',
    'test_labels': 't10k-labels-idx1-ubyte',
}
FASHION_MNIST_CLASSES = 10
_UNSIGNED_BYTE = 0x08


class IdxError(ValueError):
  """An IDX file is missing, truncated or not IDX; the message names the file."""


def read_idx(path: str, *, expected_ndim: Optional[int] = None) -> np.ndarray:
  """The array of an IDX file of unsigned bytes (`.gz` or raw), shape as its header says."""
  opener = gzip.open if path.endswith('.gz') else open
  try:
    with opener(path, 'rb') as f:
      raw = f.read()
  except FileNotFoundError:
    raise IdxError(f'{path}: no such file') from None
  except (OSError, EOFError) as e:  # A damaged gzip stream.
    raise IdxError(f'{path}: cannot be read ({e})') from None
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
    raise IdxError(f'{path}: not an IDX file (its magic number must start with two zero bytes)')
  value_type, ndim = raw[2], raw[3]
  if value_type != _UNSIGNED_BYTE:
    raise IdxError(f'{path}: IDX value type 0x{value_type:02x}; expected 0x08 (unsigned bytes)')
  if ndim == 0 or (expected_ndim is not None and ndim != expected_ndim):
    raise IdxError(f'{path}: {ndim} dimensions; expected {expected_ndim if expected_ndim is not None else ">= 1"}')
  header = 4 + 4 * ndim
  if len(raw) < header:
    raise IdxError(f'{path}: truncated header ({len(raw)} bytes; the header of {ndim} dimensions has {header})')
  shape = tuple(int(d) for d in np.frombuffer(raw, dtype='>u4', count=ndim, offset=4))
  size = int(np.prod(shape))
  if len(raw) - header != size:
    raise IdxError(f'{path}: holds {len(raw) - header} values after its header; the header announces '
                   f'{" x ".join(map(str, shape))} = {size}' + (' (truncated)' if len(raw) - header < size else ''))
  return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_file(directory: str, name: str) -> Optional[str]:
  """`directory/name.gz` or `directory/name`, whichever exists (the gzipped one first), else None."""
  for candidate in (name + '.gz', name):
    path = os.path.join(directory, candidate)
    if os.path.isfile(path):
      return path
  return None


def has_fashion_mnist(directory: str) -> bool:
  return all(find_file(directory, name) for name in FASHION_MNIST_FILES.values())


def fashion_mnist_arrays(directory: Optional[str] = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(x_train, y_train, x_test, y_test) of Fashion-MNIST from its IDX files in `directory` (default
  `DEBIAN_DIR`): images float32 [N, 28, 28, 1] in [0, 1], labels int32 [N]. Raises `IdxError` naming the file
  (and, when one is missing, how to install them), or when images and labels disagree in number or range."""
  directory = directory or DEBIAN_DIR
  paths = {}
  for key, name in FASHION_MNIST_FILES.items():
    path = find_file(directory, name)
    if path is None:
      raise IdxError(f'{os.path.join(directory, name)}(.gz): no such file; Fashion-MNIST is not there: '
                     f'{INSTALL_HINT}')
    paths[key] = path
  out = []
  for split in ('train', 'test'):
    images = read_idx(paths[f'{split}_images'], expected_ndim=3)
    labels = read_idx(paths[f'{split}_labels'], expected_ndim=1)
    if images.shape[0] != labels.shape[0]:
      raise IdxError(f'{paths[f"{split}_images"]} holds {images.shape[0]} images but '
                     f'{paths[f"{split}_labels"]} {labels.shape[0]} labels')
    if labels.size and labels.max() >= FASHION_MNIST_CLASSES:
      raise IdxError(f'{paths[f"{split}_labels"]}: label {int(labels.max())} outside 0..{FASHION_MNIST_CLASSES - 1}')
    out += [(images.astype(np.float32) / 255.0)[..., np.newaxis], labels.astype(np.int32)]
  return tuple(out)
