"""Statistics of the partitioners in `tff_gma.data.partition`, against NumPy references written here."""

import numpy as np
import pytest

from tff_gma.data import partition

NUM_CLASSES = 10


def _labels(per_class=100, num_classes=NUM_CLASSES, seed=0):
  return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class)).astype(np.int32)


def _assert_disjoint_cover(parts, n):
  everything = np.concatenate(parts)
  np.testing.assert_array_equal(np.sort(everything), np.arange(n))  # Disjoint (no repeats) and covering.
  for p in parts:
    assert p.dtype == np.int64
    np.testing.assert_array_equal(p, np.sort(p))


def _label_entropy(labels, part):
  p = np.bincount(labels[part], minlength=NUM_CLASSES) / len(part)
  p = p[p > 0]
  return float(-(p * np.log(p)).sum())


ALL = {
    'iid': lambda y, n, s: partition.iid(y, n, s),
    'label_skew': lambda y, n, s: partition.label_skew(y, n, 2, s),
    'dirichlet': lambda y, n, s: partition.dirichlet(y, n, 0.5, s),
    'quantity_skew': lambda y, n, s: partition.quantity_skew(y, n, 0.5, s),
}


@pytest.mark.parametrize('name', sorted(ALL))
def test_disjoint_cover_nonempty_and_deterministic(name):
  labels = _labels()
  parts = ALL[name](labels, 10, 3)
  assert len(parts) == 10
  _assert_disjoint_cover(parts, len(labels))
  assert min(len(p) for p in parts) >= 1
  again = ALL[name](labels, 10, 3)
  for a, b in zip(parts, again):
    np.testing.assert_array_equal(a, b)
  other = ALL[name](labels, 10, 4)
  assert any(len(a) != len(b) or np.any(a != b) for a, b in zip(parts, other))


@pytest.mark.parametrize('name', sorted(ALL))
def test_split_dispatches_to_the_named_partitioner(name):
  labels = _labels()
  for a, b in zip(partition.split(labels, name, 7, 1), ALL[name](labels, 7, 1)):
    np.testing.assert_array_equal(a, b)


def test_iid_sizes_differ_by_at_most_one():
  sizes = [len(p) for p in partition.iid(_labels(), 7, 0)]
  assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize('num_clients,k', [(10, 2), (5, 2), (20, 3), (4, 10), (3, 1)])
def test_label_skew_holds_exactly_k_classes_and_splits_classes_evenly(num_clients, k):
  labels = _labels()
  parts = partition.label_skew(labels, num_clients, k, 0)
  if num_clients * k >= NUM_CLASSES:
    _assert_disjoint_cover(parts, len(labels))
  holders = {c: [] for c in range(NUM_CLASSES)}
  for client, p in enumerate(parts):
    classes = np.unique(labels[p])
    assert len(classes) == k
    for c in classes:
      holders[c].append(int(np.sum(labels[p] == c)))
  for c, counts in holders.items():
    if counts:  # The clients holding a class share its examples evenly.
      assert sum(counts) == 100 and max(counts) - min(counts) <= 1


def test_label_skew_with_fewer_slots_than_classes_leaves_classes_out():
  labels = _labels()
  parts = partition.label_skew(labels, 3, 2, 0)
  held = np.unique(labels[np.concatenate(parts)])
  assert len(held) == 6 and sum(len(p) for p in parts) == 600


def test_dirichlet_smaller_alpha_means_more_label_skew():
  labels = _labels(per_class=200)
  iid_entropy = np.mean([_label_entropy(labels, p) for p in partition.iid(labels, 20, 0)])
  entropies = {}
  for alpha in (0.05, 0.5, 5.0, 1000.0):
    entropies[alpha] = np.mean([
        np.mean([_label_entropy(labels, p) for p in partition.dirichlet(labels, 20, alpha, seed)])
        for seed in range(5)])
  assert entropies[0.05] < entropies[0.5] < entropies[5.0] < entropies[1000.0]
  assert entropies[0.05] < 0.6 * iid_entropy
  assert abs(entropies[1000.0] - iid_entropy) < 0.05


@pytest.mark.parametrize('alpha', [0.1, 1.0])
def test_dirichlet_class_shares_have_the_dirichlet_variance(alpha):
  # Class c's share held by client i is Dir(alpha 1_n)_i: mean 1/n, variance (1/n)(1 - 1/n) / (n alpha + 1).
  n, per_class = 10, 2000
  labels = _labels(per_class=per_class)
  shares = []
  for seed in range(40):
    parts = partition.dirichlet(labels, n, alpha, seed)
    shares.append([[np.sum(labels[p] == c) / per_class for p in parts] for c in range(NUM_CLASSES)])
  shares = np.asarray(shares)
  np.testing.assert_allclose(shares.sum(axis=-1), 1.0)
  expected = (1 / n) * (1 - 1 / n) / (n * alpha + 1)
  assert abs(shares.var() / expected - 1) < 0.15


def test_dirichlet_never_leaves_a_client_empty():
  labels = _labels(per_class=10)
  for seed in range(10):
    parts = partition.dirichlet(labels, 60, 0.01, seed)
    _assert_disjoint_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 1


def test_quantity_skew_size_variance_matches_dirichlet_and_exceeds_iid():
  # Sizes are 1 + Multinomial(N - n, q), q ~ Dir(beta 1_n): Var = (N-n)^2 Var(q_i) + (N-n) E[q_i (1 - q_i)].
  labels = _labels()
  n, beta, m = 10, 0.5, len(labels) - 10
  var_q = (1 / n) * (1 - 1 / n) / (n * beta + 1)
  expected = m**2 * var_q + m * (1 / n - (var_q + 1 / n**2))
  sizes = np.array([[len(p) for p in partition.quantity_skew(labels, n, beta, seed)] for seed in range(300)])
  assert sizes.min() >= 1
  np.testing.assert_array_equal(sizes.sum(axis=1), len(labels))
  assert abs(np.mean(sizes.var(axis=1, ddof=1)) / expected - 1) < 0.15
  iid_var = np.var([len(p) for p in partition.iid(labels, n, 0)])
  assert iid_var < 1 and np.mean(sizes.var(axis=1)) > 1000 * max(iid_var, 0.1)


def test_quantity_skew_labels_are_iid():
  # Within a client, labels are a uniform sample of the pool: pooled over seeds, the label frequencies of the
  # largest client match the pool's.
  labels = _labels()
  counts = np.zeros(NUM_CLASSES)
  for seed in range(50):
    parts = partition.quantity_skew(labels, 10, 0.5, seed)
    counts += np.bincount(labels[max(parts, key=len)], minlength=NUM_CLASSES)
  np.testing.assert_allclose(counts / counts.sum(), 0.1, atol=0.01)


def test_quantity_skew_larger_beta_means_more_even_sizes():
  labels = _labels()
  spread = {beta: np.mean([np.std([len(p) for p in partition.quantity_skew(labels, 10, beta, s)])
                           for s in range(20)]) for beta in (0.1, 0.5, 100.0)}
  assert spread[0.1] > spread[0.5] > spread[100.0]


@pytest.mark.parametrize('call,argument', [
    (lambda y: partition.iid(y, 0, 0), 'num_clients'),
    (lambda y: partition.iid(y, 1001, 0), 'num_clients'),
    (lambda y: partition.iid(y, 2.5, 0), 'num_clients'),
    (lambda y: partition.label_skew(y, 5, 0, 0), 'classes_per_client'),
    (lambda y: partition.label_skew(y, 5, 11, 0), 'classes_per_client'),
    (lambda y: partition.dirichlet(y, 5, 0.0, 0), 'alpha'),
    (lambda y: partition.dirichlet(y, 5, -1.0, 0), 'alpha'),
    (lambda y: partition.dirichlet(y, 5, float('nan'), 0), 'alpha'),
    (lambda y: partition.dirichlet(y, 5, float('inf'), 0), 'alpha'),
    (lambda y: partition.quantity_skew(y, 5, 0.0, 0), 'beta'),
    (lambda y: partition.quantity_skew(y, 0, 0.5, 0), 'num_clients'),
    (lambda y: partition.split(y, 'by_writer', 5, 0), 'partition'),
])
def test_invalid_arguments_raise_value_error_naming_them(call, argument):
  with pytest.raises(ValueError, match=argument):
    call(_labels())
