"""The shared pieces of the learning processes (`tff_gma.learning.client_lib`): checks, the plain-TF client
helpers against NumPy, the model types of a tiny Keras model, and one round of each composed process."""

import collections
import functools
import inspect

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.learning import client_lib

F32 = np.float32
INPUT_SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 3], tf.float32), y=tf.TensorSpec([None], tf.int32))
SHAPES = [(3, 2), (2,)]  # The tiny model's kernel and bias.


def tiny_keras():
  return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(3,)), tf.keras.layers.Dense(2)])


def tiny_model_fn():
  return tff.learning.models.from_keras_model(
      tiny_keras(), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), input_spec=INPUT_SPEC,
      metrics=[tf.keras.metrics.SparseCategoricalAccuracy()])


def _batch(n, seed):
  rng = np.random.default_rng(seed)
  return collections.OrderedDict(x=rng.normal(size=(n, 3)).astype(F32), y=rng.integers(0, 2, size=n).astype(np.int32))


def _numpy_gradient(kernel, bias, batch):
  """Gradient of the mean softmax cross-entropy of x @ kernel + bias, by hand."""
  x, y = batch['x'].astype(np.float64), batch['y']
  logits = x @ kernel + bias
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  d = (p - np.eye(2)[y]) / len(y)
  return x.T @ d, d.sum(axis=0)


def _weights(values):
  return tff.learning.models.ModelWeights(trainable=[tf.Variable(v) for v in values], non_trainable=[])


def test_check_optimizer():
  sgd = tff.learning.optimizers.build_sgdm(0.1)
  assert client_lib.check_optimizer(sgd, 'opt') is sgd
  for wrong in (tf.keras.optimizers.SGD(0.1), lambda: sgd, None):
    with pytest.raises(ValueError, match='server_opt must be a tff.learning.optimizers.Optimizer'):
      client_lib.check_optimizer(wrong, 'server_opt')


# ------------------------------------------------------------------------------------------ non-finite handling


def test_zero_all_if_any_non_finite_keeps_finite_structures():
  structure = collections.OrderedDict(a=tf.constant([1.5, -2.0]),
                                      b=(tf.constant(3.0), tf.constant([[4.0]], tf.float64)))
  out, flag = client_lib.zero_all_if_any_non_finite(structure)
  assert flag.dtype == tf.int32 and int(flag) == 0
  tf.nest.assert_same_structure(out, structure)
  for got, want in zip(tf.nest.flatten(out), tf.nest.flatten(structure)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('bad', [np.nan, np.inf, -np.inf])
def test_zero_all_if_any_non_finite_zeros_everything(bad):
  structure = (tf.constant([1.0, 2.0]), [tf.constant([[3.0, bad]], tf.float64)], tf.constant(7.0))
  out, flag = client_lib.zero_all_if_any_non_finite(structure)
  assert int(flag) == 1
  tf.nest.assert_same_structure(out, structure)
  for got, want in zip(tf.nest.flatten(out), tf.nest.flatten(structure)):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, np.zeros(want.shape))


def test_zero_all_if_any_non_finite_of_nothing_and_in_a_function():
  out, flag = client_lib.zero_all_if_any_non_finite(())
  assert out == () and int(flag) == 0
  fn = tf.function(client_lib.zero_all_if_any_non_finite)
  out, flag = fn((tf.constant([1.0, np.nan]),))
  assert int(flag) == 1 and np.array_equal(out[0], [0.0, 0.0])


def test_finish_client_update_is_initial_minus_trained():
  rng = np.random.default_rng(0)
  initial = [rng.normal(size=s).astype(F32) for s in SHAPES]
  trained = [rng.normal(size=s).astype(F32) for s in SHAPES]
  extra = (tf.constant([0.5, -1.0]),)
  update, weight, extra_out, non_finite = client_lib.finish_client_update(
      initial, _weights(trained), tf.constant(7, tf.int64), extra=extra)
  assert isinstance(update, tuple) and len(update) == 2
  for got, a, b in zip(update, initial, trained):
    np.testing.assert_allclose(got, a - b, rtol=1e-6)
  assert weight.dtype == tf.float32 and float(weight) == 7.0 and int(non_finite) == 0
  np.testing.assert_array_equal(extra_out[0], [0.5, -1.0])


@pytest.mark.parametrize('where', ['trained', 'extra'])
def test_finish_client_update_zeros_a_non_finite_client(where):
  trained = [np.ones(s, F32) for s in SHAPES]
  extra = (tf.constant([0.5, -1.0]),)
  if where == 'trained':
    trained[1][0] = np.nan
  else:
    extra = (tf.constant([0.5, np.inf]),)
  update, weight, extra_out, non_finite = client_lib.finish_client_update(
      [np.zeros(s, F32) for s in SHAPES], _weights(trained), tf.constant(5, tf.int64), extra=extra)
  assert int(non_finite) == 1 and float(weight) == 0.0
  for got, shape in zip(update, SHAPES):
    np.testing.assert_array_equal(got, np.zeros(shape))
  np.testing.assert_array_equal(extra_out[0], [0.0, 0.0])


def test_reset_metrics_if():
  model = tiny_model_fn()
  model.forward_pass(_batch(5, 0), training=False)
  client_lib.reset_metrics_if(model, tf.constant(0))
  assert int(model.report_local_unfinalized_metrics()['num_examples'][0]) == 5
  client_lib.reset_metrics_if(model, tf.constant(1))
  assert int(model.report_local_unfinalized_metrics()['num_examples'][0]) == 0


# ------------------------------------------------------------------------------------------------ plain TF pieces


@pytest.mark.parametrize('data,expected,known', [
    (tf.data.Dataset.range(10).batch(3), 4, True),
    (tf.data.Dataset.range(0).batch(3), 0, True),
    (tf.data.Dataset.range(10).filter(lambda v: v % 2 == 0).batch(2), 3, False),
    (tf.data.Dataset.range(7).filter(lambda v: v > 100), 0, False),
])
def test_count_batches(data, expected, known):
  assert (int(data.cardinality()) >= 0) == known
  count = client_lib.count_batches(data)
  assert count.dtype == tf.int64 and int(count) == expected
  assert int(tf.function(client_lib.count_batches)(data)) == expected


def test_gradients_or_zeros():
  variables = collections.OrderedDict(a=tf.Variable(np.ones((2, 3), F32)), b=tf.Variable(np.ones(4, F32)),
                                      c=tf.Variable(np.ones((3, 2), F32)))
  sparse = tf.IndexedSlices(tf.constant([[5.0, 6.0]]), tf.constant([1]), tf.constant([3, 2]))
  gradients = collections.OrderedDict(a=None, b=tf.constant([1.0, 2.0, 3.0, 4.0]), c=sparse)
  out = client_lib.gradients_or_zeros(gradients, variables)
  assert isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, tf.Tensor) for t in out)
  np.testing.assert_array_equal(out[0], np.zeros((2, 3)))
  np.testing.assert_array_equal(out[1], [1, 2, 3, 4])
  np.testing.assert_array_equal(out[2], [[0, 0], [5, 6], [0, 0]])
  # From a tape: a variable the loss does not reach gets zeros.
  v, unused = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]])
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(v * v)
  out = client_lib.gradients_or_zeros(tape.gradient(loss, [v, unused]), [v, unused])
  np.testing.assert_array_equal(out[0], [2.0, 4.0])
  np.testing.assert_array_equal(out[1], [[0.0]])


def test_batch_features_and_output_num_examples():
  batch = _batch(4, 0)
  assert client_lib.batch_features(batch) is batch['x']
  assert client_lib.batch_features((batch['x'], batch['y'])) is batch['x']
  predictions = tf.zeros([5, 2])
  out = client_lib.output_num_examples(tff.learning.models.BatchOutput(loss=0.0, predictions=predictions))
  assert out.dtype == tf.int64 and int(out) == 5
  out = client_lib.output_num_examples(
      tff.learning.models.BatchOutput(loss=0.0, predictions=predictions, num_examples=tf.constant(3)))
  assert out.dtype == tf.int64 and int(out) == 3


def test_assign_weights_and_zeros_like_trainable():
  weights = _weights([np.ones(s, F32) for s in SHAPES])
  values = tff.learning.models.ModelWeights(trainable=[np.full(s, 2.5, F32) for s in SHAPES], non_trainable=[])
  client_lib.assign_weights(weights, values)
  for variable, shape in zip(weights.trainable, SHAPES):
    np.testing.assert_array_equal(variable.numpy(), np.full(shape, 2.5))
  zeros = client_lib.zeros_like_trainable(weights)
  assert isinstance(zeros, tuple) and [tuple(z.shape) for z in zeros] == SHAPES
  assert all(z.dtype == tf.float32 and not np.any(z.numpy()) for z in zeros)


def test_optimizer_hparams_and_initial_state():
  assert client_lib.optimizer_hparams(tff.learning.optimizers.build_sgdm(0.1)) == {'learning_rate': 0.1}
  assert client_lib.optimizer_hparams(tff.learning.optimizers.build_sgdm(0.1, momentum=0.9)) == {
      'learning_rate': 0.1, 'momentum': 0.9}
  sgd = tff.learning.optimizers.build_sgdm(0.1, momentum=0.9)
  weights = _weights([np.ones(s, F32) for s in SHAPES])
  state = client_lib.initial_optimizer_state(sgd, weights)
  assert float(state['learning_rate']) == pytest.approx(0.1)
  assert [tuple(m.shape) for m in state['accumulator']] == SHAPES
  state = client_lib.initial_optimizer_state(sgd, weights, hparams=collections.OrderedDict(learning_rate=0.5,
                                                                                           momentum=0.0))
  assert float(state['learning_rate']) == 0.5 and float(state['momentum']) == 0.0


def test_optimizer_step_is_one_sgd_step():
  model = tiny_model_fn()
  weights = tff.learning.models.ModelWeights.from_model(model)
  kernel, bias = (v.numpy().astype(np.float64) for v in weights.trainable)
  sgd = tff.learning.optimizers.build_sgdm(0.3)
  state = client_lib.initial_optimizer_state(sgd, weights)
  for seed in (1, 2):  # Two steps on two batches.
    batch = _batch(6, seed)
    g_kernel, g_bias = _numpy_gradient(kernel, bias, batch)
    kernel, bias = kernel - 0.3 * g_kernel, bias - 0.3 * g_bias
    state, num_examples = client_lib.optimizer_step(sgd, state, model, weights, batch)
    assert num_examples.dtype == tf.int64 and int(num_examples) == 6
    np.testing.assert_allclose(weights.trainable[0].numpy(), kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights.trainable[1].numpy(), bias, rtol=1e-5, atol=1e-6)
  assert int(model.report_local_unfinalized_metrics()['num_examples'][0]) == 12  # Metrics updated.


# ------------------------------------------------------------------------------------------------- the local pass


def _numpy_sgd(kernel, bias, batches, lr, correction=None):
  """Plain SGD, one step per batch, on the tiny model from (kernel, bias); `correction` is added to each gradient."""
  for batch in batches:
    g_kernel, g_bias = _numpy_gradient(kernel, bias, batch)
    if correction is not None:
      g_kernel, g_bias = g_kernel + correction[0], g_bias + correction[1]
    kernel, bias = kernel - lr * g_kernel, bias - lr * g_bias
  return kernel, bias


def _ids_dataset(sizes):
  """Batches of the given sizes whose every x is the batch's index (1, 2, ...), y zero."""
  batches = [tf.data.Dataset.from_tensors(collections.OrderedDict(
      x=np.full((n, 3), i + 1, F32), y=np.zeros(n, np.int32))) for i, n in enumerate(sizes)]
  data = batches[0]
  for batch in batches[1:]:
    data = data.concatenate(batch)
  return data


def _recording_step(seen):
  """A step_fn that records each batch's index (eagerly into `seen`; in a graph into its state) and counts."""

  def step_fn(optimizer, optimizer_state, model, model_weights, batch):
    del optimizer, model, model_weights
    index = tf.cast(batch['x'][0, 0], tf.int64)
    if tf.executing_eagerly():
      seen.append(int(index))
    return optimizer_state * 10 + index, tf.shape(batch['x'], out_type=tf.int64)[0]

  return step_fn


@pytest.mark.parametrize('kind', ['dataset', 'iterator'])
@pytest.mark.parametrize('in_function', [False, True])
def test_local_pass_visits_the_batches_in_order_and_counts(kind, in_function):
  sizes = (3, 1, 4, 2)
  seen = []

  def run(data):
    batches = data if kind == 'dataset' else iter(data)
    return client_lib.local_pass(None, tf.constant(0, tf.int64), None, None, batches,
                                 step_fn=_recording_step(seen))

  result = (tf.function(run) if in_function else run)(_ids_dataset(sizes))
  assert isinstance(result, client_lib.LocalPassResult)
  assert int(result.optimizer_state) == 1234  # Each step saw the state of the one before: batches 1, 2, 3, 4.
  assert result.num_examples.dtype == tf.int64 and int(result.num_examples) == sum(sizes)
  assert result.num_steps.dtype == tf.int64 and int(result.num_steps) == len(sizes)
  if kind == 'iterator' and not in_function:  # Run eagerly, step by step (a reduce traces its step once).
    assert seen == [1, 2, 3, 4]


def test_local_pass_on_an_iterator_continues_where_it_stands():
  """Elastic's use: batches taken from the iterator before the pass are not trained on; the pass takes the rest."""
  iterator = iter(_ids_dataset((2, 2, 3, 1, 2)))
  taken = [int(iterator.get_next()['x'][0, 0]) for _ in range(2)]
  seen = []
  result = client_lib.local_pass(None, tf.constant(0, tf.int64), None, None, iterator, step_fn=_recording_step(seen))
  assert taken == [1, 2] and seen == [3, 4, 5]
  assert (int(result.optimizer_state), int(result.num_examples), int(result.num_steps)) == (345, 6, 3)
  empty = client_lib.local_pass(None, tf.constant(7, tf.int64), None, None, iterator, step_fn=_recording_step(seen))
  assert (int(empty.optimizer_state), int(empty.num_examples), int(empty.num_steps)) == (7, 0, 0)  # Exhausted.


@pytest.mark.parametrize('kind', ['dataset', 'iterator'])
def test_local_pass_is_local_sgd_against_numpy(kind):
  """The default step (`optimizer_step`) over three batches is three SGD steps, inside a tf.function too."""
  batches = [_batch(4, 1), _batch(4, 2), _batch(3, 3)]
  model = tiny_model_fn()
  weights = tff.learning.models.ModelWeights.from_model(model)
  kernel, bias = (v.numpy().astype(np.float64) for v in weights.trainable)
  sgd = tff.learning.optimizers.build_sgdm(0.3)

  @tf.function
  def run(data):
    state = client_lib.initial_optimizer_state(sgd, weights)
    return client_lib.local_pass(sgd, state, model, weights, data if kind == 'dataset' else iter(data))

  result = run(_dataset(batches[:2]).concatenate(_dataset(batches[2:])))
  want_kernel, want_bias = _numpy_sgd(kernel, bias, batches, 0.3)
  np.testing.assert_allclose(weights.trainable[0].numpy(), want_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights.trainable[1].numpy(), want_bias, rtol=1e-5, atol=1e-6)
  assert (int(result.num_examples), int(result.num_steps)) == (11, 3)
  assert float(result.optimizer_state['learning_rate']) == pytest.approx(0.3)
  assert int(model.report_local_unfinalized_metrics()['num_examples'][0]) == 11  # The steps' metrics.


def test_optimizer_step_applies_the_gradient_correction():
  """SCAFFOLD's hook: the optimizer sees gradient + correction (NumPy: SGD on the corrected gradient)."""
  batches = [_batch(5, 4), _batch(5, 5)]
  model = tiny_model_fn()
  weights = tff.learning.models.ModelWeights.from_model(model)
  kernel, bias = (v.numpy().astype(np.float64) for v in weights.trainable)
  correction = (np.full((3, 2), 0.25, F32), np.array([-0.5, 1.0], F32))
  sgd = tff.learning.optimizers.build_sgdm(0.2)
  step_fn = functools.partial(client_lib.optimizer_step, correct_gradients=lambda gradients: tuple(
      g + c for g, c in zip(gradients, correction)))
  result = client_lib.local_pass(sgd, client_lib.initial_optimizer_state(sgd, weights), model, weights,
                                 _dataset(batches), step_fn=step_fn)
  want_kernel, want_bias = _numpy_sgd(kernel, bias, batches, 0.2, correction)
  np.testing.assert_allclose(weights.trainable[0].numpy(), want_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights.trainable[1].numpy(), want_bias, rtol=1e-5, atol=1e-6)
  assert (int(result.num_examples), int(result.num_steps)) == (10, 2)


def test_every_composed_method_trains_through_local_pass(monkeypatch):
  """Elastic, FedGMA and SCAFFOLD make one local pass a round, personalized RFA two (one per phase)."""
  from tff_gma.learning import elastic, fedgma, personalized_rfa, scaffold  # pylint: disable=g-import-not-at-top
  calls = []
  real = client_lib.local_pass

  def counting(*args, **kwargs):
    calls.append('dataset' if isinstance(args[4], tf.data.Dataset) else 'iterator')
    return real(*args, **kwargs)

  monkeypatch.setattr(client_lib, 'local_pass', counting)
  sgd = tff.learning.optimizers.build_sgdm(0.1)
  weights = tff.learning.models.ModelWeights.from_model(tiny_model_fn())
  data = _dataset([_batch(2, 1), _batch(2, 2), _batch(2, 3)])
  zeros = tuple(np.zeros(s, F32) for s in SHAPES)
  runs = {
      'elastic': lambda: elastic.build_elastic_client_update(tiny_model_fn, 0.9, 0.3)(sgd, None, weights, data),
      'fedgma': lambda: fedgma.build_fedgma_client_update(tiny_model_fn, None)(sgd, None, weights, data),
      'personalized_rfa': lambda: personalized_rfa.build_personalized_client_update(tiny_model_fn, sgd)(
          weights, data, tf.data.Dataset.from_tensors(zeros)),
      'scaffold': lambda: scaffold.build_scaffold_client_update(
          tiny_model_fn, sgd, tff.learning.ClientWeighting.NUM_EXAMPLES)(
              weights, data, tf.data.Dataset.from_tensors(zeros), zeros),
  }
  # Elastic hands over the iterator its sensitivity batches came from; the others their round's dataset.
  expected = {'elastic': ['iterator'], 'fedgma': ['dataset'], 'personalized_rfa': ['dataset'] * 2,
              'scaffold': ['dataset']}
  for name, run in runs.items():
    calls.clear()
    run()
    assert calls == expected[name], name


def test_default_loop_implementation_is_the_iterator_and_gma_fed_avgs_default():
  from tff_gma import learning  # pylint: disable=g-import-not-at-top
  from tff_gma.learning import gma_fed_avg  # pylint: disable=g-import-not-at-top
  assert client_lib.DEFAULT_LOOP_IMPLEMENTATION is tff.learning.LoopImplementation.DATASET_ITERATOR
  assert learning.DEFAULT_LOOP_IMPLEMENTATION is client_lib.DEFAULT_LOOP_IMPLEMENTATION
  default = inspect.signature(gma_fed_avg.build_gma_fed_avg).parameters['loop_implementation'].default
  assert default is client_lib.DEFAULT_LOOP_IMPLEMENTATION


# ------------------------------------------------------------------------------------------------------ TFF types


def test_model_types_of_a_tiny_keras_model():
  types = client_lib.model_types(tiny_model_fn)
  trainable = tff.structure.flatten(types.trainable_type)
  assert [(t.dtype, tuple(t.shape)) for t in trainable] == [(np.float32, s) for s in SHAPES]
  assert types.weights_type.trainable == types.trainable_type
  assert not tff.structure.flatten(types.weights_type.non_trainable)
  batch = types.batch_type
  assert [name for name, _ in tff.structure.iter_elements(batch)] == ['x', 'y']
  assert batch.x == tff.TensorType(np.float32, [None, 3]) and batch.y == tff.TensorType(np.int32, [None])
  initial = types.initial_weights_fn()
  assert [np.shape(t) for t in initial.trainable] == SHAPES
  assert np.any(initial.trainable[0]) and not np.any(initial.trainable[1])  # Glorot kernel, zero bias.
  assert callable(types.metrics_aggregation_fn)  # Polymorphic; applied in the client-work round below.


def test_model_types_uses_the_given_metrics_aggregator():
  calls = []

  def aggregator(finalizers):
    calls.append(set(finalizers))
    return tff.learning.metrics.sum_then_finalize(finalizers)

  client_lib.model_types(tiny_model_fn, metrics_aggregator=aggregator)
  assert calls == [{'num_examples', 'num_batches', 'loss', 'sparse_categorical_accuracy'}]


@pytest.mark.parametrize('model_fn,aggregator,match', [
    (tiny_model_fn(), None, 'model_fn must be a no-argument callable'),
    (tiny_model_fn, 'sum', 'metrics_aggregator must be callable'),
    (tiny_keras, None, 'model_fn must return a tff.learning.models.VariableModel'),
])
def test_model_types_rejects(model_fn, aggregator, match):
  with pytest.raises(ValueError, match=match):
    client_lib.model_types(model_fn, aggregator)


def test_client_state_data_type():
  types = client_lib.model_types(tiny_model_fn)
  state_type, data_type = client_lib.client_state_data_type(types, 'kept')
  assert isinstance(state_type, tff.StructWithPythonType) and state_type.python_container is tuple
  assert [(t.dtype, tuple(t.shape)) for t in state_type] == [(np.float32, s) for s in SHAPES]
  assert [name for name, _ in tff.structure.iter_elements(state_type)] == [None, None]
  assert data_type.python_container is collections.OrderedDict
  assert [name for name, _ in tff.structure.iter_elements(data_type)] == [client_lib.BATCHES, 'kept']
  assert client_lib.BATCHES == 'batches'
  assert data_type.batches == tff.SequenceType(types.batch_type)
  assert data_type.kept == tff.SequenceType(state_type)


def test_broadcast_and_finalizer_processes_have_the_model_types():
  types = client_lib.model_types(tiny_model_fn)
  broadcast = client_lib.broadcast_process(types)
  assert isinstance(broadcast, tff.learning.templates.DistributionProcess)
  assert broadcast.next.type_signature.result.result.member == types.weights_type
  finalizer = client_lib.apply_optimizer_finalizer(tff.learning.optimizers.build_sgdm(1.0), types)
  assert isinstance(finalizer, tff.learning.templates.FinalizerProcess)
  assert finalizer.next.type_signature.result.result.member == types.weights_type


# ---------------------------------------------------------------------------------------------- composed rounds


def _dataset(batches):
  return tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=np.concatenate([b['x'] for b in batches]),
                              y=np.concatenate([b['y'] for b in batches]))).batch(len(batches[0]['y']))


def test_optimizer_client_work_runs_local_sgd_with_its_hparams():
  types = client_lib.model_types(tiny_model_fn)

  def build_client_update():
    model = tiny_model_fn()

    @tf.function
    def client_update(optimizer, hparams, initial_weights, data):
      weights = tff.learning.models.ModelWeights.from_model(model)
      client_lib.assign_weights(weights, initial_weights)

      def step(state, batch):
        count, optimizer_state = state
        optimizer_state, n = client_lib.optimizer_step(optimizer, optimizer_state, model, weights, batch)
        return count + n, optimizer_state

      count, _ = data.reduce((tf.constant(0, tf.int64), client_lib.initial_optimizer_state(
          optimizer, weights, hparams)), step)
      update, weight, _, _ = client_lib.finish_client_update(initial_weights.trainable, weights, count)
      return (tff.learning.templates.ClientResult(update=list(update), update_weight=weight),
              model.report_local_unfinalized_metrics())

    return client_update

  work = client_lib.optimizer_client_work(types, tff.learning.optimizers.build_sgdm(0.1), build_client_update)
  assert isinstance(work, tff.learning.templates.ClientWorkProcess)
  state = work.initialize()
  assert work.get_hparams(state) == {'learning_rate': pytest.approx(0.1)}
  state = work.set_hparams(state, collections.OrderedDict(learning_rate=0.5))  # Must reach the clients.
  initial = types.initial_weights_fn()
  batches = [[_batch(4, 1), _batch(4, 2)], [_batch(4, 3)]]
  output = work.next(state, [initial, initial], [_dataset(b) for b in batches])
  assert work.get_hparams(output.state) == {'learning_rate': 0.5}
  for result, client_batches in zip(output.result, batches):
    kernel, bias = (np.asarray(t, np.float64) for t in initial.trainable)
    for batch in client_batches:
      g_kernel, g_bias = _numpy_gradient(kernel, bias, batch)
      kernel, bias = kernel - 0.5 * g_kernel, bias - 0.5 * g_bias
    np.testing.assert_allclose(result.update[0], initial.trainable[0] - kernel, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.update[1], initial.trainable[1] - bias, rtol=1e-4, atol=1e-6)
    assert result.update_weight == 4 * len(client_batches)
  assert output.measurements['train']['num_examples'] == 12


def test_compose_with_client_state_returns_the_kept_values():
  types = client_lib.model_types(tiny_model_fn)
  state_type, data_type = client_lib.client_state_data_type(types, 'kept')

  @tff.tensorflow.computation(types.weights_type, data_type)
  def client_update(weights, data):
    # A toy client: kept values k (zeros if none), update k + 1, weight = number of batches, keeps k + 1.
    kept = data['kept'].reduce(tuple(tf.zeros_like(t) for t in weights.trainable), lambda _, k: tuple(k))
    plus_one = tuple(k + 1.0 for k in kept)
    weight = tf.cast(client_lib.count_batches(data[client_lib.BATCHES]), tf.float32)
    return tff.learning.templates.ClientResult(update=list(plus_one), update_weight=weight), plus_one

  @tff.federated_computation()
  def client_init():
    return tff.federated_value(np.int32(0), tff.SERVER)

  @tff.federated_computation(client_init.type_signature.result, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def client_round(state, weights, data):
    result, kept = tff.federated_map(client_update, (weights, data))
    return state, result, tff.federated_sum(result.update_weight), kept

  process = client_lib.compose_with_client_state(
      types, client_init, client_round, tff.aggregators.MeanFactory(), tff.learning.optimizers.build_sgdm(1.0),
      state_type, 'kept')
  assert isinstance(process, client_lib.LearningProcessWithClientState)
  assert isinstance(process, tff.learning.templates.LearningProcess)
  assert process.client_state_type == state_type and process.client_state_key == 'kept'
  assert process.next_with_client_state.type_signature.parameter[1].member == data_type

  state = process.initialize()
  w0 = [np.asarray(t) for t in process.get_model_weights(state).trainable]
  kept_b = tuple(np.full(s, 2.0, F32) for s in SHAPES)
  no_kept = tf.data.Dataset.from_tensors(tuple(np.zeros(s, F32) for s in SHAPES)).take(0)  # Empty: zeros.
  client_data = [
      collections.OrderedDict(batches=_dataset([_batch(2, 1), _batch(2, 2), _batch(2, 3)]), kept=no_kept),
      collections.OrderedDict(batches=_dataset([_batch(2, 4)]), kept=tf.data.Dataset.from_tensors(kept_b)),
  ]
  output = process.next_with_client_state(state, client_data)
  assert isinstance(output, client_lib.ClientStateOutput)
  # Updates 1 (weight 3 batches) and 3 (weight 1): weighted mean 1.5, applied by SGD with learning rate 1.
  new_weights = process.get_model_weights(output.state).trainable
  for got, start in zip(new_weights, w0):
    np.testing.assert_allclose(got, start - 1.5, rtol=1e-6)
  assert len(output.client_state) == 2
  for kept, value in zip(output.client_state, (1.0, 3.0)):
    assert [np.shape(k) for k in kept] == SHAPES
    for k in kept:
      np.testing.assert_array_equal(k, value)
  assert output.metrics['client_work'] == 4.0
  # The plain `next` runs the same round (dropping the kept values).
  plain = process.next(state, client_data)
  for got, want in zip(process.get_model_weights(plain.state).trainable, new_weights):
    np.testing.assert_allclose(got, want, rtol=1e-6)
