"""`BucketingFactory`: bucketing (Karimireddy, He, Jaggi, ICLR 2022) around a robust rule. NOT PRIVATE.

Each round the clients are permuted at random (seeded, a new permutation every call), split into buckets of
`bucket_size`, and the inner robust rule runs on the buckets' weighted means. A bucket mean needs one client's
update next to another's, so the updates are collected at the server (`robust_baselines.CollectingFactory`), which
the audit reports as a violation, whatever the inner rule: bucketing around centered clipping is not private.
"""

from __future__ import annotations

import collections

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import centered_clipping
from tff_gma.aggregators import robust_baselines


def permutation(num_clients: tf.Tensor, seed: int, round_num: tf.Tensor) -> tf.Tensor:
  """The clients' order in round `round_num`: int32[num_clients], a function of (seed, round_num) only."""
  keys = tf.random.stateless_uniform([num_clients], seed=tf.stack([tf.constant(seed, tf.int32), round_num]))
  return tf.argsort(keys, stable=True)


def bucket_means(points: tf.Tensor, weights: tf.Tensor, bucket_size: int, seed: int,
                 round_num: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(bucket means [ceil(n / s), d], bucket weights): consecutive clients of `permutation`, s a bucket (the last
  one the remainder), each mean weighted by the clients' weights and weighing their sum."""
  order = permutation(tf.shape(points)[0], seed, round_num)
  bucket = tf.range(tf.shape(points)[0]) // bucket_size
  ordered_weights = tf.cast(tf.gather(weights, order), points.dtype)
  sums = tf.math.segment_sum(tf.gather(points, order) * ordered_weights[:, None], bucket)
  totals = tf.math.segment_sum(ordered_weights, bucket)
  return sums / totals[:, None], totals


class BucketingFactory(robust_baselines.CollectingFactory):
  """The inner rule on `bucket_size`-client bucket means (module docstring). NOT PRIVATE: updates are collected.

  The inner factory gives its rule on stacked clients (`stacked_rule`): the robust baselines (median, trimmed mean,
  multi-Krum) and `CenteredClippingFactory` from the zero update; the rule sees ceil(n / s) "clients" (a trimmed
  mean's or Krum's corruption level then counts buckets). State: the int32 call count, which seeds the permutation
  with `seed`, so a run is reproducible and each round's buckets differ. Measurements: `participating_clients`,
  `dropped_clients`, `buckets`, and the inner rule's own.
  """

  _counts_rounds = True

  def __init__(self, inner_factory: tff.aggregators.WeightedAggregationFactory, bucket_size: int, seed: int = 0):
    """Args: `inner_factory`: the robust rule; `bucket_size`: s >= 1 (1: the rule alone, on permuted clients);
    `seed`: an int32 seed of the permutations."""
    if not callable(getattr(inner_factory, 'stacked_rule', None)):
      raise TypeError(f'BucketingFactory needs an inner factory with a rule on stacked clients (stacked_rule: the '
                      f'robust baselines, CenteredClippingFactory), got {inner_factory!r}')
    if isinstance(inner_factory, centered_clipping.CenteredClippingFactory) and inner_factory.reference != 'zero':
      raise ValueError("BucketingFactory runs centered clipping from the zero update: its inner factory must have "
                       f"reference='zero', got {inner_factory.reference!r}")
    self._inner = inner_factory
    self._bucket_size = checks.check_positive_int(bucket_size, 'bucket_size')
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2**31 <= seed < 2**31:
      raise ValueError(f'seed must be an int32 integer, got {seed!r}')
    self._seed = seed

  def _round_rule(self, points, weights, round_num):
    means, totals = bucket_means(points, weights, self._bucket_size, self._seed, round_num)
    result, extra = self._inner.stacked_rule(means, totals)
    return result, collections.OrderedDict(buckets=tf.shape(means)[0], **extra)
