"""The update attacks of the Byzantine-robustness literature, as NumPy formulas: what a simulated attacker sends.

Each function takes the round's honest updates as a float64 array of shape [n, d] (one flattened update a row:
`flatten`) and returns what the corrupted participants send, shape [d] (one vector every attacker sends) or, for
`sign_flip`, one row per attacker. The harness (`training.engine.corruption.CorruptedRounds`) computes the honest
updates of the round, calls these and hands the vectors to the corrupted clients; nothing here is part of a
deployed round. Formulas, papers and defaults: docs/methods.md#attacks

Choices shared by every attack here, where the papers leave room:
* The attacker's knowledge: the honest updates of all the round's participants, the corrupted participants' own
  honest updates included (ALIE and Min-Max/Min-Sum compute their statistics over the benign updates of all
  clients, the malicious ones' own honest gradients included; IPM and `large_norm` use the same pool, so that every
  attack here sees the same thing). `mimic` copies a participant that is not corrupted.
* The statistics are unweighted (each participant counts once, whatever its example count), as in the papers; the
  per-coordinate standard deviation is the sample one (ddof=1, as `torch.std` in the Min-Max/Min-Sum authors' code
  and byzfl's ALIE), zero for a single update.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

ALIE = 'alie'
IPM = 'ipm'
SIGN_FLIP = 'sign_flip'
MIMIC = 'mimic'
LARGE_NORM = 'large_norm'
ZERO_UPDATE = 'zero_update'
MIN_MAX = 'min_max'
MIN_SUM = 'min_sum'
ATTACKS = (ALIE, IPM, SIGN_FLIP, MIMIC, LARGE_NORM, ZERO_UPDATE, MIN_MAX, MIN_SUM)

# Min-Max/Min-Sum's perturbation directions p (Shejwalkar and Houmansadr, Sec. on AGR-agnostic attacks): the inverse
# unit vector -mu/||mu||, the inverse standard deviation -sigma, the inverse sign -sign(mu). `std` is the paper's
# most effective in its evaluation, the default.
UNIT_VEC = 'unit_vec'
STD = 'std'
SIGN = 'sign'
PERTURBATIONS = (UNIT_VEC, STD, SIGN)

# IPM's epsilon: the paper's small-epsilon attack on the median-type rules (the Byzantine mean -epsilon times the
# correct mean keeps a positive inner product with it only when the honest part outweighs it). byzfl's FallOfEmpires
# default (tau = 3, sending (1 - tau) times the mean) is epsilon = 2; the paper also evaluates epsilon = 100 against
# Krum.
DEFAULT_IPM_EPSILON = 0.1
DEFAULT_LARGE_NORM_SCALE = 1e3  # The attack's norm, in multiples of the median honest norm.
DEFAULT_MINMAX_PERTURBATION = STD
DEFAULT_MINMAX_GAMMA_INIT = 10.0  # The authors' gamma_init.
MINMAX_TAU = 1e-5  # The authors' threshold: the halving search stops when a step moves gamma by at most this.


# ----------------------------------------------------------------------------------------------------------------
# Updates as rows.


def flatten(updates: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
  """The updates (each a list of arrays, the model's leaves) as a float64 array [n, d], one update a row."""
  if not len(updates):
    raise ValueError('updates: the attacks need at least one honest update')
  return np.stack([np.concatenate([np.ravel(np.asarray(leaf, np.float64)) for leaf in update]) for update in updates])


def unflatten(vector: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
  """`vector` [d] as a list of arrays of the shapes and dtypes of `like`'s leaves."""
  leaves, start = [], 0
  for leaf in like:
    leaf = np.asarray(leaf)
    leaves.append(np.reshape(vector[start:start + leaf.size], leaf.shape).astype(leaf.dtype))
    start += leaf.size
  if start != np.size(vector):
    raise ValueError(f'vector has {np.size(vector)} components, the update {start}')
  return leaves


def _rows(honest: np.ndarray) -> np.ndarray:
  honest = np.asarray(honest, np.float64)
  if honest.ndim != 2 or honest.shape[0] < 1:
    raise ValueError(f'honest updates must be an array [n >= 1, d], got shape {honest.shape}')
  return honest


def coordinate_std(honest: np.ndarray) -> np.ndarray:
  """The per-coordinate sample standard deviation (ddof=1) of the rows; zeros for a single row."""
  honest = _rows(honest)
  return honest.std(axis=0, ddof=1) if honest.shape[0] > 1 else np.zeros(honest.shape[1])


# ----------------------------------------------------------------------------------------------------------------
# The attacks.


def alie_z_max(num_participants: int, num_corrupted: int) -> float:
  """A Little Is Enough's z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f (Baruch et al., NeurIPS 2019).

  s is the number of honest participants the attacker needs as "supporters" so that a majority sits farther from
  the mean than its vector. With a corrupted majority (s <= 0) the formula's quantile reaches 1 (an infinite z):
  s is taken as at least 1. A single participant gives z = 0 (its standard deviation is zero anyway).
  """
  n, f = int(num_participants), int(num_corrupted)
  if n < 1 or not 0 <= f <= n:
    raise ValueError(f'alie: needs 1 <= n and 0 <= f <= n participants, got n={n}, f={f}')
  s = max(math.floor(n / 2 + 1) - f, 1)
  quantile = (n - s) / n
  return statistics.NormalDist().inv_cdf(quantile) if 0 < quantile < 1 else 0.0


def alie(honest: np.ndarray, num_corrupted: int, z: Optional[float] = None) -> np.ndarray:
  """ALIE: mu - z * sigma per coordinate (mean and standard deviation of the honest rows); z: `alie_z_max`."""
  honest = _rows(honest)
  if z is None:
    z = alie_z_max(honest.shape[0], num_corrupted)
  return honest.mean(axis=0) - z * coordinate_std(honest)


def ipm(honest: np.ndarray, epsilon: float = DEFAULT_IPM_EPSILON) -> np.ndarray:
  """Inner Product Manipulation (Xie et al., UAI 2020): -epsilon times the mean of the honest rows."""
  return -float(epsilon) * _rows(honest).mean(axis=0)


def sign_flip(own: np.ndarray) -> np.ndarray:
  """Sign flipping: an attacker sends its own honest update negated (each attacker its own: rows in, rows out).

  The definition of the bit/sign-flipping attacks of Allen-Zhu et al. and Karimireddy et al. (a Byzantine worker
  sends -its gradient); byzfl's `SignFlipping` sends the negated honest mean instead, which `ipm` with epsilon = 1
  is.
  """
  return -np.asarray(own, np.float64)


def mimic_target(honest: np.ndarray, candidates: Sequence[bool]) -> int:
  """The row a `mimic` attacker copies: the candidate farthest along the top principal direction of the rows.

  Karimireddy et al. (ICLR 2022) pick a fixed honest worker i* maximising <z, x_i>, z the top eigenvector of the
  honest updates' covariance. Here, each round: z is that eigenvector of this round's rows (exactly, from the
  eigen-decomposition of the centred rows' n x n Gram matrix, no power iteration), and i* the candidate with the
  largest |<z, x_i - mu>| (an eigenvector's sign is arbitrary: the farthest on either side); the first candidate
  when the rows do not vary. `candidates`: the participants that may be copied (not corrupted); all rows when none
  is.
  """
  honest = _rows(honest)
  allowed = np.asarray(candidates, bool)
  if allowed.shape != (honest.shape[0],):
    raise ValueError(f'candidates must have one entry per update ({honest.shape[0]}), got {allowed.shape}')
  if not allowed.any():
    allowed = np.ones_like(allowed)
  centred = honest - honest.mean(axis=0)
  eigenvalues, eigenvectors = np.linalg.eigh(centred @ centred.T)
  if not eigenvalues[-1] > 0:
    return int(np.flatnonzero(allowed)[0])
  # The projections of the centred rows on z: C z = sqrt(lambda_1) e_1, e_1 the Gram matrix's top eigenvector.
  projection = np.abs(eigenvectors[:, -1])
  return int(np.flatnonzero(allowed)[np.argmax(projection[allowed])])


def mimic(honest: np.ndarray, candidates: Sequence[bool]) -> np.ndarray:
  """Mimic (Karimireddy et al., ICLR 2022): every attacker sends the honest row `mimic_target` picks."""
  return _rows(honest)[mimic_target(honest, candidates)].copy()


def large_norm(honest: np.ndarray, scale: float = DEFAULT_LARGE_NORM_SCALE) -> np.ndarray:
  """A vector of norm `scale` times the median honest norm, along the negated honest mean (-mu / ||mu||).

  A zero mean has no direction: the vector is then along -(1, ..., 1) / sqrt(d).
  """
  honest = _rows(honest)
  mean = honest.mean(axis=0)
  norm = np.linalg.norm(mean)
  direction = -mean / norm if norm > 0 else -np.ones_like(mean) / math.sqrt(max(mean.size, 1))
  return float(scale) * float(np.median(np.linalg.norm(honest, axis=1))) * direction


def zero_update(dimension: int) -> np.ndarray:
  """A zero update (a lazy or stale client: the current model sent back unchanged)."""
  return np.zeros(int(dimension))


def perturbation(honest: np.ndarray, kind: str = DEFAULT_MINMAX_PERTURBATION) -> np.ndarray:
  """Min-Max/Min-Sum's perturbation p (`PERTURBATIONS`): -mu/||mu|| (zero for a zero mean), -sigma or -sign(mu)."""
  honest = _rows(honest)
  mean = honest.mean(axis=0)
  if kind == UNIT_VEC:
    norm = np.linalg.norm(mean)
    return -mean / norm if norm > 0 else np.zeros_like(mean)
  if kind == STD:
    return -coordinate_std(honest)
  if kind == SIGN:
    return -np.sign(mean)
  raise ValueError(f'minmax_perturbation must be one of {PERTURBATIONS}, got {kind!r}')


def halving_search(admissible: Callable[[float], bool], gamma_init: float = DEFAULT_MINMAX_GAMMA_INIT,
                   tau: float = MINMAX_TAU) -> float:
  """The largest gamma found `admissible` by Shejwalkar and Houmansadr's search (NDSS 2021, Algorithm 1).

  gamma starts at `gamma_init`, the step at gamma_init / 2: an admissible gamma is kept and gamma grows by the
  step, else it shrinks by it; the step halves each time; the search stops when gamma moves within `tau` of the
  last admissible value. Returns that value (0 when none was admissible), below 2 * gamma_init.
  """
  gamma, step, found = float(gamma_init), float(gamma_init) / 2, 0.0
  while abs(found - gamma) > tau:
    if admissible(gamma):
      found = gamma
      gamma += step
    else:
      gamma -= step
    step /= 2
  return found


def _squared_distances(honest: np.ndarray, direction: np.ndarray) -> Callable[[float], np.ndarray]:
  """gamma -> ||mu + gamma p - w_i||^2 for every row i, from the expansion a_i + 2 gamma b_i + gamma^2 c."""
  offsets = honest.mean(axis=0) - honest
  a = np.einsum('ij,ij->i', offsets, offsets)
  b = offsets @ direction
  c = float(direction @ direction)
  return lambda gamma: a + 2 * gamma * b + gamma * gamma * c


def _pairwise_squared_distances(honest: np.ndarray) -> np.ndarray:
  gram = honest @ honest.T
  norms = np.diag(gram)
  return np.maximum(norms[:, None] + norms[None, :] - 2 * gram, 0.0)


def min_max_gamma(honest: np.ndarray, direction: np.ndarray, gamma_init: float = DEFAULT_MINMAX_GAMMA_INIT,
                  tau: float = MINMAX_TAU) -> float:
  """Min-Max's gamma: max_i ||m - w_i|| <= max_{i,j} ||w_i - w_j|| for m = mu + gamma p (`halving_search`)."""
  honest = _rows(honest)
  bound = _pairwise_squared_distances(honest).max()
  distances = _squared_distances(honest, np.asarray(direction, np.float64))
  return halving_search(lambda gamma: distances(gamma).max() <= bound, gamma_init, tau)


def min_sum_gamma(honest: np.ndarray, direction: np.ndarray, gamma_init: float = DEFAULT_MINMAX_GAMMA_INIT,
                  tau: float = MINMAX_TAU) -> float:
  """Min-Sum's gamma: sum_i ||m - w_i||^2 <= max_i sum_j ||w_i - w_j||^2 for m = mu + gamma p.

  The paper's bound is the largest sum of squared distances of an honest update to the others (some public
  implementations compare with the smallest instead).
  """
  honest = _rows(honest)
  bound = _pairwise_squared_distances(honest).sum(axis=1).max()
  distances = _squared_distances(honest, np.asarray(direction, np.float64))
  return halving_search(lambda gamma: distances(gamma).sum() <= bound, gamma_init, tau)


def min_max(honest: np.ndarray, kind: str = DEFAULT_MINMAX_PERTURBATION,
            gamma_init: float = DEFAULT_MINMAX_GAMMA_INIT) -> np.ndarray:
  """Min-Max (Shejwalkar and Houmansadr, NDSS 2021, AGR-agnostic): mu + gamma p, gamma from `min_max_gamma`."""
  honest = _rows(honest)
  direction = perturbation(honest, kind)
  return honest.mean(axis=0) + min_max_gamma(honest, direction, gamma_init) * direction


def min_sum(honest: np.ndarray, kind: str = DEFAULT_MINMAX_PERTURBATION,
            gamma_init: float = DEFAULT_MINMAX_GAMMA_INIT) -> np.ndarray:
  """Min-Sum (Shejwalkar and Houmansadr, NDSS 2021, AGR-agnostic): mu + gamma p, gamma from `min_sum_gamma`."""
  honest = _rows(honest)
  direction = perturbation(honest, kind)
  return honest.mean(axis=0) + min_sum_gamma(honest, direction, gamma_init) * direction
