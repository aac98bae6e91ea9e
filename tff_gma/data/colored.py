"""Spurious colour-label correlations for feature skew, after FedCMNIST (Francis et al., 2021).

Grey digits are painted with a colour that predicts the label with probability p under a client's own class ->
colour permutation (`Coloring.create`) or, as colored MNIST, one permutation shared by the train clients
(`Coloring.create_shared`); held-out test clients get permutations the train clients never saw, so a model that
learnt colours fails on them.
"""

from __future__ import annotations

import colorsys
import dataclasses
import math

import numpy as np

from tff_gma import checks

DEFAULT_TRAIN_CORRELATION = (0.8, 0.9)
DEFAULT_TEST_CORRELATION = 0.9


def palette(num_colors: int) -> np.ndarray:
  """`num_colors` RGB colours in [0, 1] with evenly spaced hues, full saturation and value; float32 [n, 3]."""
  if num_colors < 2:
    raise ValueError(f'num_colors must be at least 2, got {num_colors}')
  return np.array([colorsys.hsv_to_rgb(i / num_colors, 1.0, 1.0) for i in range(num_colors)], np.float32)


def colorize(images: np.ndarray, color_ids: np.ndarray, colors: np.ndarray) -> np.ndarray:
  """Paints grey images [N, H, W, 1] (0 = background) in `colors[color_ids]`: float32 [N, H, W, 3]."""
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[-1] != 1:
    raise ValueError(f'images must have shape [N, H, W, 1], got {images.shape}')
  return images * colors[np.asarray(color_ids)][:, np.newaxis, np.newaxis, :]


def distinct_permutations(num: int, size: int, rng: np.random.Generator) -> np.ndarray:
  """`num` pairwise distinct random permutations of range(size), int64 [num, size]."""
  if num > math.factorial(size):
    raise ValueError(f'only {math.factorial(size)} distinct colourings of {size} classes exist, {num} requested')
  seen, out = set(), []
  while len(out) < num:
    perm = rng.permutation(size)
    if tuple(perm) not in seen:
      seen.add(tuple(perm))
      out.append(perm)
  return np.stack(out).astype(np.int64)


def sample_color_ids(
    labels: np.ndarray, mapping: np.ndarray, correlation, rng: np.random.Generator) -> np.ndarray:
  """Colour ids: `mapping[label]` with probability `correlation`, else a uniformly random other colour.

  `mapping` is one class -> colour permutation [C], or one per example [N, C]; `correlation` a scalar or [N].
  """
  labels = np.asarray(labels, np.int64)
  mapping = np.asarray(mapping, np.int64)
  num_colors = mapping.shape[-1]
  correlated = mapping[labels] if mapping.ndim == 1 else mapping[np.arange(len(labels)), labels]
  other = (correlated + rng.integers(1, num_colors, size=len(labels))) % num_colors
  return np.where(rng.random(len(labels)) < correlation, correlated, other)


def _check_probability(name: str, value: float) -> None:
  if not (isinstance(value, (int, float, np.number)) and 0.0 <= value <= 1.0):
    raise ValueError(f'{name} must lie in [0, 1], got {value!r}')


def distinct_derangements(num: int, reference: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """`num` pairwise distinct random permutations d of range(len(reference)) with d[i] != reference[i] for every i
  (no class keeps its reference colour), int64 [num, size]; drawn by rejection (about 1 in e draws is one)."""
  reference = np.asarray(reference, np.int64)
  size = len(reference)
  # The number of derangements of `size` items: round(size! / e) for size >= 1.
  count = round(math.factorial(size) / math.e) if size > 0 else 1
  if size < 2 or num > count:
    raise ValueError(f'only {count} derangements of {size} classes exist, {num} requested')
  seen, out = set(), []
  while len(out) < num:
    perm = rng.permutation(size)
    if np.all(perm != reference) and tuple(perm) not in seen:
      seen.add(tuple(perm))
      out.append(perm)
  return np.stack(out).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Coloring:
  """The colourings of one federation: one per train client and one per held-out test client."""
  colors: np.ndarray  # [num_classes, 3]
  train_mappings: np.ndarray  # [num_train_clients, num_classes]: class -> colour id.
  train_correlations: np.ndarray  # [num_train_clients]
  test_mappings: np.ndarray  # [num_test_clients, num_classes]
  test_correlation: float

  @classmethod
  def create(
      cls, num_train_clients: int, num_test_clients: int, num_classes: int, rng: np.random.Generator,
      train_correlation: tuple[float, float] = DEFAULT_TRAIN_CORRELATION,
      test_correlation: float = DEFAULT_TEST_CORRELATION,
  ) -> Coloring:
    """Draws distinct permutations for all clients; train correlations evenly spaced over the given range."""
    return cls._build(num_train_clients, num_test_clients, num_classes, rng, train_correlation, test_correlation,
                      shared=False)

  @classmethod
  def create_shared(
      cls, num_train_clients: int, num_test_clients: int, num_classes: int, rng: np.random.Generator,
      train_correlation: tuple[float, float] = DEFAULT_TRAIN_CORRELATION,
      test_correlation: float = DEFAULT_TEST_CORRELATION,
  ) -> Coloring:
    """Colored MNIST's construction: one permutation shared by every train client (strengths evenly spaced over
    the given range), and pairwise distinct derangements of it for the held-out test clients."""
    return cls._build(num_train_clients, num_test_clients, num_classes, rng, train_correlation, test_correlation,
                      shared=True)

  @classmethod
  def _build(cls, num_train_clients: int, num_test_clients: int, num_classes: int, rng: np.random.Generator,
             train_correlation: tuple[float, float], test_correlation: float, shared: bool) -> Coloring:
    """`create`'s and `create_shared`'s common checks and construction."""
    checks.check_positive_int(num_test_clients, 'num_test_clients')
    try:
      low, high = (float(v) for v in train_correlation)
    except (TypeError, ValueError):
      raise ValueError(f'train_correlation must be a pair (low, high), got {train_correlation!r}') from None
    _check_probability('train_correlation', low)
    _check_probability('train_correlation', high)
    if low > high:
      raise ValueError(f'train_correlation must be (low, high) with low <= high, got {train_correlation!r}')
    _check_probability('test_correlation', test_correlation)
    if shared:
      checks.check_positive_int(num_train_clients, 'num_train_clients')
      train = rng.permutation(num_classes).astype(np.int64)
      mappings = np.concatenate([np.tile(train, (num_train_clients, 1)),
                                 distinct_derangements(num_test_clients, train, rng)])
    else:
      mappings = distinct_permutations(num_train_clients + num_test_clients, num_classes, rng)
    return cls(
        colors=palette(num_classes),
        train_mappings=mappings[:num_train_clients],
        train_correlations=np.linspace(high, low, num_train_clients),
        test_mappings=mappings[num_train_clients:],
        test_correlation=float(test_correlation),
    )
