"""The literature's update attacks (training.engine.attacks), each against its paper's formula written out here.

Plain pytest and NumPy, no TensorFlow Federated: the references below are computed from the papers' definitions
(SciPy's normal quantile, explicit loops, an SVD), not from the module's helpers.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from scipy import stats

from training.engine import attacks


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these checks are NumPy only (no TFF worker here)."""
  yield None


def _updates(seed, n=7, d=13, spread=1.0):
  rng = np.random.default_rng(seed)
  return rng.normal(0.5, spread, size=(n, d)) * rng.uniform(0.1, 3.0, size=d)


def _sample_std(rows):
  """sqrt(sum_i (x_ij - mu_j)^2 / (n - 1)) per coordinate, by hand."""
  n = len(rows)
  mu = sum(rows) / n
  return np.sqrt(sum((r - mu) ** 2 for r in rows) / (n - 1))


# --------------------------------------------------------------------------------------------------------- ALIE


def test_alie_z_max_for_twenty_participants_four_corrupted_by_hand():
  # s = floor(20 / 2 + 1) - 4 = 7 supporters; z_max = Phi^-1((20 - 7) / 20) = Phi^-1(0.65).
  assert attacks.alie_z_max(20, 4) == pytest.approx(0.38532046640756773, abs=1e-12)


@pytest.mark.parametrize('n, f', [(10, 2), (7, 3), (5, 1), (50, 12), (100, 20), (4, 1), (3, 1)])
def test_alie_z_max_is_the_papers_normal_quantile(n, f):
  s = math.floor(n / 2 + 1) - f
  assert attacks.alie_z_max(n, f) == pytest.approx(stats.norm.ppf((n - s) / n), abs=1e-9)


def test_alie_z_max_with_a_corrupted_majority_takes_one_supporter():
  assert attacks.alie_z_max(10, 6) == pytest.approx(stats.norm.ppf(9 / 10), abs=1e-9)  # s = 0 -> 1.
  assert attacks.alie_z_max(1, 1) == 0.0
  with pytest.raises(ValueError, match='alie'):
    attacks.alie_z_max(4, 5)


@pytest.mark.parametrize('z', [None, 1.5])
def test_alie_sends_mean_minus_z_sigma(z):
  rows = list(_updates(0, n=9))
  expected_z = stats.norm.ppf((9 - (math.floor(9 / 2 + 1) - 2)) / 9) if z is None else z
  expected = sum(rows) / 9 - expected_z * _sample_std(rows)
  np.testing.assert_allclose(attacks.alie(np.array(rows), 2, z), expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 30), st.data())
def test_alie_coordinates_sit_z_sample_deviations_below_the_mean(n, data):
  f = data.draw(st.integers(1, n))
  rows = _updates(n, n=n, d=5)
  sent = attacks.alie(rows, f)
  z = attacks.alie_z_max(n, f)
  assert z >= 0
  np.testing.assert_allclose((rows.mean(axis=0) - sent), z * _sample_std(list(rows)), rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------- IPM


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
  rows = _updates(1)
  mean = np.array([sum(r[j] for r in rows) / len(rows) for j in range(rows.shape[1])])
  np.testing.assert_allclose(attacks.ipm(rows), -0.1 * mean, rtol=1e-12)
  np.testing.assert_allclose(attacks.ipm(rows, 100.0), -100.0 * mean, rtol=1e-12)
  assert attacks.DEFAULT_IPM_EPSILON == 0.1


# ------------------------------------------------------------------------------------- sign flip, zero update


def test_sign_flip_negates_the_attackers_own_update_and_zero_update_is_zero():
  rows = _updates(2)
  np.testing.assert_array_equal(attacks.sign_flip(rows[3]), -rows[3])
  np.testing.assert_array_equal(attacks.zero_update(13), np.zeros(13))


# -------------------------------------------------------------------------------------------------------- mimic


def _mimic_reference(rows, candidates):
  centred = rows - rows.mean(axis=0)
  top = np.linalg.svd(centred, full_matrices=False)[2][0]  # The covariance's top eigenvector.
  projections = np.abs(centred @ top)
  allowed = [i for i, c in enumerate(candidates) if c]
  return max(allowed, key=lambda i: projections[i])


@pytest.mark.parametrize('seed', range(5))
def test_mimic_copies_the_honest_client_farthest_along_the_top_principal_direction(seed):
  rows = _updates(seed, n=8, d=20)
  candidates = [i % 3 != 0 for i in range(8)]  # Clients 0, 3 and 6 are corrupted.
  target = attacks.mimic_target(rows, candidates)
  assert candidates[target]
  assert target == _mimic_reference(rows, candidates)
  np.testing.assert_array_equal(attacks.mimic(rows, candidates), rows[target])


def test_mimic_picks_the_outlier_of_the_spread_direction_and_skips_corrupted_clients():
  rows = np.zeros((5, 3))
  rows[:, 0] = [0.1, -0.2, 0.0, 5.0, 0.3]  # Client 3 spreads the rows along axis 0 most.
  rows[:, 1] = [0.01, 0.02, -0.01, 0.0, 0.0]
  assert attacks.mimic_target(rows, [True] * 5) == 3
  assert attacks.mimic_target(rows, [True, True, True, False, True]) == _mimic_reference(
      rows, [True, True, True, False, True])
  assert attacks.mimic_target(np.ones((3, 4)), [False, True, True]) == 1  # No spread: the first candidate.
  assert attacks.mimic_target(rows, [False] * 5) == 3  # Every participant corrupted: any row may be copied.


# ---------------------------------------------------------------------------------------------------- large norm


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.floats(1.0, 1e4))
def test_large_norm_has_scale_times_the_median_norm_against_the_mean(n, scale):
  rows = _updates(n, n=n, d=6)
  sent = attacks.large_norm(rows, scale)
  median_norm = sorted(math.sqrt(sum(x * x for x in r)) for r in rows)
  median_norm = (median_norm[(n - 1) // 2] + median_norm[n // 2]) / 2
  assert np.linalg.norm(sent) == pytest.approx(scale * median_norm, rel=1e-9)
  mean = rows.mean(axis=0)
  assert sent @ mean / (np.linalg.norm(sent) * np.linalg.norm(mean)) == pytest.approx(-1.0, abs=1e-9)


def test_large_norm_of_a_zero_mean_is_along_minus_ones():
  rows = np.array([[1.0, -2.0], [-1.0, 2.0]])
  np.testing.assert_allclose(attacks.large_norm(rows, 10.0), -10 * math.sqrt(5) * np.ones(2) / math.sqrt(2))


# ----------------------------------------------------------------------------------------------- min-max, min-sum


def _max_distance_to(m, rows):
  return max(np.linalg.norm(m - w) for w in rows)


def _max_pairwise(rows):
  return max(np.linalg.norm(a - b) for a in rows for b in rows)


def _sum_squared_to(m, rows):
  return sum(np.linalg.norm(m - w) ** 2 for w in rows)


def _max_sum_squared(rows):
  return max(sum(np.linalg.norm(a - b) ** 2 for b in rows) for a in rows)


def _reference_perturbation(rows, kind):
  mean = rows.mean(axis=0)
  return {'unit_vec': -mean / np.linalg.norm(mean), 'std': -_sample_std(list(rows)), 'sign': -np.sign(mean)}[kind]


_MARGIN = 1e-4  # Ten times the search's threshold tau: the search ends within tau of the largest admissible gamma.


@pytest.mark.parametrize('kind', attacks.PERTURBATIONS)
@pytest.mark.parametrize('seed', range(3))
def test_min_max_gamma_is_the_largest_keeping_the_attack_within_the_honest_diameter(kind, seed):
  rows = _updates(seed, n=6, d=9)
  p = _reference_perturbation(rows, kind)
  gamma = attacks.min_max_gamma(rows, p)
  within = lambda g: _max_distance_to(rows.mean(axis=0) + g * p, rows) <= _max_pairwise(rows)
  assert 0 < gamma < 2 * attacks.DEFAULT_MINMAX_GAMMA_INIT
  assert within(gamma) and not within(gamma + _MARGIN) and not within(2 * gamma)
  np.testing.assert_allclose(attacks.min_max(rows, kind), rows.mean(axis=0) + gamma * p, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('kind', attacks.PERTURBATIONS)
@pytest.mark.parametrize('seed', range(3))
def test_min_sum_gamma_is_the_largest_keeping_the_sum_of_squares_below_the_honest_maximum(kind, seed):
  rows = _updates(seed + 10, n=6, d=9)
  p = _reference_perturbation(rows, kind)
  gamma = attacks.min_sum_gamma(rows, p)
  within = lambda g: _sum_squared_to(rows.mean(axis=0) + g * p, rows) <= _max_sum_squared(rows)
  assert 0 < gamma < 2 * attacks.DEFAULT_MINMAX_GAMMA_INIT
  assert within(gamma) and not within(gamma + _MARGIN) and not within(2 * gamma)
  np.testing.assert_allclose(attacks.min_sum(rows, kind), rows.mean(axis=0) + gamma * p, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 10), st.integers(1, 8), st.integers(0, 2**31), st.sampled_from(attacks.PERTURBATIONS))
def test_min_max_and_min_sum_conditions_hold_for_any_rows(n, d, seed, kind):
  rows = _updates(seed, n=n, d=d)
  p = _reference_perturbation(rows, kind)
  mean = rows.mean(axis=0)
  for gamma_of, within in (
      (attacks.min_max_gamma, lambda g: _max_distance_to(mean + g * p, rows) <= _max_pairwise(rows) * (1 + 1e-12)),
      (attacks.min_sum_gamma, lambda g: _sum_squared_to(mean + g * p, rows) <= _max_sum_squared(rows) * (1 + 1e-12))):
    gamma = gamma_of(rows, p)
    assert 0 <= gamma < 2 * attacks.DEFAULT_MINMAX_GAMMA_INIT
    assert within(gamma)
    if gamma < 2 * attacks.DEFAULT_MINMAX_GAMMA_INIT - _MARGIN:  # Not capped by the search's range.
      assert not within(gamma + _MARGIN * max(1.0, gamma))


def test_halving_search_follows_the_papers_algorithm():
  # Admissible below 3.3: from 10, steps 5, 2.5, 1.25, ... bisect towards 3.3 within tau.
  assert attacks.halving_search(lambda g: g <= 3.3) == pytest.approx(3.3, abs=1e-5)
  assert attacks.halving_search(lambda g: g <= 3.3) <= 3.3
  assert attacks.halving_search(lambda g: False) == 0.0
  assert 20 - 1e-4 < attacks.halving_search(lambda g: True) < 20  # The search's range ends below 2 * gamma_init.
  assert attacks.halving_search(lambda g: g <= 0.7, gamma_init=1.0, tau=1e-3) == pytest.approx(0.7, abs=1e-3)


def test_perturbations_and_the_gamma_init_default_are_the_papers():
  rows = _updates(4)
  for kind in attacks.PERTURBATIONS:
    np.testing.assert_allclose(attacks.perturbation(rows, kind), _reference_perturbation(rows, kind), rtol=1e-12)
  assert (attacks.DEFAULT_MINMAX_PERTURBATION, attacks.DEFAULT_MINMAX_GAMMA_INIT, attacks.MINMAX_TAU) == (
      'std', 10.0, 1e-5)
  with pytest.raises(ValueError, match='minmax_perturbation'):
    attacks.perturbation(rows, 'random')


# -------------------------------------------------------------------------------------------------- the plumbing


def test_flatten_and_unflatten_keep_shapes_and_dtypes():
  updates = [[np.full((2, 3), i, np.float32), np.full(4, -i, np.float32)] for i in range(3)]
  rows = attacks.flatten(updates)
  assert rows.shape == (3, 10) and rows.dtype == np.float64
  back = attacks.unflatten(rows[2], updates[0])
  assert [(b.shape, b.dtype) for b in back] == [((2, 3), np.float32), ((4,), np.float32)]
  np.testing.assert_array_equal(back[1], np.full(4, -2, np.float32))
  with pytest.raises(ValueError, match='components'):
    attacks.unflatten(np.zeros(11), updates[0])
  with pytest.raises(ValueError, match='honest update'):
    attacks.flatten([])
