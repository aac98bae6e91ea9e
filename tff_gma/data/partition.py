"""Deterministic partitioners: which examples of a labelled pool each client holds.

Each partitioner takes the pool's integer labels and returns a list of index arrays (sorted, int64), one per
client, that are disjoint and, together, cover the pool (`label_skew` with fewer client slots than classes is the
one exception: the classes nobody holds are left out). They use only NumPy and a seed, so they are cheap to test
for their statistics, and the same seed always gives the same partition.
"""

from __future__ import annotations

import math

import numpy as np

PARTITIONS = ('iid', 'label_skew', 'dirichlet', 'quantity_skew')
DEFAULT_CLASSES_PER_CLIENT = 2  # GMA paper, Table 1: k = 2 classes per client on (F)MNIST and CIFAR-10.
DEFAULT_ALPHA = 0.5  # Dirichlet label skew; GMA paper App. D contrasts alpha = 0.1 (skewed) with 100 (near iid).
DEFAULT_BETA = 0.5  # Quantity skew; GMA paper Sec. 5.4 (after Li et al., 2021a).


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
  if (isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1):
    raise ValueError(f'num_clients must be a positive integer, got {num_clients!r}')
  if num_clients > len(labels):
    raise ValueError(f'num_clients={num_clients} exceeds the number of examples ({len(labels)})')


def _check_concentration(name: str, value: float) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
      math.isfinite(value) and value > 0):
    raise ValueError(f'{name} must be a positive finite number, got {value!r}')


def _finish(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
  return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros([0], np.int64) for p in parts]


def _fill_empty_clients(parts: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
  """Gives each empty client one random example of the currently largest client.

  Dirichlet draws with small concentration leave clients empty; moving single examples keeps the draw's shape
  (a client that drew nothing gets one example) where resampling until no client is empty might never end.
  """
  parts = [np.asarray(p, np.int64) for p in parts]
  for client in range(len(parts)):
    if len(parts[client]):
      continue
    donor = int(np.argmax([len(p) for p in parts]))
    taken = rng.integers(len(parts[donor]))
    parts[client] = parts[donor][taken:taken + 1]
    parts[donor] = np.delete(parts[donor], taken)
  return parts


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
  """Shuffles the pool and deals it into `num_clients` parts whose sizes differ by at most one."""
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  order = np.random.default_rng(seed).permutation(len(labels))
  return [np.sort(part).astype(np.int64) for part in np.array_split(order, num_clients)]


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
  if (isinstance(classes_per_client, bool) or not isinstance(classes_per_client, (int, np.integer))
      or not 1 <= classes_per_client <= len(classes)):
    raise ValueError(
        f'classes_per_client must be an integer in [1, {len(classes)}] (the number of classes), '
        f'got {classes_per_client!r}')
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
    if len(members) < len(holders[c]):
      raise ValueError(
          f'class {c} has {len(members)} examples for {len(holders[c])} clients; use fewer num_clients or '
          'more classes_per_client')
    for client, chunk in zip(holders[c], np.array_split(members, len(holders[c]))):
      parts[client].append(chunk)
  return _finish(parts)


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
  """Dirichlet label skew (Hsu et al., 2019; Li et al., 2021a): class c's examples go to the clients in
  proportions p_c ~ Dir(alpha * 1), drawn independently per class.

  Small `alpha` concentrates each class on few clients (strong skew); as alpha grows every client's label
  distribution approaches the pool's. A client left empty by the draw gets one example from the largest client,
  so every client is non-empty.
  """
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  _check_concentration('alpha', alpha)
  rng = np.random.default_rng(seed)
  parts = [[] for _ in range(num_clients)]
  for c in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == c))
    proportions = rng.dirichlet(np.full(num_clients, float(alpha)))
    cuts = np.floor(np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
    for client, chunk in enumerate(np.split(members, cuts)):
      parts[client].append(chunk)
  return [np.sort(p) for p in _fill_empty_clients(_finish(parts), rng)]


def quantity_skew(labels: np.ndarray, num_clients: int, beta: float, seed: int) -> list[np.ndarray]:
  """Quantity skew (Li et al., 2021a; GMA paper Sec. 5.4, beta = 0.5): client sizes follow Dir(beta * 1).

  Client i gets 1 + m_i examples with (m_1..m_n) ~ Multinomial(N - n, q), q ~ Dir(beta * 1), so sizes are
  proportional to the Dirichlet draw in expectation and no client is empty. Which examples a client holds is
  uniformly random, independent of the labels (the label distribution of every client is the pool's, in
  expectation).
  """
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  _check_concentration('beta', beta)
  rng = np.random.default_rng(seed)
  proportions = rng.dirichlet(np.full(num_clients, float(beta)))
  sizes = 1 + rng.multinomial(len(labels) - num_clients, proportions)
  order = rng.permutation(len(labels))
  return [np.sort(part).astype(np.int64) for part in np.split(order, np.cumsum(sizes)[:-1])]


def split(
    labels: np.ndarray, partition: str, num_clients: int, seed: int, *,
    classes_per_client: int = DEFAULT_CLASSES_PER_CLIENT, alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
) -> list[np.ndarray]:
  """Dispatches to the partitioner named `partition` (one of `PARTITIONS`) with its own hyperparameter."""
  if partition == 'iid':
    return iid(labels, num_clients, seed)
  if partition == 'label_skew':
    return label_skew(labels, num_clients, classes_per_client, seed)
  if partition == 'dirichlet':
    return dirichlet(labels, num_clients, alpha, seed)
  if partition == 'quantity_skew':
    return quantity_skew(labels, num_clients, beta, seed)
  raise ValueError(f'unknown partition {partition!r}; expected one of {PARTITIONS}')
