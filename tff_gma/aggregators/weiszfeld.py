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

`flat_distance`, `weiszfeld_weight`, `secure_smoothing` and `one_step_secure_smoothing` are the client- and
server-side pieces; the federated plumbing is in `geometric_median`.
"""

from __future__ import annotations

import math

import tensorflow as tf


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
