"""training.engine.evaluation: the central evaluator's Keras copy; held-out examples for personalized evaluation."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.data import client_data
from tff_gma.data import digits
from training.engine import evaluation


def test_hold_out_splits_each_client_and_keeps_every_example():
  rng = np.random.default_rng(0)
  arrays = {f'c{i}': (rng.normal(size=(n, 2)).astype(np.float32), np.arange(n, dtype=np.int32))
            for i, n in enumerate([1, 4, 10, 23])}
  train = client_data.from_client_arrays(arrays)
  kept, held = evaluation.hold_out(train, 0.2, seed=3)
  assert sorted(held) == ['c2', 'c3']  # floor(0.2 * n) = 0 for the clients of 1 and 4 examples.
  for cid, (x, y) in arrays.items():
    kx, ky = kept.client_arrays(cid)
    hx, hy = held.get(cid, (x[:0], y[:0]))
    assert len(hy) == min(int(np.floor(0.2 * len(y))), len(y) - 1)
    np.testing.assert_array_equal(np.sort(np.concatenate([ky, hy])), y)
    np.testing.assert_array_equal(kx, x[ky])
    np.testing.assert_array_equal(hx, x[hy])
  again_kept, _ = evaluation.hold_out(train, 0.2, seed=3)
  np.testing.assert_array_equal(again_kept.client_arrays('c3')[1], kept.client_arrays('c3')[1])
  with pytest.raises(ValueError, match='fraction'):
    evaluation.hold_out(train, 1.0, seed=3)


def test_the_evaluator_reuses_its_keras_copy_until_a_model_is_made_in_a_graph():
  split = digits.load_split()
  build_keras = models.keras_builder('cnn', digits.IMAGE_SHAPE, digits.NUM_CLASSES)
  builds = []

  def counted_build():
    builds.append(1)
    return build_keras()

  evaluator = evaluation.CentralEvaluator(counted_build, split.x_test, split.y_test)
  reference = build_keras()  # Independent copy: its own random weights are the ones evaluated.
  weights = tff.learning.models.ModelWeights.from_model(reference)
  probs = tf.nn.softmax(reference(split.x_test, training=False)).numpy().astype(np.float64)
  expected = {'accuracy': np.mean(np.argmax(probs, -1) == split.y_test),
              'loss': -np.mean(np.log(probs[np.arange(len(probs)), split.y_test]))}
  for _ in range(3):
    got = evaluator(weights)
    assert got['accuracy'] == pytest.approx(expected['accuracy'])
    assert got['loss'] == pytest.approx(expected['loss'], rel=1e-5)
  assert len(builds) == 1  # Reused.
  with tf.Graph().as_default():  # As TFF builds models: this swaps Keras's layer classes to their TF1 bases.
    build_keras()
  got = evaluator(weights)  # The old copy would raise "invalid state" here; a new one is built instead.
  assert len(builds) == 2
  assert got['accuracy'] == pytest.approx(expected['accuracy'])
