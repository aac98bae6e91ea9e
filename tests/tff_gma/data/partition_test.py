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


def _holdings(labels, parts, num_classes=NUM_CLASSES):
  """[clients, classes] matrix: how many examples of each class each client holds (plain NumPy)."""
  return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def _check_label_skew(labels, parts, k, num_classes=NUM_CLASSES):
  """The label-skew contract, checked independently of the partitioner from the held labels alone."""
  held = _holdings(labels, parts, num_classes)
  class_sizes = np.bincount(labels, minlength=num_classes)
  np.testing.assert_array_equal((held > 0).sum(axis=1), k)  # Exactly k distinct classes, each non-empty.
  everything = np.concatenate(parts)
  assert len(np.unique(everything)) == len(everything)  # Disjoint.
  for p in parts:
    assert p.dtype == np.int64
    np.testing.assert_array_equal(p, np.sort(p))
  holders = (held > 0).sum(axis=0)
  for c in range(num_classes):
    if holders[c]:  # A held class is wholly dealt out, evenly among its holders.
      assert held[:, c].sum() == class_sizes[c]
      sizes = held[:, c][held[:, c] > 0]
      assert sizes.max() - sizes.min() <= 1
    else:  # An unheld class's examples belong to nobody.
      assert not np.isin(np.flatnonzero(labels == c), everything).any()
  return held


@pytest.mark.parametrize('num_clients,k', [(10, 2), (5, 2), (20, 3), (4, 10), (3, 1), (7, 3), (100, 2)])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_label_skew_holds_exactly_k_classes_and_splits_classes_evenly(num_clients, k, seed):
  labels = _labels()
  parts = partition.label_skew(labels, num_clients, k, seed)
  assert len(parts) == num_clients
  held = _check_label_skew(labels, parts, k)
  if num_clients * k >= NUM_CLASSES:  # Every class held: the parts cover the pool.
    assert (held > 0).any(axis=0).all()
    _assert_disjoint_cover(parts, len(labels))


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_label_skew_draws_class_sets_at_random_not_round_robin(seed):
  # The old round-robin dealing gave 10 clients with k=2 only 5 distinct class pairs, each held by exactly two
  # clients. Random draws (45 possible pairs) almost never collapse like that.
  labels = _labels()
  parts = partition.label_skew(labels, 10, 2, seed)
  held = _check_label_skew(labels, parts, 2)
  pairs = [tuple(np.flatnonzero(row)) for row in held > 0]
  assert len(set(pairs)) > 5
  assert (held > 0).any(axis=0).all()  # Every class held (10 * 2 >= 10).
  assert not all(pairs.count(pair) == 2 for pair in pairs)


def test_label_skew_class_sets_vary_over_seeds():
  # Client 0's class pair is a random draw: over 200 seeds it takes most of the 45 pairs, and every class
  # appears in it.
  labels = _labels()
  pairs = [tuple(np.flatnonzero(_holdings(labels, partition.label_skew(labels, 10, 2, s))[0]))
           for s in range(200)]
  assert len(set(pairs)) >= 35
  assert set(np.ravel(pairs)) == set(range(NUM_CLASSES))


def test_label_skew_is_deterministic_per_seed_and_seeds_differ():
  labels = _labels()
  a, b = partition.label_skew(labels, 10, 2, 7), partition.label_skew(labels, 10, 2, 7)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  for other in (0, 8):
    c = partition.label_skew(labels, 10, 2, other)
    assert any(len(x) != len(y) or np.any(x != y) for x, y in zip(a, c))


def test_label_skew_with_k_equal_to_the_classes_gives_everyone_every_class():
  labels = _labels()
  parts = partition.label_skew(labels, 6, NUM_CLASSES, 0)
  held = _check_label_skew(labels, parts, NUM_CLASSES)
  _assert_disjoint_cover(parts, len(labels))
  assert held.min() >= 100 // 6 and held.max() <= 100 // 6 + 1


@pytest.mark.parametrize('seed', [0, 1, 2, 3])
def test_label_skew_with_fewer_slots_than_classes_leaves_classes_out(seed):
  labels = _labels()
  parts = partition.label_skew(labels, 3, 2, seed)
  held = _check_label_skew(labels, parts, 2)
  holders = (held > 0).sum(axis=0)
  # The 6 slots go to 6 distinct classes, each wholly held by its one client; the other 4 classes are left out.
  assert (holders == 1).sum() == 6 and (holders == 0).sum() == 4
  assert sum(len(p) for p in parts) == 600
  held_sets = {tuple(np.flatnonzero(_holdings(labels, partition.label_skew(labels, 3, 2, s)).any(axis=0)))
               for s in range(10)}
  assert len(held_sets) > 1  # Which classes are left out is random.


def test_label_skew_gives_a_hundred_digits_clients_two_classes_each():
  from tff_gma.data import digits
  labels = digits.load_split().y_train.astype(np.int64)
  for seed in range(3):
    parts = partition.label_skew(labels, 100, 2, seed)
    held = _check_label_skew(labels, parts, 2)
    assert min(len(p) for p in parts) >= 2
    assert (held > 0).any(axis=0).all()
    _assert_disjoint_cover(parts, len(labels))


def test_label_skew_moves_holders_off_a_class_with_too_few_examples():
  # Class 0 has 3 examples; with 40 clients drawing 2 of 10 classes it would get about 8 holders, most of them
  # with nothing of it. The capacity repair moves the extra holders to classes with examples to spare.
  labels = np.concatenate([np.zeros(3, np.int32), np.repeat(np.arange(1, NUM_CLASSES), 50).astype(np.int32)])
  for seed in range(5):
    parts = partition.label_skew(labels, 40, 2, seed)
    held = _check_label_skew(labels, parts, 2)
    assert 1 <= (held[:, 0] > 0).sum() <= 3
    _assert_disjoint_cover(parts, len(labels))


def test_label_skew_refuses_when_a_class_cannot_reach_its_holders():
  labels = np.array([0, 0, 1, 1, 1])  # Every client must hold both classes, and class 0 has 2 examples for 3.
  with pytest.raises(ValueError, match='num_clients'):
    partition.label_skew(labels, 3, 2, 0)


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
