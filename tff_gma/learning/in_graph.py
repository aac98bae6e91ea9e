"""The FedAvg family's client work with its local epochs as one in-graph loop over the client's examples.

For small models TFF's dataset loop over `tf.Variable`s costs more than the arithmetic; this computes the same
update (the same batches in order, bit for bit) with the examples read once into tensors, a functional model and
one `tf.while_loop`, and keeps TFF's client work's state, metrics and intrinsics. Which models it takes:
`in_graph_support`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import tff_internals
from tff_gma.learning import client_lib
from tff_gma.learning import fed_prox

VariableModelFn = Callable[[], tff.learning.models.VariableModel]


def read_batches(dataset: tf.data.Dataset) -> tuple[Any, tf.Tensor]:
  """(examples, offsets): every batch of `dataset` concatenated along axis 0, and the int32 batch boundaries.

  Batch i is `examples[offsets[i]:offsets[i + 1]]` for every leaf: one pass over the dataset, each example held
  once. An empty dataset gives zero-length leaves and `offsets == [0]`.
  """
  spec = dataset.element_spec
  leaves = tf.nest.flatten(spec)
  arrays = tuple(tf.TensorArray(s.dtype, size=0, dynamic_size=True, infer_shape=False,
                                element_shape=tf.TensorShape([None]).concatenate(s.shape[1:])) for s in leaves)
  sizes = tf.TensorArray(tf.int32, size=0, dynamic_size=True)

  def append(state, batch):
    arrays, sizes, i = state
    flat = tf.nest.flatten(batch)
    arrays = tuple(a.write(i, t) for a, t in zip(arrays, flat))
    return arrays, sizes.write(i, tf.shape(flat[0])[0]), i + 1

  arrays, sizes, count = dataset.reduce((arrays, sizes, tf.constant(0)), append)
  examples = tf.nest.pack_sequence_as(spec, [
      tf.cond(count > 0, a.concat, lambda s=s: tf.zeros(tf.TensorShape([0]).concatenate(s.shape[1:]), s.dtype))
      for a, s in zip(arrays, leaves)])
  offsets = tf.concat([[0], tf.cumsum(tf.cond(count > 0, sizes.stack, lambda: tf.zeros([0], tf.int32)))], 0)
  return examples, offsets


# Keras layers that draw random numbers in training (Dropout covers SpatialDropout*).
_RANDOM_LAYERS = (tf.keras.layers.Dropout, tf.keras.layers.GaussianNoise, tf.keras.layers.GaussianDropout,
                  tf.keras.layers.AlphaDropout)


def _split(batch) -> tuple[Any, Any]:
  if isinstance(batch, Mapping):
    return batch['x'], batch['y']
  return batch[0], batch[1]


def in_graph_support(model_fn: VariableModelFn, functional_model: Optional[tff.learning.models.FunctionalModel]
                     ) -> Optional[str]:
  """None when the in-graph loop can train this model, else why not (one line, for the caller's log).

  The loop needs a model without non-trainable weights, without layer losses (regularizers) and without layers
  that draw random numbers in training (Dropout and kin), whose functional twin's trainable weights match the
  variable model's in order and shape, and data elements `(x, y)` or `{'x', 'y'}` with a first (batch) axis.
  """
  if functional_model is None:
    return 'no functional model (tff.learning.models.functional_model_from_keras) was given for it'
  with tf.Graph().as_default():
    model = model_fn()
    if not hasattr(model, 'get_metrics'):
      return 'its training metrics are not Keras metric objects (not a from_keras_model model)'
    trainable = [tuple(v.shape) for v in model.trainable_variables]
    if model.non_trainable_variables:
      return 'it has non-trainable weights, which the loop does not carry'
    keras_model = tff_internals.keras_model_of(model)
    random = sorted({type(layer).__name__ for layer in (keras_model.submodules if keras_model is not None else ())
                     if isinstance(layer, _RANDOM_LAYERS)})
    if random:  # Its functional twin would draw other random numbers than the variable model's iterator loop.
      return f'its {", ".join(random)} layers draw random numbers in training, which the loop would draw differently'
  functional_trainable, functional_non_trainable = functional_model.initial_weights
  if functional_non_trainable:
    return 'its functional model has non-trainable weights, which the loop does not carry'
  if [tuple(np.shape(w)) for w in functional_trainable] != trainable:
    return 'its functional model\'s trainable weights differ in order or shape from the variable model\'s'
  return None


def build_in_graph_update(
    model_fn: VariableModelFn,
    functional_model: tff.learning.models.FunctionalModel,
    *,
    weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    proximal_strength: float = 0.0,
):
  """The client update as a `tf.function` (optimizer, initial_weights, data, optimizer_hparams=None) ->
  (ClientResult, unfinalized metrics): TFF's model-delta update (FedProx's, `fed_prox.build_fed_prox_update`'s, with
  `proximal_strength` > 0), its local epochs as one `tf.while_loop` over `read_batches(data)`
  (`build_examples_update`'s).

  Builds its variable model (the metrics' home) once, at call time of this function, as TFF's update builders do.
  """
  on_examples = _update_on_examples(model_fn, functional_model, weighting, proximal_strength)

  @tf.function(autograph=False)  # Graph code as written: AutoGraph cost seconds at every build.
  def client_update(optimizer, initial_weights, data, optimizer_hparams=None):
    examples, offsets = read_batches(data)
    return on_examples(optimizer, initial_weights, examples, offsets, optimizer_hparams)

  return client_update


def build_examples_update(
    model_fn: VariableModelFn,
    functional_model: tff.learning.models.FunctionalModel,
    *,
    weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    proximal_strength: float = 0.0,
):
  """`build_in_graph_update`'s update on a client's batches already read (`read_batches`' pair):
  a `tf.function` (optimizer, initial_weights, examples, offsets, optimizer_hparams=None) -> (ClientResult,
  unfinalized metrics). For callers that hold the examples as tensors (e.g. fed to a TF1 session: TFF 0.87's
  functional Keras model predicts only inside a graph, never under eager TF).
  """
  return tf.function(_update_on_examples(model_fn, functional_model, weighting, proximal_strength), autograph=False)


def _update_on_examples(model_fn, functional_model, weighting, proximal_strength):
  """The update's Python function (traced by the caller's `tf.function`); builds its variable model now."""
  proximal_strength = fed_prox.check_proximal_strength(proximal_strength)
  model = model_fn()
  metrics = model.get_metrics()

  def client_update(optimizer, initial_weights, examples, offsets, optimizer_hparams=None):
    model.reset_metrics()  # A fresh client: a caller that reuses this function reuses the metric variables.
    initial = tuple(tf.nest.flatten(initial_weights.trainable))
    non_trainable = tuple(tf.nest.flatten(initial_weights.non_trainable))
    x_all, y_all = _split(examples)
    optimizer_state = optimizer.initialize(tuple(tf.TensorSpec(w.shape, w.dtype) for w in initial))
    if optimizer_hparams is not None:
      optimizer_state = optimizer.set_hparams(optimizer_state, optimizer_hparams)

    def step(i, weights, optimizer_state, num_examples):
      begin, end = offsets[i], offsets[i + 1]
      x = tf.nest.map_structure(lambda t: t[begin:end], x_all)
      y = tf.nest.map_structure(lambda t: t[begin:end], y_all)
      with tf.GradientTape() as tape:
        tape.watch(weights)
        predictions = functional_model.predict_on_batch((weights, non_trainable), x, training=True)
        loss = functional_model.loss(output=predictions, label=y)
      gradients = tape.gradient(loss, weights)
      # FedProx's term, + mu * (w - w_t) (`build_fed_prox_update`'s, so both loops give the same weights).
      gradients = fed_prox.add_proximal_term(gradients, weights, initial, proximal_strength)
      optimizer_state, weights = optimizer.next(optimizer_state, weights, gradients)
      for metric in metrics:
        metric.update_state(y_true=y, y_pred=predictions)
      return i + 1, tuple(weights), optimizer_state, num_examples + tf.cast(end - begin, tf.int64)

    num_batches = tf.shape(offsets)[0] - 1
    _, trained, _, num_examples = tf.while_loop(
        lambda i, *_: i < num_batches, step, (tf.constant(0), initial, optimizer_state, tf.constant(0, tf.int64)))
    update = tuple(a - b for a, b in zip(initial, trained))
    update, non_finite = _zero_if_non_finite(update)
    if weighting == tff.learning.ClientWeighting.NUM_EXAMPLES:
      weight = tf.cond(tf.equal(non_finite, 0), lambda: tf.cast(num_examples, tf.float32), lambda: 0.0)
    else:
      weight = tf.cond(tf.equal(non_finite, 0), lambda: 1.0, lambda: 0.0)
    tf.cond(non_finite > 0, lambda: _reset_metrics(model), lambda: tf.constant(False))
    return (tff.learning.templates.ClientResult(
        update=tf.nest.pack_sequence_as(initial_weights.trainable, update), update_weight=weight),
            model.report_local_unfinalized_metrics())

  return client_update


def _reset_metrics(model: tff.learning.models.VariableModel) -> tf.Tensor:
  """Zeroes the model's metrics (a non-finite client reports none, as TFF's client work); a `tf.cond` branch."""
  model.reset_metrics()
  return tf.constant(True)


def _zero_if_non_finite(values: tuple[tf.Tensor, ...]) -> tuple[tuple[tf.Tensor, ...], tf.Tensor]:
  """(values, 0), or (zeros, 1) when any value is NaN or Inf (TFF's `zero_all_if_any_non_finite`)."""
  finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
  zeroed = tf.cond(finite, lambda: values, lambda: tuple(tf.zeros_like(v) for v in values))
  return zeroed, tf.cast(tf.logical_not(finite), tf.int32)


def build_in_graph_client_work(
    model_fn: VariableModelFn,
    functional_model: tff.learning.models.FunctionalModel,
    optimizer: tff.learning.optimizers.Optimizer,
    client_weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    *,
    proximal_strength: float = 0.0,
    metrics_aggregator=None,
) -> tff.learning.templates.ClientWorkProcess:
  """TFF's model-delta client work (FedProx's, `fed_prox.build_fed_prox_client_work`'s, with `proximal_strength`
  > 0) with the in-graph loop: the client's batches read once into tensors, the functional model's weights and
  the optimizer's state as loop tensors of one `tf.while_loop`, the metrics in the variable model's own objects.

  Same state as TFF's: the optimizer's hyperparameters (FedProx's: none), so processes composed from either have
  one state type. Raises ValueError naming the reason when `in_graph_support` refuses the model.
  """
  reason = in_graph_support(model_fn, functional_model)
  if reason is not None:
    raise ValueError(f'model_fn: the in-graph client loop cannot train this model: {reason}')
  metrics_aggregator = metrics_aggregator or tff.learning.metrics.sum_then_finalize

  def build_update():
    update = build_in_graph_update(model_fn, functional_model, weighting=client_weighting,
                                   proximal_strength=proximal_strength)
    # FedProx's client work keeps the optimizer's own hyperparameters (TFF's has no state).
    return lambda opt, hparams, initial_weights, data: update(opt, initial_weights, data, hparams)

  types = client_lib.model_types(model_fn, metrics_aggregator)
  if not proximal_strength > 0.0:  # The optimizer's hyperparameters as the state, as TFF's client work has them.
    return client_lib.optimizer_client_work(types, optimizer, build_update)
  return client_lib.stateless_client_work(types, optimizer, build_update)
