"""Deterministic partitioners: which examples of a labelled pool each client holds.

Each partitioner takes the pool's integer labels and returns a list of index arrays (sorted, int64), one per
client, that are disjoint and, together, cover the pool (`label_skew` with fewer client slots than classes is the
one exception: the classes nobody holds are left out). They use only NumPy and a seed, so they are cheap to test
for their statistics, and the same seed always gives the same partition.
"""

from __future__ import annotations

import numpy as np

from tff_gma import checks

PARTITIONS = ('iid', 'label_skew', 'dirichlet', 'quantity_skew')
DEFAULT_CLASSES_PER_CLIENT = 2  # GMA paper, Table 1: k = 2 classes per client on (F)MNIST and CIFAR-10.
DEFAULT_ALPHA = 0.5  # Dirichlet label skew; GMA paper App. D contrasts alpha = 0.1 (skewed) with 100 (near iid).
DEFAULT_BETA = 0.5  # Quantity skew; GMA paper Sec. 5.4 (after Li et al., 2021a).


def _check_clients(labels: np.ndarray, num_clients: int) -> None:
  checks.check_positive_int(num_clients, 'num_clients')
  if num_clients > len(labels):
    raise ValueError(f'num_clients={num_clients} exceeds the number of examples ({len(labels)})')


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
  """Label skew "#C = k" (Li et al., 2021a; GMA paper Table 1, k = 2 on (F)MNIST): each client holds examples of
  exactly `classes_per_client` (k) distinct classes, drawn at random.

  With C the number of distinct labels and a NumPy generator seeded with `seed`:
  1. Draw: each client, in order, draws k distinct classes uniformly at random (`rng.choice(C, k, replace=False)`).
  2. Coverage repair: for each class nobody drew, in increasing label order, and while some class has two or
     more holders: take the class with the most holders (ties: the smallest label), pick one of its holders
     uniformly at random, and replace that client's copy of it by the unheld class. The client still holds k
     distinct classes (it did not hold the unheld one), the donor class keeps at least one holder, and each step
     gives one more class a holder, so this ends after at most C steps. Hence every class is held whenever
     num_clients * k >= C; when num_clients * k < C, the num_clients * k slots end up on distinct classes (no class
     is shared) and the other C - num_clients * k classes, whichever the draw left out, are held by nobody: their
     examples belong to no client.
  3. Capacity repair (only when a class has fewer examples than holders, which would leave a holder without any
     example of it): for each such class, in increasing label order, its holders in a random order are moved one
     at a time, while the class still has too many holders, to the class with the most spare examples (examples
     minus holders; ties: the smallest label) that the client does not hold yet; a holder with no such class
     stays. A class loses holders only while it has more holders than examples, so coverage is kept. If a class
     still has more holders than examples, a ValueError naming num_clients and classes_per_client is raised.
  4. Split: each held class's examples are shuffled and cut into as many parts as it has holders, with sizes
     differing by at most one (`np.array_split`), the parts going to its holders in a random order.
  So the parts are disjoint and cover every held class, and every client has at least one example of each of its
  k classes.
  """
  labels = np.asarray(labels)
  _check_clients(labels, num_clients)
  classes = np.unique(labels)
  num_classes = len(classes)
  k = classes_per_client
  if (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= num_classes):
    raise ValueError(
        f'classes_per_client must be an integer in [1, {num_classes}] (the number of classes), got {k!r}')
  rng = np.random.default_rng(seed)
  # held[client] lists the class indices (into `classes`) the client holds; holders[c] counts the clients of c.
  held = [list(rng.choice(num_classes, size=int(k), replace=False)) for _ in range(num_clients)]
  holders = np.zeros(num_classes, np.int64)
  for client_classes in held:
    holders[client_classes] += 1
  _repair_coverage(held, holders, rng)
  counts = np.array([np.sum(labels == c) for c in classes])
  _repair_capacity(held, holders, counts, classes, rng)
  return _split_held_classes(labels, classes, held, rng)


def _repair_coverage(held: list[list[int]], holders: np.ndarray, rng: np.random.Generator) -> None:
  """Step 2 of `label_skew`, in place: moves a slot of the most held class to each class nobody holds."""
  for unheld in np.flatnonzero(holders == 0):
    if holders.max() < 2:
      break  # Fewer slots than classes: every slot is on its own class; the rest stay unheld.
    donor = int(np.argmax(holders))
    candidates = [client for client, cs in enumerate(held) if donor in cs]
    client = candidates[rng.integers(len(candidates))]
    held[client][held[client].index(donor)] = unheld
    holders[donor] -= 1
    holders[unheld] += 1


def _repair_capacity(held: list[list[int]], holders: np.ndarray, counts: np.ndarray, classes: np.ndarray,
                     rng: np.random.Generator) -> None:
  """Step 3 of `label_skew`, in place: moves holders off each class with fewer examples (`counts`) than holders.

  Raises:
    ValueError: if a class still has more holders than examples.
  """
  for c in np.flatnonzero(holders > counts):
    candidates = [client for client, cs in enumerate(held) if c in cs]
    for client in rng.permutation(candidates):
      if holders[c] <= counts[c]:
        break
      spare = counts - holders
      spare[held[client]] = 0
      target = int(np.argmax(spare))
      if spare[target] <= 0:
        continue
      held[client][held[client].index(c)] = target
      holders[c] -= 1
      holders[target] += 1
    if holders[c] > counts[c]:
      raise ValueError(
          f'class {classes[c]} has {counts[c]} examples for {holders[c]} clients; use fewer num_clients or '
          'fewer classes_per_client')


def _split_held_classes(labels: np.ndarray, classes: np.ndarray, held: list[list[int]],
                        rng: np.random.Generator) -> list[np.ndarray]:
  """Step 4 of `label_skew`: each held class's shuffled examples cut evenly among its holders, in a random order."""
  parts = [[] for _ in range(len(held))]
  for c in range(len(classes)):
    owners = [client for client, cs in enumerate(held) if c in cs]
    if not owners:
      continue
    members = rng.permutation(np.flatnonzero(labels == classes[c]))
    for client, chunk in zip(rng.permutation(owners), np.array_split(members, len(owners))):
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
  checks.check_positive_finite(alpha, 'alpha')
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
  checks.check_positive_finite(beta, 'beta')
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
