"""Deterministic partitioners: which examples of a labelled pool each client holds.

Each partitioner takes the pool's integer labels and returns a list of index arrays, one per client, that are
disjoint and, together, cover the pool. They use only NumPy and a seed, so they are cheap to test for their
statistics.
"""

from __future__ import annotations

import numpy as np


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
  if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
    raise ValueError(f'num_clients must be a positive integer, got {num_clients!r}')
  if num_clients > len(labels):
    raise ValueError(f'num_clients={num_clients} exceeds the number of examples ({len(labels)})')


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
  """Shuffles the pool and deals it into `num_clients` parts whose sizes differ by at most one."""
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  order = np.random.default_rng(seed).permutation(len(labels))
  return [np.sort(part) for part in np.array_split(order, num_clients)]


def label_skew(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
  """Each client holds examples of exactly `classes_per_client` distinct classes (GMA paper: k=2 on MNIST).

  Classes are dealt round-robin over a seeded permutation of the classes (client c holds classes
  perm[(c*k + j) mod C] for j < k), so every class is held by a client whenever num_clients * k >= C, and each
  class's examples are split evenly among the clients that hold it. This is the "k shards of distinct classes"
  variant of McMahan et al.'s shard split, which guarantees exactly k classes per client.
  """
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  classes = np.unique(labels)
  if not 1 <= classes_per_client <= len(classes):
    raise ValueError(
        f'classes_per_client must lie in [1, {len(classes)}] (the number of classes), got {classes_per_client}')
  rng = np.random.default_rng(seed)
  class_order = rng.permutation(classes)
  holders = {c: [] for c in classes}
  for client in range(num_clients):
    for j in range(classes_per_client):
      holders[class_order[(client * classes_per_client + j) % len(classes)]].append(client)
  parts = [[] for _ in range(num_clients)]
  for c in classes:
    if not holders[c]:
      continue  # Fewer client slots than classes: this class is held by nobody.
    members = rng.permutation(np.flatnonzero(labels == c))
    for client, chunk in zip(holders[c], np.array_split(members, len(holders[c]))):
      parts[client].append(chunk)
  return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
