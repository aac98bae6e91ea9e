"""Builds `tff.simulation.datasets.ClientData` from in-memory arrays and a partition."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def client_ids(num_clients: int) -> list[str]:
  width = max(3, len(str(num_clients - 1)))
  return [f'client_{i:0{width}d}' for i in range(num_clients)]


def from_partition(
    x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], ids: Sequence[str] | None = None,
) -> ArrayClientData:
  """A `ClientData` whose client `ids[i]` holds the examples `parts[i]` as `OrderedDict(x=..., y=...)`."""
  x, y = np.asarray(x), np.asarray(y)
  if len(x) != len(y):
    raise ValueError(f'x and y differ in length: {len(x)} vs {len(y)}')
  ids = list(ids) if ids is not None else client_ids(len(parts))
  if len(ids) != len(parts):
    raise ValueError(f'{len(ids)} client ids for {len(parts)} partitions')
  if any(len(p) == 0 for p in parts):
    raise ValueError('every client needs at least one example; use fewer clients')
  order = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
  return ArrayClientData(ids, x[order], y[order], [len(p) for p in parts])


def from_client_arrays(arrays: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> ArrayClientData:
  """A `ClientData` with one client per entry `client_id -> (x, y)`, in the mapping's order."""
  if not arrays:
    raise ValueError('arrays must hold at least one client')
  ids = list(arrays)
  if any(len(arrays[i][1]) == 0 for i in ids):
    raise ValueError('every client needs at least one example')
  mismatched = [i for i in ids if len(arrays[i][0]) != len(arrays[i][1])]
  if mismatched:  # The pool is sliced by the y counts: a mismatch would shift examples into the next client.
    raise ValueError(f'client {mismatched[0]!r} has {len(arrays[mismatched[0]][0])} inputs but '
                     f'{len(arrays[mismatched[0]][1])} labels')
  return ArrayClientData(
      ids, np.concatenate([arrays[i][0] for i in ids]), np.concatenate([arrays[i][1] for i in ids]),
      [len(arrays[i][1]) for i in ids])


class ArrayClientData(tff.simulation.datasets.ClientData):
  """A `ClientData` over in-memory arrays.

  The pool is stored once, in client order, and each client's arrays are views (slices) of it, so nothing is
  copied per client. `serializable_dataset_fn` (used by `dataset_computation`) slices one constant holding every
  client's examples; the constant is built on first use, since most callers never need it.
  `create_tf_dataset_for_client` builds the dataset from that client's own arrays instead, so a dataset handed to
  a TFF computation from Python serializes only that client's examples, not the whole pool.
  """

  def __init__(self, ids: Sequence[str], x: np.ndarray, y: np.ndarray, sizes: Sequence[int]):
    """`x`, `y`: every client's examples, concatenated in the order of `ids`; `sizes[i]`: client i's count."""
    super().__init__()
    self._ids = list(ids)
    if len(set(self._ids)) != len(self._ids):
      raise ValueError('client ids must be distinct')
    if len(sizes) != len(self._ids):
      raise ValueError(f'{len(sizes)} sizes for {len(self._ids)} client ids')
    self._sizes = np.asarray(sizes, dtype=np.int64)
    if np.any(self._sizes < 1) or self._sizes.sum() != len(x) or len(x) != len(y):
      raise ValueError('sizes must be positive and sum to len(x) == len(y)')
    self._x, self._y = x, y
    self._starts = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).astype(np.int64)
    self._index = {cid: i for i, cid in enumerate(self._ids)}
    self._dataset_fn = None
    self._element_spec = self.create_tf_dataset_for_client(self._ids[0]).element_spec

  @property
  def client_ids(self) -> list[str]:
    return self._ids

  @property
  def serializable_dataset_fn(self):
    if self._dataset_fn is None:
      self._dataset_fn = self._build_dataset_fn()
    return self._dataset_fn

  def _build_dataset_fn(self):
    all_x = tf.constant(self._x)
    all_y = tf.constant(self._y)
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(self._ids), tf.range(len(self._ids), dtype=tf.int64)),
        default_value=-1)
    starts_t = tf.constant(self._starts)
    sizes_t = tf.constant(self._sizes)

    def dataset_fn(client_id) -> tf.data.Dataset:
      index = table.lookup(tf.convert_to_tensor(client_id, tf.string))
      tf.debugging.assert_non_negative(index, message='unknown client id')
      start, size = starts_t[index], sizes_t[index]
      return tf.data.Dataset.from_tensor_slices(
          collections.OrderedDict(x=all_x[start:start + size], y=all_y[start:start + size]))

    return dataset_fn

  @property
  def element_type_structure(self):
    return self._element_spec

  def num_examples(self, client_id: str) -> int:
    return int(self._sizes[self._client_index(client_id)])

  def client_arrays(self, client_id: str) -> tuple[np.ndarray, np.ndarray]:
    i = self._client_index(client_id)
    start, end = self._starts[i], self._starts[i] + self._sizes[i]
    return self._x[start:end], self._y[start:end]

  def pooled_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """Every client's examples, concatenated in client order (views, not copies)."""
    return self._x, self._y

  def _client_index(self, client_id: str) -> int:
    if client_id not in self._index:
      raise ValueError(f'unknown client id {client_id!r}')
    return self._index[client_id]

  def create_tf_dataset_for_client(self, client_id: str) -> tf.data.Dataset:
    x, y = self.client_arrays(client_id)
    return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))
