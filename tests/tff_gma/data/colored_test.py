"""The colouring primitives of feature/mixed skew (`tff_gma.data.colored`)."""

import colorsys

import numpy as np
import pytest

from tff_gma.data import colored


def test_palette_has_distinct_saturated_hues():
  colors = colored.palette(10)
  assert colors.shape == (10, 3) and colors.dtype == np.float32
  np.testing.assert_allclose(colors.max(axis=1), 1.0)
  hues = [colorsys.rgb_to_hsv(*c)[0] for c in colors]
  np.testing.assert_allclose(hues, np.arange(10) / 10, atol=1e-6)
  # Pairwise distinct directions, so a painted image's colour is identifiable.
  unit = colors / np.linalg.norm(colors, axis=1, keepdims=True)
  cosines = unit @ unit.T
  assert np.max(cosines[~np.eye(10, dtype=bool)]) < 0.99


def test_colorize_paints_the_foreground_and_keeps_the_grey_image():
  rng = np.random.default_rng(0)
  grey = rng.random([6, 4, 5, 1]).astype(np.float32)
  colors = colored.palette(4)
  ids = np.array([0, 1, 2, 3, 2, 1])
  out = colored.colorize(grey, ids, colors)
  assert out.shape == (6, 4, 5, 3)
  for i in range(6):
    for ch in range(3):
      np.testing.assert_allclose(out[i, ..., ch], grey[i, ..., 0] * colors[ids[i], ch])
  np.testing.assert_allclose(out.max(axis=-1), grey[..., 0])
  with pytest.raises(ValueError, match='images'):
    colored.colorize(np.zeros([2, 4, 4, 3]), [0, 1], colors)


def test_sample_color_ids_follow_the_mapping_with_the_correlation():
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 10, size=50_000)
  mapping = rng.permutation(10)
  ids = colored.sample_color_ids(labels, mapping, 0.85, rng)
  follows = ids == mapping[labels]
  assert abs(follows.mean() - 0.85) < 0.01
  # Off-mapping colours are uniform over the other nine colours.
  for label in range(3):
    others = ids[(labels == label) & ~follows]
    freq = np.bincount(others, minlength=10) / len(others)
    assert freq[mapping[label]] == 0
    np.testing.assert_allclose(np.delete(freq, mapping[label]), 1 / 9, atol=0.03)


def test_sample_color_ids_per_example_mappings():
  rng = np.random.default_rng(2)
  mappings = np.stack([rng.permutation(5) for _ in range(4)])
  labels = np.arange(5).repeat(4)
  which = np.tile(np.arange(4), 5)
  ids = colored.sample_color_ids(labels, mappings[which], np.ones(len(labels)), rng)
  np.testing.assert_array_equal(ids, mappings[which, labels])
  ids = colored.sample_color_ids(labels, mappings[which], 0.0, rng)
  assert not np.any(ids == mappings[which, labels])


def test_distinct_permutations():
  perms = colored.distinct_permutations(24, 4, np.random.default_rng(0))
  assert len({tuple(p) for p in perms}) == 24
  for p in perms:
    np.testing.assert_array_equal(np.sort(p), np.arange(4))
  with pytest.raises(ValueError, match='distinct'):
    colored.distinct_permutations(7, 3, np.random.default_rng(0))


def test_coloring_create():
  c = colored.Coloring.create(5, 3, 10, np.random.default_rng(0), (0.8, 0.9), 0.95)
  np.testing.assert_allclose(c.train_correlations, [0.9, 0.875, 0.85, 0.825, 0.8])
  assert c.test_correlation == 0.95
  mappings = [tuple(m) for m in np.concatenate([c.train_mappings, c.test_mappings])]
  assert len(set(mappings)) == 8
  assert c.colors.shape == (10, 3)


@pytest.mark.parametrize('kwargs,argument', [
    (dict(num_test_clients=0), 'num_test_clients'),
    (dict(train_correlation=(0.9, 0.8)), 'train_correlation'),
    (dict(train_correlation=(0.5, 1.5)), 'train_correlation'),
    (dict(train_correlation=0.9), 'train_correlation'),
    (dict(test_correlation=-0.1), 'test_correlation'),
])
def test_coloring_validates_arguments(kwargs, argument):
  args = dict(num_train_clients=3, num_test_clients=2, num_classes=10, rng=np.random.default_rng(0))
  args.update(kwargs)
  with pytest.raises(ValueError, match=argument):
    colored.Coloring.create(**args)
