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
