"""Plain-TF math of RFA's smoothed Weiszfeld algorithm (RFA paper, Algorithms 2 and 3), and its secure-mode bounds.

Clients weight b_i = a_i / max(nu, ||v - w_i||) over the whole flattened update, sent scaled by the smoothing c as
a_i c / max(c, d_i) <= a_i to fit the secure bounds; secure mode (and an inexact inner mean) floors c at max(nu, S / K).
The NumPy functions bound the error this propagates in secure mode; the federated plumbing is in `geometric_median`.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

FLOAT32_ROUNDOFF = 2.0**-24  # eps: the unit roundoff of float32.


def flat_norm(value) -> tf.Tensor:
  """Euclidean norm (float32) of all elements of all tensors of the structure `value`."""
  squares = [tf.reduce_sum(tf.square(tf.cast(x, tf.float32))) for x in tf.nest.flatten(value)]
  return tf.sqrt(tf.add_n(squares)) if squares else tf.constant(0.0)


def flat_distance(estimate, value) -> tf.Tensor:
  """||estimate - value|| over the whole flattened structure (float32)."""
  return flat_norm(tf.nest.map_structure(
      lambda v, w: tf.cast(v, tf.float32) - tf.cast(w, tf.float32), estimate, value))


def weiszfeld_weight(weight: tf.Tensor, distance: tf.Tensor, smoothing: tf.Tensor) -> tf.Tensor:
  """b' = a * c / max(c, d): the Weiszfeld weight a / max(c, d) scaled by c, so that 0 <= b' <= a."""
  weight = tf.cast(weight, tf.float32)
  smoothing = tf.cast(smoothing, tf.float32)
  return weight * smoothing / tf.maximum(smoothing, tf.cast(distance, tf.float32))


# The thresholds t_j of the clients' distance histogram, from which the server reads the weighted median distance:
# four a decade over [1e-10, 1e6] (65 values), absolute because no scale is known before the first round.
DISTANCE_GRID = np.float32(10.0) ** (np.arange(-40, 25, dtype=np.float32) / np.float32(4))
DEFAULT_NEAR_FRACTION = 1 / 30  # A client within this share of the median distance counts as at the iterate.
# The spread vector a client sends beside a pass (a weighted mean with weights a_i): near_i, far_i c / d_i, then
# 1[d_i <= t_j] for every threshold of `DISTANCE_GRID`. Every entry lies in [0, 1].
NEAR, FAR = 0, 1
HISTOGRAM = 2


def spread_size() -> int:
  """Length of a client's spread vector (`reweight`, `plain_spread`)."""
  return HISTOGRAM + len(DISTANCE_GRID)


def is_near(distance: tf.Tensor, smoothing: tf.Tensor) -> tf.Tensor:
  """Bool: a client within the smoothing c of the iterate, which Vardi-Zhang's step treats as at the iterate."""
  return tf.cast(distance, tf.float32) <= tf.cast(smoothing, tf.float32)


def _histogram(distance: tf.Tensor) -> tf.Tensor:
  return tf.cast(distance <= tf.constant(DISTANCE_GRID), tf.float32)


def reweight(weight: tf.Tensor, distance: tf.Tensor, smoothing: tf.Tensor, near_rule: bool = True):
  """(b', spread) of a reweighting pass: b' = a c / max(c, d), or 0 for a client within c of the iterate (it moves
  the step, not the mean); the spread vector (near_i, c / max(c, d_i) if far, the distance histogram). Without
  `near_rule` no client is near: the paper's smoothed Weiszfeld."""
  distance, smoothing = tf.cast(distance, tf.float32), tf.cast(smoothing, tf.float32)
  near = tf.logical_and(is_near(distance, smoothing), near_rule)
  zero = tf.constant(0.0)
  far_share = tf.where(near, zero, smoothing / tf.maximum(smoothing, distance))
  spread = tf.concat([tf.stack([tf.cast(near, tf.float32), far_share]), _histogram(distance)], axis=0)
  return tf.where(near, zero, weiszfeld_weight(weight, distance, smoothing)), spread


def plain_spread(distance: tf.Tensor) -> tf.Tensor:
  """The spread vector of a plain mean's pass: no iterate to be near, only the distance histogram."""
  return tf.concat([tf.zeros([HISTOGRAM]), _histogram(tf.cast(distance, tf.float32))], axis=0)


def median_distance(spread: tf.Tensor) -> tf.Tensor:
  """The smallest threshold t_j at which the weighted share of clients with d_i <= t_j reaches one half."""
  cumulative = spread[HISTOGRAM:]
  index = tf.reduce_sum(tf.cast(cumulative < 0.5, tf.int32))
  return tf.gather(tf.constant(DISTANCE_GRID), tf.minimum(index, len(DISTANCE_GRID) - 1))


def near_smoothing(smoothing: tf.Tensor, scale: tf.Tensor, near_fraction: float) -> tf.Tensor:
  """max(c, f S): the smoothing c, raised to the share f of the median distance S the previous round measured."""
  return tf.maximum(tf.cast(smoothing, tf.float32), tf.constant(near_fraction, tf.float32) * scale)


def vardi_zhang_step(iterate, far_mean, spread: tf.Tensor, smoothing: tf.Tensor):
  """(v', stalled): Vardi and Zhang's modified Weiszfeld step from the iterate y, with the near clients at y.

  T = `far_mean` is the weighted mean of the far clients with b_i = a_i / d_i; eta = sum of the near clients' a_i
  and r = ||sum_far b_i (w_i - y)|| = B ||T - y||, B = sum_far b_i. Then v' = (1 - g) T + g y, g = min(1, eta / r)
  (Vardi and Zhang 2000, eq. 2.5): y stays only where the near clients outweigh every pull away from it, which is
  where the geometric median is. All sums arrive as means over the clients' weight A: eta / A = spread[NEAR] and
  B / A = spread[FAR] / c. `stalled` (int32 0/1): the step left y where it was (g = 1, or no far client).
  """
  smoothing = tf.cast(smoothing, tf.float32)
  near_share, far_share = spread[NEAR], spread[FAR]
  pull = far_share / smoothing * flat_distance(far_mean, iterate)
  g = tf.where(pull > 0, tf.minimum(1.0, tf.math.divide_no_nan(near_share, pull)), 1.0)
  g = tf.where(near_share > 0, g, 0.0)
  moves = far_share > 0  # With no far client there is no T (its mean had no weight): y stays.
  step = tf.nest.map_structure(
      lambda t, y: tf.cast(tf.where(moves, (1 - g) * tf.cast(t, tf.float32) + g * tf.cast(y, tf.float32),
                                    tf.cast(y, tf.float32)), t.dtype),
      far_mean, iterate)
  stalled = tf.cast(tf.logical_or(g >= 1.0, tf.logical_not(moves)), tf.int32)
  return step, stalled


def secure_smoothing(smoothing: float, scale: tf.Tensor, max_weight_ratio: float) -> tf.Tensor:
  """c = max(nu, S / K): the smoothing used in secure mode, from a distance scale S known before the round.

  S is the objective measured in the previous round; K = `max_weight_ratio` bounds how much more weight (per unit
  of a_i) a close client gets than one at distance S, so the weights stay above the quantization resolution.
  """
  scale = tf.cast(scale, tf.float32)
  return tf.maximum(tf.constant(smoothing, tf.float32), scale / tf.constant(max_weight_ratio, tf.float32))


def norm_bound(value_bound: float, num_elements: int) -> float:
  """Largest ||w|| of an update whose every coordinate lies in [-B, B]: B * sqrt(n)."""
  return value_bound * math.sqrt(num_elements)


def one_step_secure_smoothing(
    smoothing: float, value_bound: float, num_elements: int, max_weight_ratio: float) -> float:
  """c = max(nu, B sqrt(n) / K): one-step RFA's secure smoothing, known before the round.

  B sqrt(n) is the largest norm of a clipped update, so every client keeps a weight of at least a_i / K.
  """
  return max(smoothing, norm_bound(value_bound, num_elements) / max_weight_ratio)


def distance_bound(value_bound: float, num_elements: int) -> float:
  """Largest ||v - w_i|| when every coordinate of w_i and of v (a convex combination) lies in [-B, B].

  With a 0.1% margin for the discretization error of v.
  """
  return 2.0 * value_bound * math.sqrt(num_elements) * 1.001


# ----------------------------------------------------------------------------------------------------------------
# Error propagation in secure mode (NumPy, float64).


def distance_error_bound(distance, estimate_error: float, num_elements: int, eps: float = FLOAT32_ROUNDOFF):
  """Dd: |d' - d| for d = ||v - w|| and d' = `flat_distance(v', w)` in float32, ||v' - v|| <= `estimate_error`.

  For float32 values (a float64 leaf is rounded to float32 before the difference, which this does not cover).
  """
  distance = np.asarray(distance, np.float64)
  return estimate_error + (num_elements + 4) * eps * (distance + estimate_error)


def reweighting_error_bound(points, weights, estimate, next_estimate, smoothing: float, distance_errors,
                            smoothing_error: float, eps: float = FLOAT32_ROUNDOFF) -> tuple[float, float]:
  """(P, least total weight): how far the clients' reweighted pass can move its weighted mean.

  With M_i = max(c, d_i) and D_i = max(Dc, Dd_i), the clients' weights are b_i r_i up to a common factor, r_i in
  [L_i, U_i] = [(1 - eps)^2 M_i / (M_i + D_i), (1 + eps)^2 M_i / (M_i - D_i)], so their mean is within
  P = min(sum_i b_i (U_i - 1) ||w_i - v_{k+1}|| / sum_i b_i L_i, max_i ||w_i - v_{k+1}||) of v_{k+1}.

  Args:
    points: the clients' points w_i (clipped in secure mode), [N, n].
    weights: their weights a_i, [N].
    estimate: v_k, the exact estimate the pass reweights from (its distances d_i = ||v_k - w_i||).
    next_estimate: v_{k+1}, the exact weighted mean of the w_i with b_i = a_i c / max(c, d_i).
    smoothing: c, the exact smoothing of the pass.
    distance_errors: Dd_i, bounds on the clients' distance errors ([N] or a number).
    smoothing_error: Dc, a bound on the error of the smoothing the clients use.
    eps: the unit roundoff of the weights' computation (float32).

  Returns:
    P, a bound on the distance between v_{k+1} and the exact weighted mean of the w_i with the weights the
    clients compute, and a lower bound on the sum of those weights (0 when Dc >= c: no bound).
  """
  points, weights = np.asarray(points, np.float64), np.asarray(weights, np.float64)
  next_estimate = np.asarray(next_estimate, np.float64)
  distances = np.linalg.norm(points - np.asarray(estimate, np.float64), axis=1)
  scale = np.maximum(smoothing, distances)
  error = np.maximum(smoothing_error, np.asarray(distance_errors, np.float64))
  exact = weights * smoothing / scale
  lower = (1 - eps)**2 * scale / (scale + error)
  with np.errstate(divide='ignore'):
    upper = np.where(error < scale, (1 + eps)**2 * scale / np.maximum(scale - error, 0), np.inf)
  spread = np.linalg.norm(points - next_estimate, axis=1)
  moving = spread > 0  # A point at v_{k+1} moves nothing, whatever its weight.
  moved = np.zeros_like(spread)
  moved[moving] = exact[moving] * (upper[moving] - 1) * spread[moving]
  hull_radius = float(np.max(spread)) if len(spread) else 0.0
  shift = min(float(np.sum(moved) / np.sum(exact * lower)), hull_radius)
  least_total = float(np.sum(weights * max(smoothing - smoothing_error, 0.0) * (1 - eps)**2 / (scale + error)))
  return shift, least_total
