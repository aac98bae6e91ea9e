"""GMA's plain-TF math (sign codes, agreement, soft/binary mask, statistics) against NumPy."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tff_gma.aggregators import sign_agreement


def random_structure(rng):
  def leaf(shape):
    return np.where(rng.random(shape) < 0.3, 0.0, rng.normal(size=shape)).astype(np.float32)

  return collections.OrderedDict(a=leaf((2, 3)), b=[leaf((4,)), leaf(())])


def test_sign_codes_are_sign_plus_one_and_zero_when_dropped():
  rng = np.random.default_rng(0)
  value = random_structure(rng)
  codes = sign_agreement.sign_codes(tf.nest.map_structure(tf.constant, value))
  for c, v in zip(tf.nest.flatten(codes), tf.nest.flatten(value)):
    assert c.dtype == tf.int32
    np.testing.assert_array_equal(c, np.sign(v).astype(np.int32) + 1)
    assert np.all((0 <= c.numpy()) & (c.numpy() <= sign_agreement.MAX_SIGN_CODE))
  dropped = sign_agreement.sign_codes(tf.nest.map_structure(tf.constant, value), tf.constant(0))
  assert all(np.all(c.numpy() == 0) for c in tf.nest.flatten(dropped))


@pytest.mark.parametrize('num_clients', [1, 3, 6, 7])
def test_agreement_from_code_sums_matches_mean_sign(num_clients):
  rng = np.random.default_rng(num_clients)
  clients = [random_structure(rng) for _ in range(num_clients)]
  code_sum = tf.nest.map_structure(
      lambda *xs: tf.constant(sum(np.sign(x).astype(np.int32) + 1 for x in xs)), *clients)
  got = sign_agreement.agreement(code_sum, tf.constant(num_clients))
  for j, a in enumerate(tf.nest.flatten(got)):
    signs = np.stack([tf.nest.flatten(c)[j] for c in clients])
    np.testing.assert_allclose(a, np.abs(np.sign(signs).mean(axis=0)), rtol=1e-6)


def test_agreement_with_no_clients_is_zero():
  got = sign_agreement.agreement([tf.zeros([3], tf.int32)], tf.constant(0))
  np.testing.assert_array_equal(got[0], 0.0)


@pytest.mark.parametrize('mask', ['soft', 'binary'])
@pytest.mark.parametrize('tau', [0.0, 0.4, 0.5, 1.0])
def test_mask(mask, tau):
  a = np.array([0.0, 0.2, 0.4, 0.5, 0.9, 1.0], np.float32)
  got = sign_agreement.gradient_mask([tf.constant(a)], tau, mask)[0].numpy()
  below = a if mask == 'soft' else np.zeros_like(a)
  np.testing.assert_array_equal(got, np.where(a >= np.float32(tau), 1.0, below))
  if tau == 0.0:
    np.testing.assert_array_equal(got, 1.0)  # tau = 0: the plain mean.


def test_apply_mask_and_statistics():
  agreement = collections.OrderedDict(a=tf.constant([[0.1, 0.5], [1.0, 0.3]]), b=[tf.constant(0.0)])
  delta = collections.OrderedDict(a=tf.constant([[2.0, -2.0], [4.0, 1.0]], tf.float64), b=[tf.constant(3.0)])
  masked = sign_agreement.apply_mask(sign_agreement.gradient_mask(agreement, 0.4, 'soft'), delta)
  assert masked['a'].dtype == tf.float64
  np.testing.assert_allclose(masked['a'], [[0.2, -2.0], [4.0, 0.3]], rtol=1e-6)
  np.testing.assert_allclose(masked['b'][0], 0.0)
  masked_fraction, mean_agreement = sign_agreement.mask_statistics(agreement, 0.4)
  assert float(masked_fraction) == pytest.approx(3 / 5)
  assert float(mean_agreement) == pytest.approx((0.1 + 0.5 + 1.0 + 0.3 + 0.0) / 5)


def test_invalid_mask():
  with pytest.raises(ValueError, match='mask'):
    sign_agreement.gradient_mask([tf.constant([0.5])], 0.4, 'hard')
