"""Plain-TF math of RFA's smoothed Weiszfeld algorithm (RFA paper, Algorithms 2 and 3).

The geometric median of client points w_i with weights a_i minimizes g(v) = sum_i a_i ||v - w_i||, where ||.||
is the Euclidean norm of the whole flattened update (all tensors of the structure together). The smoothed
Weiszfeld iteration with smoothing nu > 0 is

    v_1     = sum_i a_i w_i / sum_i a_i                           (the weighted mean: one secure average)
    b_i     = a_i / max(nu, ||v_k - w_i||)                        (computed by client i from the broadcast v_k)
    v_{k+1} = sum_i b_i w_i / sum_i b_i                           (one secure average per pass)

and one-step RFA is a single such pass from v_0 = 0 (the current server model in update space):
b_i = a_i / max(nu, ||w_i||).

Objective. D(v) = sum_i a_i ||v - w_i|| / sum_i a_i is g(v) normalized by the total weight (the weighted mean
distance). It is measured in the round that broadcasts v: the clients compute d_i = ||v - w_i|| for their
weights anyway and send a_i d_i in the same round as b_i w_i and b_i. So the round of pass k measures D(v_{k-1})
(pass 1: D(v_0) = D(0), the weighted mean norm of the updates), never D of the estimate it is computing.

Scale of the weights. The update is invariant to multiplying every b_i by a common factor, so clients use

    b'_i = a_i * c / max(c, d_i),   d_i = ||v - w_i||,            in [0, a_i]

with smoothing c = nu (exactly the weights above, times nu). A secure sum needs every summand inside a fixed
bound; b'_i <= a_i keeps the weights inside the bound of the first pass. Quantization has a fixed absolute
resolution, so weights of order nu / d_i (1e-6 and less) would be lost in it; in secure mode the smoothing is
therefore raised to c = max(nu, S / K), with K = `max_weight_ratio` and S a distance scale the server knows
*before* the round (so that c costs no round of its own):

  * pass k >= 2 of Weiszfeld: S = D(v_{k-2}), the objective measured in the previous round (pass 2: D(0)).
  * one-step RFA: S = value_bound * sqrt(n) (`norm_bound`), the largest norm a clipped update can have, so that
    every client keeps a weight b'_i >= a_i / K whatever its update: the discretization error is at most K times
    that of the plain secure mean (`secure_mean.discretization_error_bound` with sum_i a_i / K).

Either way this is exactly the smoothed Weiszfeld algorithm with the larger smoothing c in place of nu: a point
closer to the broadcast estimate than c counts as if it were at distance c, so no client gets more than K
times the weight (per unit of a_i) of a client at distance S. It changes the result only when clients lie that
close to the estimate. Weiszfeld does not increase the objective, so D(v_{k-2}) is usually a little above
D(v_{k-1}) (the previous rule's scale); it can be far above it in pass 2 when the updates share a common part
much larger than their spread (D(0) >> D(v_1)): if all clients lie within D(0) / K of v_1, pass 2 returns v_1
again and the reweighting starts in pass 3. One-step RFA in secure mode needs a tight `value_bound`: when
value_bound * sqrt(n) / K exceeds every ||w_i||, it returns the weighted mean.

Error propagation in secure mode. Each pass's secure mean is within `secure_mean.error_bound` (per coordinate)
of the exact weighted mean of the points with the weights the clients send, and those weights come from the
previous (inexact) estimate. With v_k the exact iterates of the algorithm above (the smoothing c_k it uses, from
the exact objectives), v'_k the computed ones, e_k a bound on ||v'_k - v_k|| (e_0 = 0: v_0 = 0 is exact) and
eps = 2**-24 (float32 values):

  * distances: |d'_i - d_i| <= Dd_i = e + (n + 4) eps (d_i + e), with d_i = ||v_k - w_i||, d'_i the float32
    `flat_distance(v'_k, w_i)`, e = e_k and n the number of coordinates (`distance_error_bound`: the triangle
    inequality, and a relative (n / 2 + 2) eps for the float32 norm of n differences, doubled for the
    second-order terms);
  * objective: the mean of the d'_i with the weights a_i is within max_i Dd_i of D(v_k); its secure mean adds
    `error_bound` with the distance bound, |mean| <= D(v_k) + max_i Dd_i and max_i (d_i + Dd_i);
  * smoothing: c = max(nu, S / K) moves by at most Dc = max(eps nu, (DS + eps (S + DS)) / K) for a scale S known
    within DS (the previous round's objective; max is 1-Lipschitz, float32 division rounds once), Dc = eps c
    for a constant c (one-step RFA's, rounded to float32);
  * reweighted pass (`reweighting_error_bound`): with M_i = max(c, d_i) and D_i = max(Dc, Dd_i), max(c', d'_i)
    is within D_i of M_i (max is 1-Lipschitz), so the weights the clients send are b'_i = lambda b_i r_i with a
    common factor lambda = c' / c, which cancels, and r_i in [L_i, U_i] = [(1 - eps)^2 M_i / (M_i + D_i),
    (1 + eps)^2 M_i / (M_i - D_i)] (two float32 roundings in `weiszfeld_weight`; U_i = inf if D_i >= M_i).
    Since sum_i b_i (w_i - v_{k+1}) = 0, the exact mean of the w_i with the weights b'_i is
    v_{k+1} + sum_i b_i (r_i - 1) (w_i - v_{k+1}) / sum_i b_i r_i, within
    P = min(sum_i b_i (U_i - 1) ||w_i - v_{k+1}|| / sum_i b_i L_i, max_i ||w_i - v_{k+1}||) of v_{k+1}
    (U_i - 1 >= 1 - L_i; the second term: both means lie in the points' convex hull);
  * pass: e_{k+1} <= P + ||E||, E the per-coordinate `secure_mean.error_bound` of that mean (its total weight at
    least sum_i a_i (c - Dc) (1 - eps)^2 / (M_i + D_i), |mean| <= |v_{k+1}| + P); the plain first pass of
    init='mean' has P = 0 (weights a_i).

The bound follows the worst case at every step, so it grows with the Lipschitz constant of the Weiszfeld map
(about ||w_i - v_{k+1}|| / max(c, d_i) for the heaviest clients) and is far above the errors seen in practice;
it is infinite when a client's distance is not known to within its M_i.

`flat_distance`, `weiszfeld_weight`, `secure_smoothing` and `one_step_secure_smoothing` are the client- and
server-side pieces; the federated plumbing is in `geometric_median`.
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
  """c = max(nu, S / K): the smoothing used in secure mode, from a distance scale S (see the module docstring)."""
  scale = tf.cast(scale, tf.float32)
  return tf.maximum(tf.constant(smoothing, tf.float32), scale / tf.constant(max_weight_ratio, tf.float32))


def norm_bound(value_bound: float, num_elements: int) -> float:
  """Largest ||w|| of an update whose every coordinate lies in [-B, B]: B * sqrt(n)."""
  return value_bound * math.sqrt(num_elements)


def one_step_secure_smoothing(
    smoothing: float, value_bound: float, num_elements: int, max_weight_ratio: float) -> float:
  """c = max(nu, B sqrt(n) / K): one-step RFA's secure smoothing, known before the round (module docstring)."""
  return max(smoothing, norm_bound(value_bound, num_elements) / max_weight_ratio)


def distance_bound(value_bound: float, num_elements: int) -> float:
  """Largest ||v - w_i|| when every coordinate of w_i and of v (a convex combination) lies in [-B, B].

  With a 0.1% margin for the discretization error of v.
  """
  return 2.0 * value_bound * math.sqrt(num_elements) * 1.001


# ----------------------------------------------------------------------------------------------------------------
# Error propagation in secure mode (NumPy, float64; module docstring).


def distance_error_bound(distance, estimate_error: float, num_elements: int, eps: float = FLOAT32_ROUNDOFF):
  """Dd: |d' - d| for d = ||v - w|| and d' = `flat_distance(v', w)` in float32, ||v' - v|| <= `estimate_error`.

  For float32 values (a float64 leaf is rounded to float32 before the difference, which this does not cover).
  """
  distance = np.asarray(distance, np.float64)
  return estimate_error + (num_elements + 4) * eps * (distance + estimate_error)


def reweighting_error_bound(points, weights, estimate, next_estimate, smoothing: float, distance_errors,
                            smoothing_error: float, eps: float = FLOAT32_ROUNDOFF) -> tuple[float, float]:
  """(P, least total weight): how far the clients' reweighted pass can move its weighted mean (module docstring).

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
