"""Personalized RFA (RFA paper, Algorithm 4): the client update against NumPy, the process's arguments.

The simulation's side (held-out examples, the clients' stored v_k, a run that resumes) is tested in
`tests/training/` (evaluation, client_state and experiment tests).
"""


import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.learning import personalized_rfa


# ------------------------------------------------------------------------------------ the client update (NumPy)


def _np_gradient(kernel, bias, x, y):
  """Gradient of the mean softmax cross-entropy of logits x @ kernel + bias."""
  x = x.reshape(len(x), -1).astype(np.float64)
  logits = x @ kernel + bias
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  p[np.arange(len(y)), y] -= 1
  return x.T @ p / len(y), p.mean(axis=0)


def _np_local_sgd(params, batches, lr):
  kernel, bias = params
  for x, y in batches:
    g_kernel, g_bias = _np_gradient(kernel, bias, x, y)
    kernel, bias = kernel - lr * g_kernel, bias - lr * g_bias
  return kernel, bias


def test_client_update_trains_personal_then_shared_on_each_others_residual():
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(8, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 10, 8).astype(np.int32)
  spec = (tf.TensorSpec([None, 8, 8, 1], tf.float32), tf.TensorSpec([None], tf.int32))
  model_fn = models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), spec)
  lr = 0.5
  update_fn = personalized_rfa.build_personalized_client_update(model_fn, tff.learning.optimizers.build_sgdm(lr))
  shared = [rng.normal(0, 0.1, (64, 10)).astype(np.float32), rng.normal(0, 0.1, 10).astype(np.float32)]
  personal = (rng.normal(0, 0.1, (64, 10)).astype(np.float32), rng.normal(0, 0.1, 10).astype(np.float32))
  batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
  result, new_personal, _ = update_fn(
      tff.learning.models.ModelWeights(trainable=shared, non_trainable=[]), batches,
      tf.data.Dataset.from_tensors(personal))

  w = [a.astype(np.float64) for a in shared]
  v = [a.astype(np.float64) for a in personal]
  np_batches = [(x[:4], y[:4]), (x[4:], y[4:])]
  after_personal = _np_local_sgd([w[0] + v[0], w[1] + v[1]], np_batches, lr)  # Phase 1 from w + v.
  expected_personal = [a - b for a, b in zip(after_personal, w)]
  after_shared = _np_local_sgd(after_personal, np_batches, lr)  # Phase 2 from w + v'.
  expected_update = [a - b for a, b in zip(after_personal, after_shared)]  # w - w_k = (w + v') - trained.
  for got, want in zip(new_personal, expected_personal):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
  for got, want in zip(result.update, expected_update):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
  assert float(result.update_weight) == 8.0


def test_client_with_no_personal_parameters_starts_from_zero():
  spec = (tf.TensorSpec([None, 8, 8, 1], tf.float32), tf.TensorSpec([None], tf.int32))
  model_fn = models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), spec)
  update_fn = personalized_rfa.build_personalized_client_update(model_fn, tff.learning.optimizers.build_sgdm(0.1))
  rng = np.random.default_rng(1)
  x, y = rng.uniform(size=(4, 8, 8, 1)).astype(np.float32), np.arange(4, dtype=np.int32)
  shared = [np.zeros((64, 10), np.float32), np.zeros(10, np.float32)]
  empty = tf.data.Dataset.from_tensors((shared[0], shared[1])).take(0)
  _, new_personal, _ = update_fn(tff.learning.models.ModelWeights(trainable=shared, non_trainable=[]),
                                 tf.data.Dataset.from_tensors((x, y)), empty)
  g_kernel, g_bias = _np_gradient(np.zeros((64, 10)), np.zeros(10), x, y)
  np.testing.assert_allclose(new_personal[0].numpy(), -0.1 * g_kernel, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(new_personal[1].numpy(), -0.1 * g_bias, rtol=1e-4, atol=1e-7)


def test_invalid_arguments_raise():
  spec = (tf.TensorSpec([None, 8, 8, 1], tf.float32), tf.TensorSpec([None], tf.int32))
  model_fn = models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), spec)
  with pytest.raises(ValueError, match='model_aggregator'):
    personalized_rfa.build_personalized_rfa(model_fn, tff.learning.optimizers.build_sgdm(0.1),
                                            model_aggregator=tff.aggregators.SumFactory())
  with pytest.raises(ValueError, match='^client_optimizer_fn must be'):
    personalized_rfa.build_personalized_rfa(model_fn, 0.1)
