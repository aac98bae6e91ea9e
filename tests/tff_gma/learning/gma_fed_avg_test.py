"""`build_gma_fed_avg` (GMA paper, Algorithm 2) against a NumPy reference, TFF's FedAvg, and the audit.

The end-to-end reference uses a linear model with a squared loss, one batch per client and one local SGD step, so
a client's update is analytic: Delta_n = lr_c * grad = lr_c * (2 / B_n) [X_n^T r_n, sum r_n], r_n = X_n w + b - y_n.
The server part (weighted mean, sign agreement, mask, TFF's Adam and Yogi) is written out below from the paper
and from TFF's `optimizers/adam.py` / `yogi.py` (both bias-correct through the learning rate).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import audit
from tff_gma.aggregators import gradient_masked
from tff_gma.audit import policy as audit_policy
from tff_gma.learning import build_gma_fed_avg
from tff_gma.learning import gma_fed_avg

F32 = np.float32
DIM = 6
CLIENT_SIZES = (3, 5, 2, 4, 6)  # Batch sizes: the example-count weights differ.
# Five voters give agreements in {0, 0.2, 0.6, 1}: tau = 0.5 is never hit exactly, so float32 and float64 agree
# on every coordinate's side of it.
TAU = 0.5
CLIENT_LR = 0.1
SERVER_LR = 0.05
BETA_1, BETA_2, EPSILON = 0.9, 0.99, 1e-3
YOGI_INITIAL_PRECONDITIONER = 1e-6  # TFF's default.
# float32 process vs float64 reference: the steps are about SERVER_LR, computed to a few float32 ulps.
RTOL, ATOL = 1e-5, 1e-6
rng = np.random.default_rng(2)  # A seed whose clients disagree on several coordinates (4 of 7 in round 1).
INITIAL_KERNEL = rng.normal(size=(DIM, 1)).astype(F32)
INITIAL_BIAS = np.array([0.3], F32)
CLIENT_DATA = [(rng.normal(size=(n, DIM)).astype(F32), rng.normal(size=(n, 1)).astype(F32)) for n in CLIENT_SIZES]
INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, DIM], tf.float32), y=tf.TensorSpec([None, 1], tf.float32))


def linear_keras_model():
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(DIM,)),
      tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.Constant(INITIAL_KERNEL),
                            bias_initializer=tf.keras.initializers.Constant(INITIAL_BIAS))])


def linear_model_fn():
  return tff.learning.models.from_keras_model(linear_keras_model(), loss=tf.keras.losses.MeanSquaredError(),
                                              input_spec=INPUT_SPEC)


def functional_linear_model():
  """The same model as a `tff.learning.models.FunctionalModel` (TFF's builders take either kind)."""
  return tff.learning.models.functional_model_from_keras(
      linear_keras_model, loss_fn=tf.keras.losses.MeanSquaredError(), input_spec=INPUT_SPEC)


def datasets(client_data=CLIENT_DATA):
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(len(x))
          for x, y in client_data]


def sgd():
  return tff.learning.optimizers.build_sgdm(CLIENT_LR)


def adam():
  return tff.learning.optimizers.build_adam(SERVER_LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)


def yogi():
  return tff.learning.optimizers.build_yogi(SERVER_LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON,
                                            initial_preconditioner_value=YOGI_INITIAL_PRECONDITIONER)


SERVER_OPTIMIZERS = {'adam': adam, 'yogi': yogi}


# ----------------------------------------------------------------------------------------------------------------
# NumPy reference (float64).


def client_updates(weights):
  """Each client's update (kernel, bias) after one SGD step from `weights`, and its weight (examples)."""
  kernel, bias = weights
  updates = []
  for x, y in CLIENT_DATA:
    x, y = x.astype(np.float64), y.astype(np.float64)
    residual = x @ kernel + bias - y  # (B, 1)
    gradient = [2.0 / len(x) * x.T @ residual, 2.0 / len(x) * residual.sum(axis=0)]
    updates.append([CLIENT_LR * g for g in gradient])  # TFF's sign: initial - trained.
  return updates, np.array(CLIENT_SIZES, np.float64)


def gma_mask(updates, mask):
  """The GMA mask per leaf: A = |mean_n sign(Delta_n)|, 1 where A >= tau, else A (soft) or 0 (binary)."""
  result = []
  for leaf in zip(*updates):
    agreement = np.abs(np.mean([np.sign(u) for u in leaf], axis=0))
    result.append(np.where(agreement >= TAU, 1.0, agreement if mask == 'soft' else 0.0))
  return result


def adam_reference(state, weights, gradient):
  """TFF's Adam: moments a, p; bias correction folded into the learning rate."""
  step = state['step'] + 1
  a = [a + (g - a) * (1 - BETA_1) for a, g in zip(state['a'], gradient)]
  p = [p + (g * g - p) * (1 - BETA_2) for p, g in zip(state['p'], gradient)]
  lr = SERVER_LR * np.sqrt(1 - BETA_2**step) / (1 - BETA_1**step)
  return dict(step=step, a=a, p=p), [w - lr * a_ / (np.sqrt(p_) + EPSILON) for w, a_, p_ in zip(weights, a, p)]


def yogi_reference(state, weights, gradient):
  """TFF's Yogi: as Adam but p <- p + (1 - beta_2) sign(g^2 - p) g^2, p starting at the initial value."""
  step = state['step'] + 1
  a = [a + (g - a) * (1 - BETA_1) for a, g in zip(state['a'], gradient)]
  p = [p + (1 - BETA_2) * np.sign(g * g - p) * g * g for p, g in zip(state['p'], gradient)]
  lr = SERVER_LR * np.sqrt(1 - BETA_2**step) / (1 - BETA_1**step)
  return dict(step=step, a=a, p=p), [w - lr * a_ / (np.sqrt(p_) + EPSILON) for w, a_, p_ in zip(weights, a, p)]


OPTIMIZER_REFERENCES = {
    'adam': (adam_reference, 0.0),
    'yogi': (yogi_reference, YOGI_INITIAL_PRECONDITIONER),
}


def reference_rounds(optimizer, mask, rounds, mask_before_optimizer=False):
  """Per round: (weights, optimizer state, mask) of Algorithm 2, or of masking Delta before the optimizer."""
  step_fn, initial_p = OPTIMIZER_REFERENCES[optimizer]
  weights = [INITIAL_KERNEL.astype(np.float64), INITIAL_BIAS.astype(np.float64)]
  state = dict(step=0, a=[np.zeros_like(w) for w in weights], p=[np.full_like(w, initial_p) for w in weights])
  history = []
  for _ in range(rounds):
    updates, client_weights = client_updates(weights)
    mean = [sum(s * u[i] for s, u in zip(client_weights, updates)) / client_weights.sum() for i in range(2)]
    m = gma_mask(updates, mask)
    if mask_before_optimizer:
      state, weights = step_fn(state, weights, [mi * d for mi, d in zip(m, mean)])
    else:
      state, stepped = step_fn(state, weights, mean)  # The moments see the unmasked mean ...
      weights = [w + mi * (s - w) for w, s, mi in zip(weights, stepped, m)]  # ... the mask scales the step.
    history.append((weights, state, m))
  return history


def assert_weights_close(got, want, rtol=RTOL, atol=ATOL):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 2 end to end.


@pytest.mark.parametrize('optimizer', ['adam', 'yogi'])
@pytest.mark.parametrize('mask', ['soft', 'binary'])
def test_one_and_two_rounds_match_the_numpy_reference(optimizer, mask):
  process = build_gma_fed_avg(linear_model_fn, sgd(), SERVER_OPTIMIZERS[optimizer](), tau=TAU, mask=mask)
  reference = reference_rounds(optimizer, mask, rounds=2)
  # The data make the mask interesting: some coordinates disagree (masked), others agree.
  first_mask = np.concatenate([m.ravel() for m in reference[0][2]])
  assert 0 < np.mean(first_mask < 1) < 1
  if mask == 'soft':
    assert np.any((first_mask > 0) & (first_mask < 1))
  state = process.initialize()
  for weights, optimizer_state, m in reference:
    output = process.next(state, datasets())
    state = output.state
    assert_weights_close(process.get_model_weights(state).trainable, weights)
    # The optimizer's moments come from the unmasked mean.
    assert_weights_close(state.finalizer['accumulator'], optimizer_state['a'])
    assert_weights_close(state.finalizer['preconditioner'], optimizer_state['p'])
    assert state.finalizer['step'] == optimizer_state['step']
    aggregator = output.metrics['aggregator']
    flat_mask = np.concatenate([x.ravel() for x in m])
    np.testing.assert_allclose(aggregator['masked_fraction'], np.mean(flat_mask < 1), rtol=1e-6)
    assert (aggregator['participating_clients'], aggregator['dropped_clients']) == (len(CLIENT_SIZES), 0)
    assert output.metrics['finalizer']['update_non_finite'] == 0


def test_a_functional_model_trains_as_tffs_builder_accepts_it_and_matches_the_reference():
  model = functional_linear_model()
  tff.learning.algorithms.build_weighted_fed_avg(model, sgd(), adam())  # TFF's builder takes a functional model,
  process = build_gma_fed_avg(model, sgd(), adam(), tau=TAU, mask='soft')  # and so does this one.
  state = process.initialize()
  for weights, optimizer_state, m in reference_rounds('adam', 'soft', rounds=2):
    output = process.next(state, datasets())
    state = output.state
    assert_weights_close(process.get_model_weights(state).trainable, weights)
    assert_weights_close(state.finalizer['accumulator'], optimizer_state['a'])
    flat_mask = np.concatenate([x.ravel() for x in m])
    np.testing.assert_allclose(output.metrics['aggregator']['masked_fraction'], np.mean(flat_mask < 1), rtol=1e-6)


def test_masking_before_adam_is_measurably_not_algorithm_2():
  """The old placement (GradientMaskedFactory as model_aggregator, then Adam) fails the reference test above."""
  old = tff.learning.algorithms.build_weighted_fed_avg(
      linear_model_fn, sgd(), adam(), model_aggregator=aggregators.GradientMaskedFactory(tau=TAU, mask='soft'))
  state = old.next(old.initialize(), datasets()).state
  got = old.get_model_weights(state).trainable
  # It is what the reference computes for masking before the optimizer (so the reference models both) ...
  (before_weights, _, _), = reference_rounds('adam', 'soft', rounds=1, mask_before_optimizer=True)
  assert_weights_close(got, before_weights)
  # ... and far from Algorithm 2: Adam normalizes a soft-masked coordinate back to a full step.
  (algorithm_2_weights, _, _), = reference_rounds('adam', 'soft', rounds=1)
  assert max(np.max(np.abs(a - b)) for a, b in zip(before_weights, algorithm_2_weights)) > 100 * ATOL
  with pytest.raises(AssertionError):
    assert_weights_close(got, algorithm_2_weights)


@pytest.mark.parametrize('mask', ['soft', 'binary'])
def test_sgd_server_equals_fed_avg_with_the_drop_in_factory(mask):
  # With SGD the two placements are the same in exact arithmetic: w + m * ((w - lr * Delta) - w) here,
  # w - lr * (m * Delta) there. float32 rounds them differently by a few ulps of |w| (about 1e-7) per round, and
  # the second round's clients start from those weights: 1e-6 bounds it with room.
  server = lambda: tff.learning.optimizers.build_sgdm(0.5)
  ours = build_gma_fed_avg(linear_model_fn, sgd(), server(), tau=TAU, mask=mask)
  theirs = tff.learning.algorithms.build_weighted_fed_avg(
      linear_model_fn, sgd(), server(), model_aggregator=aggregators.GradientMaskedFactory(tau=TAU, mask=mask))
  ours_state, theirs_state = ours.initialize(), theirs.initialize()
  for _ in range(2):
    ours_output, theirs_output = ours.next(ours_state, datasets()), theirs.next(theirs_state, datasets())
    ours_state, theirs_state = ours_output.state, theirs_output.state
    for a, b in zip(ours.get_model_weights(ours_state).trainable, theirs.get_model_weights(theirs_state).trainable):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert ours_output.metrics['aggregator'] == theirs_output.metrics['aggregator']  # One implementation.
  assert np.any(np.asarray(ours.get_model_weights(ours_state).trainable[0]) != INITIAL_KERNEL)


def test_nan_client_never_reaches_the_model():
  # TFF's client work turns a diverged client into a zero update of weight 0: it neither votes nor moves the mean.
  nan_x = np.full((3, DIM), np.nan, F32)
  process = build_gma_fed_avg(linear_model_fn, sgd(), adam(), tau=TAU)
  with_nan = process.next(process.initialize(), datasets(CLIENT_DATA + [(nan_x, np.zeros((3, 1), F32))]))
  clean = process.next(process.initialize(), datasets())
  assert with_nan.metrics['aggregator']['participating_clients'] == len(CLIENT_SIZES)
  for a, b in zip(process.get_model_weights(with_nan.state).trainable,
                  process.get_model_weights(clean.state).trainable):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------
# The pieces.

WEIGHTS_TYPE = tff.to_type(tff.learning.models.ModelWeights(
    trainable=[tff.TensorType(np.float32, [2, 2]), tff.TensorType(np.float32, [2])],
    non_trainable=[tff.TensorType(np.float32, [1])]))
WEIGHTS = tff.learning.models.ModelWeights(
    trainable=[np.array([[1.0, -2.0], [0.5, 3.0]], F32), np.array([0.25, -1.0], F32)],
    non_trainable=[np.array([7.0], F32)])
MEAN = [np.array([[0.5, -0.1], [2.0, 0.0]], F32), np.array([-0.3, 1.0], F32)]


def update(mean, mask_value):
  return collections.OrderedDict(mean=mean, mask=[np.full(np.shape(x), mask_value, F32) for x in mean])


def test_aggregator_nan_client_is_dropped_and_counted():
  process = aggregators.GradientMaskedFactory(tau=TAU).create_mean_and_mask(
      WEIGHTS_TYPE.trainable, tff.TensorType(np.float32))
  values = [MEAN, [-x for x in MEAN], [np.full_like(x, np.nan) for x in MEAN]]
  output = process.next(process.initialize(), values, [F32(3.0), F32(1.0), F32(5.0)])
  assert output.measurements['dropped_clients'] == 1
  assert output.measurements['participating_clients'] == 2
  for got, x in zip(output.result['mean'], MEAN):
    np.testing.assert_allclose(got, (3.0 * x - x) / 4.0, rtol=1e-6)  # The NaN client is left out of the mean.
  for got in output.result['mask']:
    np.testing.assert_array_equal(got, 0.0)  # Opposite signs (or both 0) everywhere: A = 0.


def test_finalizer_steps_like_tff_where_mask_is_one_and_keeps_weights_where_zero():
  tff_finalizer = tff.learning.templates.build_apply_optimizer_finalizer(adam(), WEIGHTS_TYPE)
  finalizer = gma_fed_avg.build_gma_finalizer(adam(), WEIGHTS_TYPE)
  want = tff_finalizer.next(tff_finalizer.initialize(), WEIGHTS, MEAN)
  ones = finalizer.next(finalizer.initialize(), WEIGHTS, update(MEAN, 1.0))
  zeros = finalizer.next(finalizer.initialize(), WEIGHTS, update(MEAN, 0.0))
  half = finalizer.next(finalizer.initialize(), WEIGHTS, update(MEAN, 0.5))
  for w, a, b, z, h in zip(WEIGHTS.trainable, want.result.trainable, ones.result.trainable, zeros.result.trainable,
                           half.result.trainable):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(z, w)
    np.testing.assert_allclose(h, w + 0.5 * (a - w), rtol=1e-6, atol=1e-7)
  # Whatever the mask, the optimizer's state is TFF's: updated with the unmasked mean.
  for output in (ones, zeros, half):
    tf.nest.map_structure(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), output.state, want.state)
    np.testing.assert_array_equal(output.result.non_trainable[0], WEIGHTS.non_trainable[0])
    assert output.measurements['update_non_finite'] == 0


def test_finalizer_rejects_a_non_finite_mean_as_tff_does():
  finalizer = gma_fed_avg.build_gma_finalizer(adam(), WEIGHTS_TYPE)
  initial = finalizer.initialize()
  bad_mean = [MEAN[0], np.array([np.inf, 0.0], F32)]
  output = finalizer.next(initial, WEIGHTS, update(bad_mean, 1.0))
  assert output.measurements['update_non_finite'] == 1
  tf.nest.map_structure(np.testing.assert_array_equal, output.state, initial)
  for got, want in zip(output.result.trainable, WEIGHTS.trainable):
    np.testing.assert_array_equal(got, want)


def test_type_signatures_are_tff_fed_avgs():
  """State, client data and metrics types are those of TFF's FedAvg with the drop-in GMA factory."""
  process = build_gma_fed_avg(linear_model_fn, sgd(), adam(), tau=TAU)
  fed_avg = tff.learning.algorithms.build_weighted_fed_avg(
      linear_model_fn, sgd(), adam(), model_aggregator=aggregators.GradientMaskedFactory(tau=TAU))
  assert isinstance(process, tff.learning.templates.LearningProcess)
  for name in ('initialize', 'next', 'get_model_weights', 'set_model_weights', 'get_hparams', 'set_hparams'):
    ours, theirs = getattr(process, name).type_signature, getattr(fed_avg, name).type_signature
    assert ours.is_equivalent_to(theirs), (name, ours, theirs)

  weights_type = process.initialize.type_signature.result.member.global_model_weights
  aggregator, finalizer = gma_fed_avg.build_gma_server_processes(
      aggregators.GradientMaskedFactory(tau=TAU), adam(), weights_type)
  pair_type = gradient_masked.mean_and_mask_type(weights_type.trainable)
  assert aggregator.next.type_signature.result.result.is_equivalent_to(tff.FederatedType(pair_type, tff.SERVER))
  assert aggregator.next.type_signature.parameter[1].is_equivalent_to(
      tff.FederatedType(weights_type.trainable, tff.CLIENTS))
  tff_finalizer = tff.learning.templates.build_apply_optimizer_finalizer(adam(), weights_type)
  assert finalizer.initialize.type_signature.is_equivalent_to(tff_finalizer.initialize.type_signature)
  assert finalizer.next.type_signature.result.is_equivalent_to(tff_finalizer.next.type_signature.result)
  assert finalizer.next.type_signature.parameter[2].is_equivalent_to(tff.FederatedType(pair_type, tff.SERVER))

  # The finalizer takes the pair only: composed after a plain mean, TFF's composer refuses it.
  with pytest.raises(TypeError):
    tff.learning.templates.compose_learning_process(
        initial_weights_fn(),
        tff.learning.templates.build_broadcast_process(weights_type),
        tff.learning.templates.build_model_delta_client_work(linear_model_fn, sgd(),
                                                             tff.learning.ClientWeighting.NUM_EXAMPLES),
        tff.aggregators.MeanFactory().create(weights_type.trainable, tff.TensorType(np.float32)),
        finalizer)


def initial_weights_fn():
  @tff.tensorflow.computation()
  def weights_fn():
    return tff.learning.models.ModelWeights.from_model(linear_model_fn())
  return weights_fn


def test_model_weights_and_hparams_round_trip():
  process = build_gma_fed_avg(linear_model_fn, sgd(), adam(), tau=TAU)
  state = process.initialize()
  zeros = tff.learning.models.ModelWeights([np.zeros((DIM, 1), F32), np.zeros((1,), F32)], [])
  for w in process.get_model_weights(process.set_model_weights(state, zeros)).trainable:
    np.testing.assert_array_equal(w, 0)
  hparams = process.get_hparams(state)
  assert hparams['finalizer']['learning_rate'] == pytest.approx(SERVER_LR)
  hparams['finalizer']['learning_rate'] = 0.0
  frozen = process.set_hparams(state, hparams)
  after = process.next(frozen, datasets()).state  # Learning rate 0: the weights stay.
  for got, want in zip(process.get_model_weights(after).trainable, [INITIAL_KERNEL, INITIAL_BIAS]):
    np.testing.assert_array_equal(got, want)


def test_only_means_and_secure_sums_move_client_data():
  process = build_gma_fed_avg(linear_model_fn, sgd(), adam(), tau=TAU,
                              metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)
  report = audit.audit_computation(process.next)
  assert report.ok, report.to_markdown()
  intrinsics = {f.intrinsic for f in report.flows}
  assert 'federated_secure_sum' in intrinsics  # The sign codes and the client counts.
  assert intrinsics & audit_policy.MEAN_INTRINSICS  # The model update's weighted mean.
  assert intrinsics <= audit_policy.DEFAULT_ALLOWED_INTRINSICS


@pytest.mark.parametrize('kwargs, name', [
    (dict(client_optimizer_fn='sgd'), 'client_optimizer_fn'),
    (dict(server_optimizer_fn=0.1), 'server_optimizer_fn'),
    (dict(tau=1.5), 'tau'),
    (dict(mask='hard'), 'mask'),
    (dict(model_aggregator=aggregators.GradientMaskedFactory()), 'model_aggregator'),
    (dict(model_aggregator=tff.aggregators.UnweightedMeanFactory()), 'model_aggregator'),
    (dict(client_weighting='examples'), 'client_weighting'),
    (dict(loop_implementation='reduce'), 'loop_implementation'),
    (dict(model_fn=3), 'model_fn'),
    (dict(metrics_aggregator='secure'), 'metrics_aggregator'),
])
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
  arguments = dict(model_fn=linear_model_fn, client_optimizer_fn=sgd(), server_optimizer_fn=adam())
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=name):
    build_gma_fed_avg(**arguments)
