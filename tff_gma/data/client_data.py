"""Builds `tff.simulation.datasets.ClientData` from in-memory arrays and a partition."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def client_ids(num_clients: int) -> list[str]:
  width = max(3, len(str(num_clients - 1)))
  return [f'client_{i:0{width}d}' for i in range(num_clients)]


def from_partition(
    x: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray], ids: Sequence[str] | None = None,
) -> tff.simulation.datasets.ClientData:
  """A `ClientData` whose client `ids[i]` holds the examples `parts[i]` as `OrderedDict(x=..., y=...)`.

  The examples are stored once, concatenated in client order, and each client's dataset is a slice of them, so
  the dataset function is serializable (`ClientData.dataset_computation` works) and nothing is copied per client.
  """
  if len(x) != len(y):
    raise ValueError(f'x and y differ in length: {len(x)} vs {len(y)}')
  ids = list(ids) if ids is not None else client_ids(len(parts))
  if len(ids) != len(parts):
    raise ValueError(f'{len(ids)} client ids for {len(parts)} partitions')
  if any(len(p) == 0 for p in parts):
    raise ValueError('every client needs at least one example; use fewer clients')
  order = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
  sizes = np.array([len(p) for p in parts], dtype=np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  all_x = tf.constant(np.asarray(x)[order])
  all_y = tf.constant(np.asarray(y)[order])
  table = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(tf.constant(ids), tf.range(len(ids), dtype=tf.int64)),
      default_value=-1)
  starts_t = tf.constant(starts)
  sizes_t = tf.constant(sizes)

  def dataset_fn(client_id) -> tf.data.Dataset:
    index = table.lookup(tf.convert_to_tensor(client_id, tf.string))
    tf.debugging.assert_non_negative(index, message='unknown client id')
    start, size = starts_t[index], sizes_t[index]
    return tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=all_x[start:start + size], y=all_y[start:start + size]))

  client_arrays = {
      cid: (np.asarray(x)[np.asarray(p, dtype=np.int64)], np.asarray(y)[np.asarray(p, dtype=np.int64)])
      for cid, p in zip(ids, parts)
  }
  return ArrayClientData(ids, dataset_fn, client_arrays)


class ArrayClientData(tff.simulation.datasets.ClientData):
  """A `ClientData` over in-memory arrays.

  `serializable_dataset_fn` (used by `dataset_computation`) slices one constant holding every client's examples.
  `create_tf_dataset_for_client` builds the dataset from that client's own arrays instead, so a dataset handed
  to a TFF computation from Python serializes only that client's examples, not the whole pool.
  """

  def __init__(self, ids, dataset_fn, client_arrays):
    super().__init__()
    self._ids = list(ids)
    self._dataset_fn = dataset_fn
    self._arrays = client_arrays
    self._element_spec = self.create_tf_dataset_for_client(self._ids[0]).element_spec

  @property
  def client_ids(self) -> list[str]:
    return self._ids

  @property
  def serializable_dataset_fn(self):
    return self._dataset_fn

  @property
  def element_type_structure(self):
    return self._element_spec

  def num_examples(self, client_id: str) -> int:
    return len(self._arrays[client_id][1])

  def client_arrays(self, client_id: str) -> tuple[np.ndarray, np.ndarray]:
    return self._arrays[client_id]

  def create_tf_dataset_for_client(self, client_id: str) -> tf.data.Dataset:
    if client_id not in self._arrays:
      raise ValueError(f'unknown client id {client_id!r}')
    x, y = self._arrays[client_id]
    return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))
