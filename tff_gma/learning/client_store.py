"""`ClientArrayStore`: per-client arrays that clients keep between rounds, held by the simulation.

TFF has no client state and a `LearningProcess` cannot output CLIENTS-placed values, so methods whose clients keep
something across rounds (SCAFFOLD's control variates c_i, personalized RFA's personal parameters v_k) pass it in
with the client data and get it back from a `next` variant that also returns it at CLIENTS. In simulation, a store
keeps those arrays by client id (zeros for a client not seen yet), builds each client's input, and saves/loads
them beside the server state's checkpoints.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


class ClientArrayStore:
  """A tuple of arrays (fixed shapes and dtypes) per client id."""

  what = 'client arrays'  # How errors name the stored arrays.

  def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]):
    self._shapes = [tuple(int(d) for d in s) for s in shapes]
    self._dtypes = [np.dtype(d) for d in dtypes]
    if len(self._shapes) != len(self._dtypes) or not self._shapes:
      raise ValueError(f'shapes and dtypes must be non-empty and of equal length, got {shapes} and {dtypes}')
    self._arrays: dict[str, tuple[np.ndarray, ...]] = {}

  @staticmethod
  def shapes_and_dtypes(value_type) -> tuple[list, list]:
    """The shapes and dtypes of the tensors of a TFF type (e.g. a process's control-variate type)."""
    leaves = tff.structure.flatten(value_type)
    return [t.shape for t in leaves], [t.dtype for t in leaves]

  def __len__(self) -> int:
    return len(self._arrays)

  def __contains__(self, client_id: str) -> bool:
    return client_id in self._arrays

  def get(self, client_id: str) -> tuple[np.ndarray, ...]:
    if client_id in self._arrays:
      return self._arrays[client_id]
    return tuple(np.zeros(s, d) for s, d in zip(self._shapes, self._dtypes))

  def set(self, client_id: str, arrays: Sequence[Any]) -> None:
    arrays = tuple(np.asarray(a) for a in arrays)
    if [a.shape for a in arrays] != self._shapes:
      raise ValueError(f'{self.what} of client {client_id!r}: shapes {[a.shape for a in arrays]}, '
                       f'expected {self._shapes}')
    self._arrays[client_id] = tuple(a.astype(d, copy=False) for a, d in zip(arrays, self._dtypes))

  def clear(self) -> None:
    self._arrays = {}

  def as_dataset(self, client_id: str) -> tf.data.Dataset:
    """A one-element dataset holding the client's arrays (how they travel with the client data)."""
    return tf.data.Dataset.from_tensors(tuple(tf.constant(a) for a in self.get(client_id)))

  def save(self, path: str) -> None:
    """Writes every client's arrays to one .npz, atomically (ids kept as JSON, so any string is a valid id)."""
    ids = sorted(self._arrays)
    arrays = {f'a{i}_{j}': a for i, cid in enumerate(ids) for j, a in enumerate(self._arrays[cid])}
    arrays['client_ids'] = np.asarray(json.dumps(ids))
    tmp = path + '.tmp.npz'
    np.savez(tmp, **arrays)
    os.replace(tmp, path)

  def load_from(self, path: str) -> None:
    """Replaces the stored arrays by those of a `save`d file."""
    with np.load(path) as f:
      ids = json.loads(str(f['client_ids']))
      loaded = {cid: tuple(f[f'a{i}_{j}'] for j in range(len(self._shapes))) for i, cid in enumerate(ids)}
    self.clear()
    for cid, arrays in loaded.items():
      self.set(cid, arrays)
