"""SCAFFOLD: the client's corrected steps and control variates against a direct reference, and rounds on digits."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import GeometricMedianFactory
from tff_gma.aggregators import GradientMaskedFactory
from tff_gma.learning import build_scaffold
from tff_gma.learning import scaffold
from tests.tff_gma import fixtures

F32 = np.float32
INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))


def tiny_keras():
  return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(3,)), tf.keras.layers.Dense(2)])


def tiny_model_fn():
  return tff.learning.models.from_keras_model(
      tiny_keras(), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec=INPUT_SPEC)


def sgd(lr, momentum=None):
  return tff.learning.optimizers.build_sgdm(lr, momentum=momentum)


def test_client_update_matches_reference():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(11, 3)).astype(F32)
  y = rng.integers(0, 2, size=11).astype(np.int32)
  batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(4)  # K = 3 steps.
  initial = tiny_model_fn()
  shapes = [v.shape for v in initial.trainable_variables]
  server_c = tuple(rng.normal(scale=0.1, size=s).astype(F32) for s in shapes)
  client_c = tuple(rng.normal(scale=0.1, size=s).astype(F32) for s in shapes)
  lr = 0.2
  update_fn = scaffold.build_scaffold_client_update(tiny_model_fn, sgd(lr), tff.learning.ClientWeighting.NUM_EXAMPLES)
  result, control_delta, new_control, _, participated = update_fn(
      tff.learning.models.ModelWeights.from_model(initial), batches,
      tf.data.Dataset.from_tensors(client_c), server_c)

  keras_model = tiny_keras()
  keras_model.set_weights([v.numpy() for v in initial.trainable_variables])
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for start in range(0, 11, 4):
    with tf.GradientTape() as tape:
      loss = loss_fn(y[start:start + 4], keras_model(x[start:start + 4], training=True))
    grads = tape.gradient(loss, keras_model.trainable_variables)
    for v, g, c, ci in zip(keras_model.trainable_variables, grads, server_c, client_c):
      v.assign_sub(lr * (g.numpy() - ci + c))
  expected_update = [a.numpy() - b.numpy() for a, b in zip(initial.trainable_variables,
                                                           keras_model.trainable_variables)]
  expected_new_control = [ci - c + u / (3 * lr) for ci, c, u in zip(client_c, server_c, expected_update)]

  for got, want in zip(result.update, expected_update):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
  for got, want in zip(new_control, expected_new_control):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
  for got, new, old in zip(control_delta, expected_new_control, client_c):
    np.testing.assert_allclose(got.numpy(), new - old, rtol=1e-4, atol=1e-5)
  assert float(result.update_weight) == 11
  assert int(participated) == 1


def test_empty_control_dataset_means_zero_and_empty_client_keeps_its_control():
  initial = tiny_model_fn()
  weights = tff.learning.models.ModelWeights.from_model(initial)
  shapes = [v.shape for v in initial.trainable_variables]
  server_c = tuple(np.full(s, 0.3, F32) for s in shapes)
  client_c = tuple(np.full(s, -0.2, F32) for s in shapes)
  update_fn = scaffold.build_scaffold_client_update(tiny_model_fn, sgd(0.1), tff.learning.ClientWeighting.UNIFORM)
  no_batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.zeros((0, 3), F32), y=np.zeros((0,), np.int32))).batch(4)
  result, delta, new_control, _, _ = update_fn(weights, no_batches, tf.data.Dataset.from_tensors(client_c), server_c)
  assert float(result.update_weight) == 0
  for d, c, old in zip(delta, new_control, client_c):
    assert not np.any(d.numpy())
    np.testing.assert_array_equal(c.numpy(), old)
  # An empty control dataset is c_i = 0.
  one_batch = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.ones((2, 3), F32), y=np.zeros((2,), np.int32))).batch(4)
  empty = tf.data.Dataset.from_tensors(client_c).take(0)
  result, delta, new_control, _, _ = update_fn(weights, one_batch, empty, server_c)
  assert float(result.update_weight) == 1  # UNIFORM weighting.
  for d, c in zip(delta, new_control):
    np.testing.assert_allclose(c.numpy(), d.numpy())


def test_server_control_update():
  c = (tf.constant([1.0, 2.0]),)
  mean_delta = (tf.constant([0.5, -1.0]),)
  np.testing.assert_allclose(scaffold.server_control_update(c, mean_delta, tf.constant(2), None)[0], [1.5, 1.0])
  np.testing.assert_allclose(scaffold.server_control_update(c, mean_delta, tf.constant(2), 8)[0], [1.125, 1.75])


@pytest.fixture(scope='module')
def digits_setup():
  return fixtures.digits_logistic(4)


def test_scaffold_learns_and_keeps_client_controls(digits_setup):
  data, build_keras, model_fn = digits_setup
  process = build_scaffold(model_fn, sgd(0.1), server_lr=1.0)
  assert isinstance(process, tff.learning.templates.LearningProcess)
  store = fixtures.ClientStateHolder(process)  # Checks each returned c_i+ against `process.client_state_type`.
  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  client_ids = list(data.train.client_ids)
  state = process.initialize()
  for round_num in range(3):
    state, metrics = store.run_round(process, state, client_ids, fixtures.round_datasets(data.train, round_num))
    assert metrics['client_work']['participating_clients'] == 4
    assert metrics['client_work']['server_control_norm'] > 0
  assert evaluate(process.get_model_weights(state))['accuracy'] > 0.6
  # Full participation from c = c_i = 0: the server control is the mean of the clients' controls.
  server_c = state.client_work['control_variate']
  for j, c in enumerate(server_c):
    np.testing.assert_allclose(c, np.mean([store.get(cid)[j] for cid in client_ids], axis=0), atol=1e-6)
  assert len(store) == 4 and all(np.any(store.get(cid)[0]) for cid in client_ids)

  # The plain LearningProcess `next` runs the same round (the clients' new controls are not returned).
  datasets = [store.client_data(cid, ds) for cid, ds in zip(client_ids, fixtures.round_datasets(data.train, 3))]
  plain = process.next(state, datasets)
  with_controls = process.next_with_client_state(state, datasets)
  assert len(with_controls.client_state) == 4
  weights = tff.learning.models.ModelWeights(
      [np.zeros_like(w) for w in process.get_model_weights(plain.state).trainable], [])
  assert not np.any(process.get_model_weights(process.set_model_weights(plain.state, weights)).trainable[0])


@pytest.mark.parametrize('aggregator', ['gma', 'geometric_median'])
def test_scaffold_with_project_aggregators(digits_setup, aggregator):
  data, build_keras, model_fn = digits_setup
  factory = GradientMaskedFactory(tau=0.4) if aggregator == 'gma' else GeometricMedianFactory(num_passes=3)
  process = build_scaffold(model_fn, sgd(0.1), server_lr=1.0, model_aggregator=factory, num_clients=4)
  store = fixtures.ClientStateHolder(process)
  state = process.initialize()
  client_ids = list(data.train.client_ids)
  for round_num in range(2):
    state, metrics = store.run_round(process, state, client_ids, fixtures.round_datasets(data.train, round_num))
    if aggregator == 'gma':
      assert 0 <= metrics['aggregator']['masked_fraction'] <= 1
      assert metrics['aggregator']['participating_clients'] == 4
  evaluate = fixtures.central_evaluator(build_keras, data.test_x, data.test_y)
  assert evaluate(process.get_model_weights(state))['accuracy'] > 0.4


def test_invalid_arguments(digits_setup):
  _, _, model_fn = digits_setup
  # The client optimizer is an optimizer, not its rate nor a function building one.
  for not_an_optimizer in (0.1, lambda: sgd(0.1)):
    with pytest.raises(ValueError, match='^client_optimizer_fn must be a tff.learning.optimizers.Optimizer'):
      build_scaffold(model_fn, not_an_optimizer)
  with pytest.raises(ValueError, match='server_lr'):
    build_scaffold(model_fn, sgd(0.1), server_lr=-1.0)
  with pytest.raises(ValueError, match='num_clients'):
    build_scaffold(model_fn, sgd(0.1), num_clients=0)
  with pytest.raises(ValueError, match='model_aggregator'):
    build_scaffold(model_fn, sgd(0.1), model_aggregator='mean')


# ----------------------------------------------------------------------------------------------------------------
# Client momentum and client weighting, against a NumPy reference written from the paper (Algorithm 1) on the tiny
# linear softmax model above: logits = x W + b, mean cross-entropy per batch.


def _numpy_gradients(w, b, x, y):
  """The mean cross-entropy's gradients (dW, db) for logits x W + b."""
  logits = x @ w + b
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  return [x.T @ p / len(y), p.mean(axis=0)]


def _numpy_client(params, x, y, batch, lr, momentum, server_c, client_c):
  """SCAFFOLD's local path with SGD(+momentum) on g - c_i + c: (Delta = x - y, the raw minibatch gradients)."""
  current = [p.astype(np.float64) for p in params]
  accumulator = [np.zeros_like(p) for p in current]
  gradients = []
  for start in range(0, len(y), batch):
    g = _numpy_gradients(current[0], current[1], x[start:start + batch].astype(np.float64), y[start:start + batch])
    gradients.append(g)
    corrected = [gj - ci + c for gj, ci, c in zip(g, client_c, server_c)]
    accumulator = [momentum * a + d for a, d in zip(accumulator, corrected)]  # momentum 0: plain SGD.
    current = [p - lr * a for p, a in zip(current, accumulator)]
  return [p0 - p for p0, p in zip(params, current)], gradients


def _tiny_client_setup(seed=0, n=11):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(F32)
  y = rng.integers(0, 2, size=n).astype(np.int32)
  model = tiny_model_fn()
  params = [v.numpy() for v in model.trainable_variables]
  server_c = tuple(rng.normal(scale=0.1, size=p.shape).astype(F32) for p in params)
  client_c = tuple(rng.normal(scale=0.1, size=p.shape).astype(F32) for p in params)
  return x, y, model, params, server_c, client_c


def _run_client(model, x, y, batch, lr, momentum, server_c, client_c):
  update_fn = scaffold.build_scaffold_client_update(tiny_model_fn, sgd(lr, momentum),
                                                    tff.learning.ClientWeighting.NUM_EXAMPLES)
  batches = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(batch)
  result, delta, new_control, _, _ = update_fn(tff.learning.models.ModelWeights.from_model(model), batches,
                                               tf.data.Dataset.from_tensors(client_c), server_c)
  return [u.numpy() for u in result.update], [d.numpy() for d in delta], [c.numpy() for c in new_control]


def test_without_momentum_the_control_variate_is_option_ii():
  x, y, model, params, server_c, client_c = _tiny_client_setup()
  lr, batch = 0.2, 4  # K = 3 steps.
  update, delta, new_control = _run_client(model, x, y, batch, lr, 0.0, server_c, client_c)
  want_update, _ = _numpy_client(params, x, y, batch, lr, 0.0, server_c, client_c)
  option_ii = [ci - c + u / (3 * lr) for ci, c, u in zip(client_c, server_c, want_update)]  # The paper's formula.
  for got, want in zip(update, want_update):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for got, want in zip(new_control, option_ii):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  for got, new, old in zip(delta, option_ii, client_c):
    np.testing.assert_allclose(got, new - old, rtol=1e-4, atol=1e-5)


def test_with_momentum_the_steps_are_sgdm_and_the_control_variate_is_the_mean_gradient():
  x, y, model, params, server_c, client_c = _tiny_client_setup(seed=1, n=13)
  lr, batch, momentum = 0.2, 3, 0.9  # K = 5 steps.
  update, delta, new_control = _run_client(model, x, y, batch, lr, momentum, server_c, client_c)
  want_update, gradients = _numpy_client(params, x, y, batch, lr, momentum, server_c, client_c)
  mean_gradient = [np.mean([g[j] for g in gradients], axis=0) for j in range(2)]
  for got, want in zip(update, want_update):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for got, want in zip(new_control, mean_gradient):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  for got, want, old in zip(delta, mean_gradient, client_c):
    np.testing.assert_allclose(got, want - old, rtol=1e-4, atol=1e-6)
  # Option II's formula would be off here by the momentum's amplification: the reference tells the two apart.
  option_ii = [ci - c + u / (5 * lr) for ci, c, u in zip(client_c, server_c, want_update)]
  assert max(np.max(np.abs(a - b)) for a, b in zip(option_ii, mean_gradient)) > 0.05
  # And momentum changes the local path (the run at 0 differs).
  plain, _, _ = _run_client(tiny_model_fn(), x, y, batch, lr, 0.0, server_c, client_c)
  assert max(np.max(np.abs(a - b)) for a, b in zip(plain, update)) > 1e-3


@pytest.mark.parametrize('weighting', [tff.learning.ClientWeighting.UNIFORM, tff.learning.ClientWeighting.NUM_EXAMPLES])
def test_client_weighting_of_the_model_updates(weighting):
  rng = np.random.default_rng(2)
  sizes, lr, server_lr, batch = (3, 9), 0.1, 1.0, 4
  data = [(rng.normal(size=(n, 3)).astype(F32), rng.integers(0, 2, size=n).astype(np.int32)) for n in sizes]
  process = build_scaffold(tiny_model_fn, sgd(lr), server_lr=server_lr, client_weighting=weighting)
  store = fixtures.ClientStateHolder(process)
  state = process.initialize()
  params = list(process.get_model_weights(state).trainable)
  zeros = [np.zeros_like(p) for p in params]
  datasets = [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(batch) for x, y in data]
  state, _ = store.run_round(process, state, ['a', 'b'], datasets)
  # Round one: c = c_i = 0, so each client's path is plain SGD; the server applies x - server_lr * mean(Delta_i).
  deltas = [_numpy_client(params, x, y, batch, lr, 0.0, zeros, zeros)[0] for x, y in data]
  weights = np.ones(2) if weighting == tff.learning.ClientWeighting.UNIFORM else np.array(sizes, float)
  for j, (p, got) in enumerate(zip(params, process.get_model_weights(state).trainable)):
    mean = sum(w * d[j] for w, d in zip(weights, deltas)) / weights.sum()
    np.testing.assert_allclose(got, p - server_lr * mean, rtol=1e-5, atol=1e-6)


def test_secure_control_mean_equals_the_plain_one_within_the_secure_bound():
  """secure=True: the control deltas' mean goes through the secure mean; the new server control is the plain
  (`federated_mean`) one to within `secure_mean.error_bound` for weight-1 clients (round one, c = c_i = 0: the
  server control is the mean of the clients' mean gradients, computed here in NumPy from the paper's rule)."""
  from tff_gma.aggregators import secure_mean  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  sizes, lr, batch, bound = (4, 7, 5), 0.1, 3, 2.0
  data = [(rng.normal(size=(n, 3)).astype(F32), rng.integers(0, 2, size=n).astype(np.int32)) for n in sizes]
  datasets = [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y)).batch(batch) for x, y in data]
  params = [rng.normal(scale=0.3, size=(3, 2)).astype(F32), rng.normal(scale=0.3, size=(2,)).astype(F32)]
  controls = {}
  for secure in (False, True):
    process = build_scaffold(tiny_model_fn, sgd(lr), server_lr=1.0, secure=secure,
                             value_bound=bound if secure else None)
    store = fixtures.ClientStateHolder(process)
    state = process.set_model_weights(process.initialize(), tff.learning.models.ModelWeights(params, []))
    state, _ = store.run_round(process, state, ['a', 'b', 'c'], datasets)
    controls[secure] = [np.asarray(c) for c in state.client_work['control_variate']]
  zeros = [np.zeros_like(p) for p in params]
  client_controls = []  # c_i+ = the mean of the client's minibatch gradients (option II without momentum).
  for x, y in data:
    gradients = _numpy_client(params, x, y, batch, lr, 0.0, zeros, zeros)[1]
    client_controls.append([np.mean([g[j] for g in gradients], axis=0) for j in range(len(params))])
  for j, (plain, secure) in enumerate(zip(controls[False], controls[True])):
    values = np.stack([c[j] for c in client_controls])
    assert np.abs(values).max() < bound  # Nothing clipped: the bound below is the whole difference.
    reference = values.mean(axis=0)
    np.testing.assert_allclose(plain, reference, rtol=1e-5, atol=1e-6)
    tolerance = secure_mean.error_bound(len(sizes), float(len(sizes)), bound, 1.0, np.abs(reference),
                                        np.abs(values).max(axis=0))
    assert np.all(np.abs(secure - reference) <= tolerance + 1e-6), (secure - reference, tolerance)
    assert not np.array_equal(secure, plain) or np.all(reference == 0)  # The secure path ran (quantized).


def test_secure_needs_a_value_bound():
  with pytest.raises(ValueError, match='value_bound'):
    build_scaffold(tiny_model_fn, sgd(0.1), secure=True)
