"""`tff_gma.optimizers` (FedAdam/FedYogi as Reddi et al. 2021, Algorithm 2) against an independent NumPy reference.

The reference is written from the paper, in its own terms: Delta_t is the aggregated update (mean of y_i - x_t),

    m_t = beta_1 m_{t-1} + (1 - beta_1) Delta_t
    v_t = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2                        (FedAdam)
    v_t = v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2)     (FedYogi)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau),   m_{-1} = 0, v_{-1} = tau^2, no bias correction.

The optimizers are fed TFF's update x_t - y_i = -Delta_t, as TFF's finalizer feeds a server optimizer. TFF's own
`build_adam` is pinned as bias-corrected (its documented rule), so the difference between the two is explicit.
The harness tests (the flag, its default, what each value builds) are in tests/training/adaptive_optimizer_test.py.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import optimizers
from tff_gma.learning import build_gma_fed_avg
from tests.tff_gma.learning import gma_fed_avg_test as gma_case

BETA_1, BETA_2 = 0.9, 0.99
TAU = 0.05  # Large enough that the tau^2 start and the tau in the denominator both move the steps measurably.
ETA = 0.3

# Six rounds of Delta_t for two leaves (a 2x2 kernel and a 3-vector). Coordinates chosen so that:
# - kernel[0, 0] is large then small: Yogi's v first grows (v < Delta^2) then shrinks (v > Delta^2);
# - kernel[0, 1] is about tau: v's tau^2 start matters;
# - bias[2] is always 0: the tau^2 start keeps its step at 0 / (tau + tau), not 0 / 0;
# - the others change sign between rounds.
DELTAS = [
    [np.array([[1.0, 0.05], [-0.4, 0.2]]), np.array([0.3, -0.7, 0.0])],
    [np.array([[0.8, -0.04], [0.5, -0.1]]), np.array([-0.2, -0.6, 0.0])],
    [np.array([[0.01, 0.06], [-0.3, 0.3]]), np.array([0.25, 0.1, 0.0])],
    [np.array([[0.02, 0.05], [0.2, -0.2]]), np.array([-0.3, -0.5, 0.0])],
    [np.array([[-0.01, -0.03], [0.1, 0.1]]), np.array([0.2, 0.4, 0.0])],
    [np.array([[0.03, 0.07], [-0.2, 0.05]]), np.array([-0.1, -0.3, 0.0])],
]
X0 = [np.array([[0.5, -1.0], [2.0, 0.1]]), np.array([0.0, 1.0, -0.5])]


def reddi_reference(rule, deltas, x0=X0, eta=ETA, beta_1=BETA_1, beta_2=BETA_2, tau=TAU):
  """Reddi et al.'s Algorithm 2 server steps in float64: per round (x_{t+1}, m_t, v_t, sign(v_{t-1} - Delta_t^2))."""
  x = [np.array(w, np.float64) for w in x0]
  m = [np.zeros_like(w) for w in x]
  v = [np.full_like(w, tau**2) for w in x]
  history = []
  for delta in deltas:
    signs = [np.sign(v_ - d * d) for v_, d in zip(v, delta)]
    m = [beta_1 * m_ + (1 - beta_1) * d for m_, d in zip(m, delta)]
    if rule == 'adam':
      v = [beta_2 * v_ + (1 - beta_2) * d * d for v_, d in zip(v, delta)]
    else:
      v = [v_ - (1 - beta_2) * d * d * s for v_, d, s in zip(v, delta, signs)]
    x = [x_ + eta * m_ / (np.sqrt(v_) + tau) for x_, m_, v_ in zip(x, m, v)]
    history.append((x, m, v, signs))
  return history


def tff_adam_reference(deltas, x0=X0, eta=ETA, beta_1=BETA_1, beta_2=BETA_2, epsilon=TAU):
  """TFF 0.87's `build_adam` as its docstring states it, on the gradient g = -Delta: v from 0, the learning rate
  times sqrt(1 - beta_2^t) / (1 - beta_1^t)."""
  w = [np.array(x, np.float64) for x in x0]
  acc = [np.zeros_like(x) for x in w]
  s = [np.zeros_like(x) for x in w]
  history = []
  for t, delta in enumerate(deltas, start=1):
    g = [-d for d in delta]
    acc = [beta_1 * a + (1 - beta_1) * g_ for a, g_ in zip(acc, g)]
    s = [beta_2 * s_ + (1 - beta_2) * g_ * g_ for s_, g_ in zip(s, g)]
    lr = eta * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
    w = [w_ - lr * a / (np.sqrt(s_) + epsilon) for w_, a, s_ in zip(w, acc, s)]
    history.append(w)
  return history


def run_optimizer(optimizer, deltas, x0=X0, dtype=tf.float64):
  """Our optimizer, eagerly, fed TFF's update -Delta_t each round: per round (weights, state)."""
  weights = [tf.constant(w, dtype) for w in x0]
  state = optimizer.initialize([tf.TensorSpec(w.shape, dtype) for w in weights])
  history = []
  for delta in deltas:
    state, weights = optimizer.next(state, weights, [tf.constant(-d, dtype) for d in delta])
    history.append(([w.numpy() for w in weights], state))
  return history


BUILDERS = {'adam': optimizers.build_reddi_adam, 'yogi': optimizers.build_reddi_yogi}


def build(rule, **kwargs):
  return BUILDERS[rule](kwargs.pop('learning_rate', ETA), beta_1=BETA_1, beta_2=BETA_2,
                        epsilon=kwargs.pop('epsilon', TAU), **kwargs)


def assert_all_close(got, want, **tolerance):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, **tolerance)


# ----------------------------------------------------------------------------------------------------------------
# The rule, step by step.


@pytest.mark.parametrize('rule', ['adam', 'yogi'])
def test_six_rounds_match_reddi_algorithm_2(rule):
  reference = reddi_reference(rule, DELTAS)
  got = run_optimizer(build(rule), DELTAS)
  for (weights, state), (x, m, v, _) in zip(got, reference):
    assert_all_close(weights, x, rtol=1e-12, atol=1e-14)
    assert_all_close(state[optimizers.FIRST_MOMENT], [-m_ for m_ in m], rtol=1e-12, atol=1e-15)  # m of -Delta.
    assert_all_close(state[optimizers.SECOND_MOMENT], v, rtol=1e-12, atol=1e-15)


def test_the_case_exercises_yogis_sign_rule_both_ways_and_differs_from_adam():
  # The data above are meant to exercise Yogi's sign rule in both directions on the same coordinate.
  yogi = reddi_reference('yogi', DELTAS)
  corner = [signs[0][0, 0] for _, _, _, signs in yogi]
  assert -1.0 in corner and 1.0 in corner, corner  # v_{t-1} < Delta_t^2, then v_{t-1} > Delta_t^2.
  adam = reddi_reference('adam', DELTAS)
  assert np.abs(yogi[-1][0][0] - adam[-1][0][0]).max() > 1e-2  # Adam's and Yogi's v, measurably apart.


def test_the_start_is_tau_squared_and_epsilon_is_the_denominators_tau():
  optimizer = build('adam')
  state = optimizer.initialize([tf.TensorSpec([2], tf.float64)])
  np.testing.assert_array_equal(state[optimizers.SECOND_MOMENT][0], [TAU**2, TAU**2])
  np.testing.assert_array_equal(state[optimizers.FIRST_MOMENT][0], [0.0, 0.0])
  # A coordinate whose updates are all 0 stays put (0 / (tau + tau), no 0 / 0); one Delta equal to tau moves it by
  # exactly eta (1 - beta_1) tau / (sqrt(beta_2 tau^2 + (1 - beta_2) tau^2) + tau) = eta (1 - beta_1) / 2.
  (weights, _), = run_optimizer(optimizer, [[np.array([0.0, TAU])]], x0=[np.array([1.0, 1.0])])
  np.testing.assert_allclose(weights[0], [1.0, 1.0 + ETA * (1 - BETA_1) / 2], rtol=1e-14)
  # Starting v at 0 instead (Adam's usual start) would give a step of eta (1 - beta_1) / (sqrt(1 - beta_2) + 1).
  assert abs(ETA * (1 - BETA_1) / 2 - ETA * (1 - BETA_1) / (np.sqrt(1 - BETA_2) + 1)) > 1e-3


def test_float32_in_a_tff_computation_matches_the_reference():
  optimizer = build('yogi')
  specs = [tf.TensorSpec(w.shape, tf.float32) for w in X0]
  weights_type = tff.to_type([tff.TensorType(np.float32, w.shape) for w in X0])

  @tff.tensorflow.computation()
  def initialize():
    return optimizer.initialize(specs)

  @tff.tensorflow.computation(initialize.type_signature.result, weights_type, weights_type)
  def next_fn(state, weights, update):
    return optimizer.next(state, weights, update)

  state, weights = initialize(), [w.astype(np.float32) for w in X0]
  for delta, (x, _, _, _) in zip(DELTAS, reddi_reference('yogi', DELTAS)):
    state, weights = next_fn(state, weights, [(-d).astype(np.float32) for d in delta])
    assert_all_close(weights, x, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# TFF's variant, pinned, so the difference is explicit.


def test_tffs_build_adam_is_bias_corrected_and_not_algorithm_2():
  tff_adam = tff.learning.optimizers.build_adam(ETA, beta_1=BETA_1, beta_2=BETA_2, epsilon=TAU)
  got = run_optimizer(tff_adam, DELTAS)
  for (weights, _), want in zip(got, tff_adam_reference(DELTAS)):
    # TFF does what its docstring says (to float32 rounding: `tf.cast` rounds its Python-float betas through
    # float32 even for float64 weights) ...
    assert_all_close(weights, want, rtol=1e-6, atol=1e-8)
  ours = reddi_reference('adam', DELTAS)
  # ... which differs from Algorithm 2 from round 1 (v from 0, not tau^2) and by the correction factor after.
  gap = max(np.abs(a - b).max() for a, b in zip(got[-1][0], ours[-1][0]))
  assert gap > 0.05, gap
  with pytest.raises(AssertionError):
    assert_all_close(got[1][0], ours[1][0], rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# Hyperparameters and checks.


def test_hparams_are_tffs_keys_and_set_hparams_changes_the_step():
  optimizer = build('adam')
  state = optimizer.initialize([tf.TensorSpec([3], tf.float64)])
  hparams = optimizer.get_hparams(state)
  assert list(hparams) == [tff.learning.optimizers.LEARNING_RATE_KEY, 'beta_1', 'beta_2', 'epsilon']
  assert [hparams[k] for k in hparams] == [ETA, BETA_1, BETA_2, TAU]
  halved = optimizer.set_hparams(state, collections.OrderedDict(learning_rate=ETA / 2))
  assert optimizer.get_hparams(halved)['learning_rate'] == ETA / 2 and halved['beta_1'] == BETA_1
  delta = [np.array([0.3, -0.2, 0.1])]
  _, full = optimizer.next(state, [tf.zeros([3], tf.float64)], [tf.constant(-delta[0])])
  _, half = optimizer.next(halved, [tf.zeros([3], tf.float64)], [tf.constant(-delta[0])])
  np.testing.assert_allclose(half[0].numpy(), full[0].numpy() / 2, rtol=1e-14)
  with pytest.raises(ValueError, match='unknown hyperparameters'):
    optimizer.set_hparams(state, {'momentum': 0.5})


@pytest.mark.parametrize('kwargs, name', [
    ({'learning_rate': -1.0}, 'learning_rate'), ({'beta_1': 1.5}, 'beta_1'), ({'beta_2': -0.1}, 'beta_2'),
    ({'epsilon': 0.0}, 'epsilon'), ({'epsilon': float('nan')}, 'epsilon'),
    ({'learning_rate': float('inf')}, 'learning_rate'), ({'beta_1': '0.9'}, 'beta_1'), ({'beta_2': 1.0}, 'beta_2'),
])
@pytest.mark.parametrize('builder', [optimizers.build_reddi_adam, optimizers.build_reddi_yogi])
def test_bad_hyperparameters_are_refused_naming_them(builder, kwargs, name):
  arguments = {'learning_rate': ETA, **kwargs}
  with pytest.raises(ValueError, match=name):
    builder(**arguments)


@pytest.mark.parametrize('weights', [[tf.zeros([2]), tf.zeros([1])], [tf.zeros([3])], [tf.zeros([2], tf.float64)]])
def test_weights_that_do_not_match_the_state_are_refused(weights):
  optimizer = build('adam')
  state = optimizer.initialize([tf.TensorSpec([2], tf.float32)])
  with pytest.raises(ValueError, match='first_moment does not match the weights'):
    optimizer.next(state, weights, weights)


# ----------------------------------------------------------------------------------------------------------------
# In TFF's processes: TFF's apply-optimizer finalizer and GMA's Algorithm 2 (`build_gma_fed_avg`).


def _processes_and_references(rule):
  """(process, reference rounds) pairs: TFF's FedAvg with our server optimizer (the mean), and GMA's Algorithm 2
  with it (the mask on the step), on gma_fed_avg_test's linear case (one analytic SGD step per client)."""
  server = lambda: BUILDERS[rule](gma_case.SERVER_LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=gma_case.EPSILON)
  fed_avg = tff.learning.algorithms.build_weighted_fed_avg(gma_case.linear_model_fn, gma_case.sgd(), server())
  gma = build_gma_fed_avg(gma_case.linear_model_fn, gma_case.sgd(), server(), tau=gma_case.TAU, mask='soft')
  return ((fed_avg, lambda updates: [np.ones_like(u) for u in updates[0]]),
          (gma, lambda updates: gma_case.gma_mask(updates, 'soft')))


@pytest.mark.parametrize('rule', ['adam', 'yogi'])
def test_tff_fed_avg_and_gma_algorithm_2_take_the_optimizer(rule):
  for process, mask_of in _processes_and_references(rule):
    state = process.initialize()
    hparams = process.get_hparams(state)['finalizer']
    assert float(hparams['learning_rate']) == pytest.approx(gma_case.SERVER_LR)
    state = process.set_hparams(state, process.get_hparams(state))  # Round trip through TFF's hparams plumbing.
    weights = [gma_case.INITIAL_KERNEL.astype(np.float64), gma_case.INITIAL_BIAS.astype(np.float64)]
    m = [np.zeros_like(w) for w in weights]
    v = [np.full_like(w, gma_case.EPSILON**2) for w in weights]
    for _ in range(2):
      updates, client_weights = gma_case.client_updates(weights)  # TFF's sign: x_t - y_i.
      delta = [-sum(s * u[i] for s, u in zip(client_weights, updates)) / client_weights.sum() for i in range(2)]
      m = [BETA_1 * m_ + (1 - BETA_1) * d for m_, d in zip(m, delta)]
      if rule == 'adam':
        v = [BETA_2 * v_ + (1 - BETA_2) * d * d for v_, d in zip(v, delta)]
      else:
        v = [v_ - (1 - BETA_2) * d * d * np.sign(v_ - d * d) for v_, d in zip(v, delta)]
      step = [gma_case.SERVER_LR * m_ / (np.sqrt(v_) + gma_case.EPSILON) for m_, v_ in zip(m, v)]
      weights = [w + mask * s for w, mask, s in zip(weights, mask_of(updates), step)]
      output = process.next(state, gma_case.datasets())
      state = output.state
      assert_all_close(process.get_model_weights(state).trainable, weights, rtol=1e-5, atol=1e-6)
      assert_all_close(state.finalizer[optimizers.SECOND_MOMENT], v, rtol=1e-5, atol=1e-9)
      assert output.metrics['finalizer']['update_non_finite'] == 0
