"""`ClientStateStore`: the values clients keep between rounds, held by the simulation.

TFF has no client state, so SCAFFOLD's and personalized RFA's clients get theirs from this store: by client id (zeros
for a new one), fed into each round and saved per round beside the checkpoints.
Detail: docs/experiments.md#client-state"""

from __future__ import annotations

import collections
import glob
import io
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.learning import client_lib
from training import safe_files


class ClientStateStore:
  """A tuple of arrays (fixed shapes and dtypes) per client id, for one process with client state."""

  def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any], what: str = 'client state',
               key: str = 'client_state'):
    self._shapes = [tuple(int(d) for d in s) for s in shapes]
    self._dtypes = [np.dtype(d) for d in dtypes]
    if len(self._shapes) != len(self._dtypes) or not self._shapes:
      raise ValueError(f'shapes and dtypes must be non-empty and of equal length, got {shapes} and {dtypes}')
    self._arrays: dict[str, tuple[np.ndarray, ...]] = {}
    self.what = what  # How errors and files name the stored arrays.
    self._key = key  # Their key in the client data.

  @classmethod
  def for_process(cls, process: client_lib.LearningProcessWithClientState) -> 'ClientStateStore':
    """An empty store for `process`'s client state."""
    if getattr(process, 'client_state_key', None) is None:
      raise ValueError(f'process must be a tff_gma.learning.LearningProcessWithClientState (or a staged one), got '
                       f'{process!r}')
    leaves = tff.structure.flatten(process.client_state_type)
    return cls([t.shape for t in leaves], [t.dtype for t in leaves], what=process.client_state_key,
               key=process.client_state_key)

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

  def client_data(self, client_id: str, batches: tf.data.Dataset) -> collections.OrderedDict:
    """A client's input to the process: its batches and a one-element dataset holding its kept values."""
    return collections.OrderedDict([(client_lib.BATCHES, batches), (self._key, self.as_dataset(client_id))])

  def run_round(self, process: client_lib.LearningProcessWithClientState, state, client_ids: Sequence[str],
                datasets: Sequence[tf.data.Dataset]):
    """One round on `client_ids` with their batch datasets; stores their new values; returns (state, metrics)."""
    if len(client_ids) != len(datasets):
      raise ValueError(f'client_ids and datasets must have the same length, got {len(client_ids)} and '
                       f'{len(datasets)}')
    output = process.next_with_client_state(
        state, [self.client_data(cid, ds) for cid, ds in zip(client_ids, datasets)])
    for client_id, values in zip(client_ids, output.client_state):
      self.set(client_id, values)
    return output.state, output.metrics

  # Persistence.

  def save(self, path: str) -> None:
    """Writes every client's arrays to one .npz, atomically (ids kept as JSON, so any string is a valid id)."""
    ids = sorted(self._arrays)
    arrays = {f'a{i}_{j}': a for i, cid in enumerate(ids) for j, a in enumerate(self._arrays[cid])}
    arrays['client_ids'] = np.asarray(json.dumps(ids))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    safe_files.write_atomic(path, buffer.getvalue())  # Never through a link planted at the path.

  def load_from(self, path: str) -> None:
    """Replaces the stored arrays by those of a `save`d file."""
    with np.load(path) as f:
      ids = json.loads(str(f['client_ids']))
      loaded = {cid: tuple(f[f'a{i}_{j}'] for j in range(len(self._shapes))) for i, cid in enumerate(ids)}
    self.clear()
    for cid, arrays in loaded.items():
      self.set(cid, arrays)

  def _round_path(self, directory: str, round_num: int) -> str:
    return os.path.join(directory, self.what, f'round_{round_num}.npz')

  def checkpoint(self, directory: str, round_num: int, keep_total: int) -> None:
    """Saves the store as of `round_num` under `directory/<what>/`, keeping the latest `keep_total` rounds.

    Call it before saving the server state of the round: a server checkpoint then always has its client state.
    """
    path = self._round_path(directory, round_num)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    self.save(path)
    saved = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(os.path.dirname(path), 'round_*.npz'))
                   if (m := re.fullmatch(r'round_(\d+)\.npz', os.path.basename(p))))
    for _, old in saved[:-keep_total]:
      os.remove(old)

  def restore(self, directory: str, round_num: int) -> None:
    """Loads the store as of `round_num` (round 0: empty). FileNotFoundError naming the file if it was not saved."""
    if round_num == 0:
      self.clear()
      return
    path = self._round_path(directory, round_num)
    if not os.path.exists(path):
      raise FileNotFoundError(f'no {self.what} saved for round {round_num} ({path}); the output directory is '
                              f'incomplete')
    self.load_from(path)
