"""Personalized RFA (RFA paper, Algorithm 4): the client update against NumPy, the personal store, run and resume."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import models
from tff_gma.data import client_data
from tff_gma.learning import personalized_rfa
from training import experiment

_TOY = experiment.ExperimentConfig(
    dataset='digits', partition='label_skew', num_clients=5, clients_per_round=3, rounds=2, model='logistic',
    batch_size=32, client_lr=0.1, algorithm='personalized', aggregator='rfa', seed=2)


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


# ----------------------------------------------------------------------------------------- held-out and store


def test_hold_out_splits_each_client_and_keeps_every_example():
  rng = np.random.default_rng(0)
  arrays = {f'c{i}': (rng.normal(size=(n, 2)).astype(np.float32), np.arange(n, dtype=np.int32))
            for i, n in enumerate([1, 4, 10, 23])}
  train = client_data.from_client_arrays(arrays)
  kept, held = personalized_rfa.hold_out(train, 0.2, seed=3)
  assert sorted(held) == ['c2', 'c3']  # floor(0.2 * n) = 0 for the clients of 1 and 4 examples.
  for cid, (x, y) in arrays.items():
    kx, ky = kept.client_arrays(cid)
    hx, hy = held.get(cid, (x[:0], y[:0]))
    assert len(hy) == min(int(np.floor(0.2 * len(y))), len(y) - 1)
    np.testing.assert_array_equal(np.sort(np.concatenate([ky, hy])), y)
    np.testing.assert_array_equal(kx, x[ky])
    np.testing.assert_array_equal(hx, x[hy])
  again_kept, _ = personalized_rfa.hold_out(train, 0.2, seed=3)
  np.testing.assert_array_equal(again_kept.client_arrays('c3')[1], kept.client_arrays('c3')[1])
  with pytest.raises(ValueError, match='fraction'):
    personalized_rfa.hold_out(train, 1.0, seed=3)


def test_store_checkpoints_prunes_and_restores(tmp_path):
  store = personalized_rfa.PersonalStore([(2, 3), (3,)], [np.float32, np.float32], keep_total=2)
  np.testing.assert_array_equal(store.get('a')[0], np.zeros((2, 3)))
  for round_num in (1, 2, 3):
    store.set('a', (np.full((2, 3), round_num), np.arange(3)))
    store.set(f'id with spaces {round_num}', (np.ones((2, 3)), np.ones(3)))
    store.checkpoint(str(tmp_path), round_num)
  assert sorted(os.listdir(tmp_path / 'personal')) == ['round_2.npz', 'round_3.npz']
  restored = personalized_rfa.PersonalStore([(2, 3), (3,)], [np.float32, np.float32])
  restored.restore(str(tmp_path), 2)
  assert len(restored) == 3 and 'id with spaces 3' not in restored
  np.testing.assert_array_equal(restored.get('a')[0], np.full((2, 3), 2.0))
  restored.restore(str(tmp_path), 0)
  assert len(restored) == 0
  with pytest.raises(FileNotFoundError):
    restored.restore(str(tmp_path), 1)
  with pytest.raises(ValueError, match='shapes'):
    store.set('b', (np.ones(3), np.ones(3)))


def test_invalid_arguments_raise():
  spec = (tf.TensorSpec([None, 8, 8, 1], tf.float32), tf.TensorSpec([None], tf.int32))
  model_fn = models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), spec)
  with pytest.raises(ValueError, match='model_aggregator'):
    personalized_rfa.build_personalized_rfa(model_fn, tff.learning.optimizers.build_sgdm(0.1),
                                            model_aggregator=tff.aggregators.SumFactory())
  with pytest.raises(ValueError, match='client_optimizer'):
    personalized_rfa.build_personalized_rfa(model_fn, 0.1)
  with pytest.raises(ValueError, match='corruption'):
    dataclasses.replace(_TOY, corruption='omniscient', corrupt_fraction=0.2).validate()


# ------------------------------------------------------------------------------------------- run and resume


class _Interrupt(Exception):
  pass


def test_personalized_rfa_runs_and_resumes_exactly(tmp_path):
  whole = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'a')), show_progress=False)

  def stop(round_num, state):
    del state
    if round_num == 1:
      raise _Interrupt()

  config_b = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'b'))
  with pytest.raises(_Interrupt):
    experiment.run(config_b, show_progress=False, on_round=stop)
  assert os.path.exists(tmp_path / 'b' / 'personal' / 'round_1.npz')
  resumed = experiment.run(config_b, show_progress=False)

  for a, b in zip(whole['_model_weights'].trainable, resumed['_model_weights'].trainable):
    np.testing.assert_array_equal(a, b)
  store_a = personalized_rfa.PersonalStore([(64, 10), (10,)], [np.float32, np.float32])
  store_b = personalized_rfa.PersonalStore([(64, 10), (10,)], [np.float32, np.float32])
  store_a.restore(str(tmp_path / 'a'), 2)
  store_b.restore(str(tmp_path / 'b'), 2)
  assert 3 <= len(store_a) == len(store_b) <= 5  # Clients of rounds 1 and 2 (3 per round, 5 in all).
  for cid in ['client_000', 'client_001', 'client_002', 'client_003', 'client_004']:
    assert (cid in store_a) == (cid in store_b)
    for a, b in zip(store_a.get(cid), store_b.get(cid)):
      np.testing.assert_array_equal(a, b)
  assert any(np.abs(store_a.get(c)[0]).max() > 0 for c in ['client_000', 'client_001', 'client_002', 'client_003',
                                                            'client_004'] if c in store_a)
  assert 0 <= whole['final_personalized_accuracy'] <= 1
  assert whole['final_personalized_accuracy'] == resumed['final_personalized_accuracy']
  rows = experiment._read_rows(str(tmp_path / 'a' / 'metrics.csv'))
  assert {'personalized/accuracy', 'personalized/shared_accuracy', 'client_work/train/loss'} <= set(rows[-1])
