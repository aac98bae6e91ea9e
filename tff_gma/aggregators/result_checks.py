"""The last step of every factory here: no non-finite aggregate reaches the server model, and none passes silently.

An inner mean can lose the weights to its quantizer (0, or 0 / 0) or overflow; the server still gets a finite
update, and `nonfinite_result` (a NaN or Inf replaced by zeros) and `zero_result` (all zeros although a
participating client sent a non-zero update) say so, where otherwise only a loss that never moves would.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from tff_gma.aggregators import client_values


def sends_nonzero(value, participating) -> tf.Tensor:
  """int32 0/1: a participating client whose update has a non-zero coordinate (counted by a secure sum)."""
  nonzero = tf.reduce_any(tf.stack([tf.reduce_any(tf.not_equal(x, 0)) for x in tf.nest.flatten(value)]))
  return tf.cast(participating, tf.int32) * tf.cast(nonzero, tf.int32)


def finite_or_zero(result):
  """(`result` with every tensor zeroed when any element of the structure is non-finite, int32 0/1 flag)."""
  finite = client_values.all_finite(result)
  clean = tf.nest.map_structure(lambda x: tf.where(finite, x, tf.zeros_like(x)), result)
  return clean, 1 - tf.cast(finite, tf.int32)


def is_all_zero(result) -> tf.Tensor:
  """Scalar bool: every element of every tensor of `result` is zero."""
  return tf.reduce_all(tf.stack([tf.reduce_all(tf.equal(x, 0)) for x in tf.nest.flatten(result)]))


def check_result(result, nonzero_clients):
  """(finite result, OrderedDict(nonfinite_result, zero_result)) for a result at the server (plain TF)."""
  clean, nonfinite = finite_or_zero(result)
  zero = tf.logical_and(is_all_zero(clean), nonzero_clients > 0)
  return clean, collections.OrderedDict(nonfinite_result=nonfinite, zero_result=tf.cast(zero, tf.int32))
