"""A client's examples as one round takes them: shuffled by a seed pair, repeated for the local epochs, batched.

One definition for both places a round's client datasets are built: in this process (`training.runner.round_loop`,
which draws the seed pair from the run's seed, the round and the client) and inside the TFF worker from files
(`training.engine.worker_datasets`), so that both shuffle alike, bit for bit.
"""

from __future__ import annotations

import tensorflow as tf

SHUFFLE_BUFFER = 10_000


def round_pipeline(examples: tf.data.Dataset, seed, seed2, *, local_epochs: int, batch_size: int) -> tf.data.Dataset:
  """A client's examples as one round takes them: shuffled by the seed pair (reshuffled each epoch), repeated for
  the local epochs, batched.

  The shuffle is the op `Dataset.shuffle` builds in eager mode, with the seed pair given (possibly as tensors): a
  TFF computation's graph has no TF global seed, so `Dataset.shuffle(seed=...)` there would pair the op seed with
  another global seed (and a seed of 0 cannot be paired inside a graph); the datasets built in this process and
  those built in the TFF worker (`training.engine.worker_datasets`) shuffle alike.
  """
  return shuffled(examples, seed, seed2).repeat(local_epochs).batch(batch_size)


def shuffled(examples: tf.data.Dataset, seed, seed2) -> tf.data.Dataset:
  """`examples` as `round_pipeline` shuffles them (reshuffled each epoch), before the epochs and the batches."""
  spec = tf.nest.flatten(examples.element_spec)
  variant = tf.raw_ops.ShuffleDatasetV3(
      input_dataset=tf.data.experimental.to_variant(examples), buffer_size=tf.constant(SHUFFLE_BUFFER, tf.int64),
      seed=tf.cast(seed, tf.int64), seed2=tf.cast(seed2, tf.int64), seed_generator=tf.raw_ops.DummySeedGenerator(),
      output_types=[s.dtype for s in spec], output_shapes=[s.shape for s in spec], reshuffle_each_iteration=True)
  return tf.data.experimental.from_variant(variant, examples.element_spec)
