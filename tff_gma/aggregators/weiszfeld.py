"""Plain-TF math of RFA's smoothed Weiszfeld algorithm (RFA paper, Algorithms 2 and 3).

The geometric median of client points w_i with weights a_i minimizes g(v) = sum_i a_i ||v - w_i||, where ||.||
is the Euclidean norm of the whole flattened update (all tensors of the structure together). The smoothed
Weiszfeld iteration with smoothing nu > 0 is

    v_1     = sum_i a_i w_i / sum_i a_i                           (the weighted mean: one secure average)
    b_i     = a_i / max(nu, ||v_k - w_i||)                        (computed by client i from the broadcast v_k)
    v_{k+1} = sum_i b_i w_i / sum_i b_i                           (one secure average per pass)

and one-step RFA is a single such pass from v = 0 (the current server model in update space):
b_i = a_i / max(nu, ||w_i||).

Scale of the weights. The update is invariant to multiplying every b_i by a common factor, so clients use

    b'_i = a_i * c / max(c, d_i),   d_i = ||v - w_i||,            in [0, a_i]

with smoothing c = nu (exactly the weights above, times nu). A secure sum needs every summand inside a fixed
bound; b'_i <= a_i keeps the weights inside the bound of the first pass. Quantization has a fixed absolute
resolution, so weights of order nu / d_i (1e-6 and less) would be lost in it; in secure mode the smoothing is
therefore raised to c = max(nu, D / K), where D = sum_i a_i d_i / sum_i a_i is the objective (mean distance) at
the broadcast estimate and K = `max_weight_ratio`. A typical client then has b'_i of order a_i / K, and no
client gets more than K times the weight of a client at the mean distance. This is the smoothed Weiszfeld
algorithm with a larger smoothing (points closer to the estimate than D / K count as if at D / K); it changes
the fixed point only when clients lie that close to it.

`flat_distance`, `weiszfeld_weight` and `secure_smoothing` are the client- and server-side pieces; the
federated plumbing is in `geometric_median`.
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


def secure_smoothing(smoothing: float, objective: tf.Tensor, max_weight_ratio: float) -> tf.Tensor:
  """c = max(nu, D / K): the smoothing used in secure mode (see the module docstring)."""
  objective = tf.cast(objective, tf.float32)
  return tf.maximum(tf.constant(smoothing, tf.float32), objective / tf.constant(max_weight_ratio, tf.float32))


def distance_bound(value_bound: float, num_elements: int) -> float:
  """Largest ||v - w_i|| when every coordinate of w_i and of v (a convex combination) lies in [-B, B].

  With a 0.1% margin for the discretization error of v.
  """
  return 2.0 * value_bound * math.sqrt(num_elements) * 1.001
