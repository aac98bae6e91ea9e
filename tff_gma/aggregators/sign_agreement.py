"""Plain-TF math of Gradient Masked Averaging (GMA paper, eq. 3 and Algorithm 1): signs, agreement, mask.

A_j = |(1/N) sum_n sign(Delta_n,j)| over the N participating clients; the mask is 1 where A_j >= tau, else A_j
(`soft`) or 0 (`binary`). Clients send sign codes sign + 1 in {0, 1, 2}, so the server needs only their secure
sum S_j and the count N: A_j = |S_j - N| / N.
"""

from __future__ import annotations

import tensorflow as tf

MASKS = ('soft', 'binary')
MAX_SIGN_CODE = 2  # sign + 1 lies in {0, 1, 2}: the tightest max_input of the secure sum.


def sign_codes(value, keep: tf.Tensor | int = 1):
  """`sign(value) + 1` as int32 in {0, 1, 2} for every tensor of the structure; all zeros when `keep == 0`."""
  keep = tf.cast(keep, tf.int32)
  return tf.nest.map_structure(lambda x: (tf.cast(tf.sign(x), tf.int32) + 1) * keep, value)


def agreement(code_sum, num_clients: tf.Tensor):
  """A = |S - N| / N per coordinate (float32), 0 everywhere when N == 0."""
  n = tf.cast(num_clients, tf.float32)
  return tf.nest.map_structure(
      lambda s: tf.math.divide_no_nan(tf.abs(tf.cast(s, tf.float32) - n), n), code_sum)


def gradient_mask(agreement_value, tau: float, mask: str = 'soft'):
  """The GMA mask from the agreement: 1 where A >= tau, else A (`soft`) or 0 (`binary`)."""
  if mask not in MASKS:
    raise ValueError(f'mask must be one of {MASKS}, got {mask!r}')

  def one(a):
    below = a if mask == 'soft' else tf.zeros_like(a)
    return tf.where(a >= tau, tf.ones_like(a), below)

  return tf.nest.map_structure(one, agreement_value)


def apply_mask(mask_value, delta):
  """m * Delta, leaf by leaf, in Delta's dtype."""
  return tf.nest.map_structure(lambda m, d: tf.cast(m, d.dtype) * d, mask_value, delta)


def mask_statistics(agreement_value, tau: float) -> tuple[tf.Tensor, tf.Tensor]:
  """(fraction of coordinates with A < tau, mean of A) over all coordinates of the structure (float32)."""
  flat = tf.concat([tf.reshape(a, [-1]) for a in tf.nest.flatten(agreement_value)], axis=0)
  size = tf.cast(tf.size(flat), tf.float32)
  masked = tf.math.divide_no_nan(tf.reduce_sum(tf.cast(flat < tau, tf.float32)), size)
  return masked, tf.math.divide_no_nan(tf.reduce_sum(flat), size)
