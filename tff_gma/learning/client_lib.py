"""Pieces shared by the composed learning processes: model types, the local pass, client weights, checks.

Every composed method trains locally through one function, `local_pass`, so the methods differ only in what they do
around it. As TFF's model-delta client work: the update is `initial - trained`, the weight the number of examples
trained on, and a non-finite update is sent as zeros with weight 0 and the client's metrics reset.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


BATCHES = 'batches'  # The key of a client's batches in the client data of a process with client state.

# The training loop of TFF's client works built by the library (`build_gma_fed_avg`) and by the harness (which
# imports this): TFF's DATASET_ITERATOR (a while loop over the client dataset's iterator) rather than TFF's default
# DATASET_REDUCE (`Dataset.reduce`). Both train on the same batches in the same order and give identical weights;
# the iterator loop costs less worker CPU per round (the harness benchmark compares the two loops).
DEFAULT_LOOP_IMPLEMENTATION = tff.learning.LoopImplementation.DATASET_ITERATOR


class ClientStateOutput(NamedTuple):
  """Result of `LearningProcessWithClientState.next_with_client_state`."""
  state: Any  # The `LearningAlgorithmState`, as from `next`.
  metrics: Any  # As from `next`.
  client_state: Any  # Per client (CLIENTS-placed; a list in client order in simulation): its new kept values.


class LearningProcessWithClientState(tff.learning.templates.LearningProcess):
  """A `LearningProcess` whose clients keep values between rounds (SCAFFOLD's c_i, personalized RFA's v_k).

  TFF has no client state and a `LearningProcess` cannot output CLIENTS-placed values, so a client's kept values
  come in with its data -- `OrderedDict(batches=<dataset of batches>, <client_state_key>=<dataset of at most
  one element: the values as a tuple of arrays>)`, an empty dataset meaning zeros -- and go out through
  `next_with_client_state`, which runs the same round as `next` and also returns them at CLIENTS. The plain
  `next` (the `LearningProcess` interface) drops the new values: each client keeps its old ones.

  Attributes:
    next_with_client_state: `(state, client_data) -> ClientStateOutput(state, metrics, client_state)`.
    client_state_type: the TFF type of one client's kept values (a tuple of tensors).
    client_state_key: the key of those values in the client data.
  """

  def __init__(self, composed: tff.learning.templates.LearningProcess, next_with_client_state: tff.Computation,
               client_state_type, client_state_key: str):
    super().__init__(composed.initialize, composed.next, composed.get_model_weights, composed.set_model_weights,
                     get_hparams_fn=composed.get_hparams, set_hparams_fn=composed.set_hparams)
    self.next_with_client_state = next_with_client_state
    self.client_state_type = client_state_type
    self.client_state_key = client_state_key


def client_state_data_type(types: 'ModelTypes', client_state_key: str):
  """(client state type, client data type) of a process whose clients keep one value per trainable variable."""
  state_type = tff.StructWithPythonType(list(tff.structure.flatten(types.trainable_type)), tuple)
  data_type = tff.StructWithPythonType(
      [(BATCHES, tff.SequenceType(types.batch_type)), (client_state_key, tff.SequenceType(state_type))],
      collections.OrderedDict)
  return state_type, data_type


@dataclasses.dataclass(frozen=True)
class ModelTypes:
  """TFF types of a model, and the computations every composed process needs."""
  initial_weights_fn: tff.Computation  # No-arg tf computation returning `tff.learning.models.ModelWeights`.
  weights_type: Any  # Type of `ModelWeights`.
  trainable_type: Any  # Type of `ModelWeights.trainable` (the model update's structure).
  batch_type: Any  # Type of one batch (`model.input_spec`).
  metrics_aggregation_fn: tff.Computation  # Client-placed unfinalized metrics -> finalized metrics at SERVER.


def model_types(model_fn: Callable[[], tff.learning.models.VariableModel], metrics_aggregator=None) -> ModelTypes:
  """Builds the model once (in a throwaway graph) to read its types; the metrics aggregator defaults to TFF's."""
  if not callable(model_fn):
    raise ValueError(f'model_fn must be a no-argument callable returning a VariableModel, got {model_fn!r}')
  if metrics_aggregator is None:
    metrics_aggregator = tff.learning.metrics.sum_then_finalize
  elif not callable(metrics_aggregator):
    raise ValueError(f'metrics_aggregator must be callable (e.g. tff.learning.metrics.secure_sum_then_finalize), '
                     f'got {metrics_aggregator!r}')

  @tff.tensorflow.computation()
  def initial_weights_fn():
    model = model_fn()
    if not isinstance(model, tff.learning.models.VariableModel):
      raise ValueError(f'model_fn must return a tff.learning.models.VariableModel, got {type(model)}')
    return tff.learning.models.ModelWeights.from_model(model)

  with tf.Graph().as_default():
    model = model_fn()
    metrics_aggregation_fn = metrics_aggregator(model.metric_finalizers())
    batch_type = tff.types.tensorflow_to_type(model.input_spec)
  weights_type = initial_weights_fn.type_signature.result
  return ModelTypes(initial_weights_fn, weights_type, weights_type.trainable, batch_type, metrics_aggregation_fn)


def check_optimizer(optimizer, name: str) -> tff.learning.optimizers.Optimizer:
  if not isinstance(optimizer, tff.learning.optimizers.Optimizer):
    raise ValueError(f'{name} must be a tff.learning.optimizers.Optimizer (e.g. '
                     f'tff.learning.optimizers.build_sgdm(0.1)), got {optimizer!r}')
  return optimizer


def broadcast_process(types: ModelTypes) -> tff.learning.templates.DistributionProcess:
  return tff.learning.templates.build_broadcast_process(types.weights_type)


def apply_optimizer_finalizer(
    server_optimizer: tff.learning.optimizers.Optimizer, types: ModelTypes,
) -> tff.learning.templates.FinalizerProcess:
  return tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer, types.weights_type)


def optimizer_client_work(
    types: ModelTypes, client_optimizer: tff.learning.optimizers.Optimizer,
    build_client_update: Callable[[], Callable[..., Any]],
    data_type: Optional[tff.Type] = None,
) -> tff.learning.templates.ClientWorkProcess:
  """A `ClientWorkProcess` whose state is the client optimizer's hyperparameters (as TFF's model-delta work).

  The state is broadcast each round and handed to the client update, so `get_hparams` / `set_hparams` of the
  learning process reach the client optimizer (e.g. a learning-rate schedule set between rounds).

  Args:
    types: the model's types (`model_types`).
    client_optimizer: the client optimizer.
    build_client_update: builds (inside the client's TF graph) a function
      `(optimizer, hparams, initial_weights, batches) -> (ClientResult, unfinalized metrics)`.
    data_type: the type of a client's data (`batches` above); default: a sequence of `types.batch_type`.

  Returns:
    The client work; measurements: `train`, the aggregated training metrics.
  """
  data_type = data_type or tff.SequenceType(types.batch_type)
  initial_hparams = optimizer_hparams(client_optimizer)

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value(initial_hparams, tff.SERVER)

  state_type = init_fn.type_signature.result.member

  @tff.tensorflow.computation(state_type, types.weights_type, data_type)
  def client_update_computation(hparams, initial_weights, data):
    return build_client_update()(client_optimizer, hparams, initial_weights, data)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    client_result, local_metrics = tff.federated_map(
        client_update_computation, (tff.federated_broadcast(state), weights, client_data))
    measurements = tff.federated_zip(collections.OrderedDict(train=types.metrics_aggregation_fn(local_metrics)))
    return tff.templates.MeasuredProcessOutput(state, client_result, measurements)

  @tff.tensorflow.computation(state_type)
  def get_hparams_fn(state):
    return state

  @tff.tensorflow.computation(state_type, state_type)
  def set_hparams_fn(state, hparams):
    del state
    return hparams

  return tff.learning.templates.ClientWorkProcess(
      init_fn, next_fn, get_hparams_fn=get_hparams_fn, set_hparams_fn=set_hparams_fn)


def stateless_client_work(
    types: ModelTypes, client_optimizer: tff.learning.optimizers.Optimizer,
    build_client_update: Callable[[], Callable[..., Any]],
    data_type: Optional[tff.Type] = None,
) -> tff.learning.templates.ClientWorkProcess:
  """`optimizer_client_work` without state, as TFF's FedProx client work: the client optimizer keeps its own
  hyperparameters, and `build_client_update()` is called with `hparams=None`."""
  data_type = data_type or tff.SequenceType(types.batch_type)

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.tensorflow.computation(types.weights_type, data_type)
  def client_update_computation(initial_weights, data):
    return build_client_update()(client_optimizer, None, initial_weights, data)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    client_result, local_metrics = tff.federated_map(client_update_computation, (weights, client_data))
    measurements = tff.federated_zip(collections.OrderedDict(train=types.metrics_aggregation_fn(local_metrics)))
    return tff.templates.MeasuredProcessOutput(state, client_result, measurements)

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def compose_with_aggregator(
    types: ModelTypes, client_work: tff.learning.templates.ClientWorkProcess,
    aggregator_factory: tff.aggregators.WeightedAggregationFactory,
    server_optimizer: tff.learning.optimizers.Optimizer,
) -> tff.learning.templates.LearningProcess:
  """`compose_learning_process` of TFF's broadcast, `client_work`, `aggregator_factory` and TFF's finalizer.

  The aggregator is created for the client work's own result types (its update, e.g. Elastic's and FedGMA's
  `OrderedDict(update=..., <extra>=...)`, and its weight), so a paired update reaches a factory made for it.
  """
  result_type = client_work.next.type_signature.result.result.member
  aggregator = aggregator_factory.create(result_type.update, result_type.update_weight)
  return tff.learning.templates.compose_learning_process(
      types.initial_weights_fn, broadcast_process(types), client_work, aggregator,
      apply_optimizer_finalizer(server_optimizer, types))


def compose_with_client_state(
    types: ModelTypes, client_init_fn: tff.Computation, client_round: tff.Computation,
    model_aggregator: tff.aggregators.WeightedAggregationFactory,
    server_optimizer: tff.learning.optimizers.Optimizer, client_state_type, client_state_key: str,
) -> LearningProcessWithClientState:
  """`compose_learning_process` for a client round that also produces values the clients keep.

  TFF's learning processes cannot output CLIENTS-placed values (a `ClientWorkProcess` returns state, result and
  measurements only), yet SCAFFOLD's control variates and personalized RFA's personal parameters must go back to
  the clients that own them. So the stock composition (broadcast, client work, `model_aggregator`, apply-optimizer
  finalizer) is built as usual, and beside it a `next` computing the very same round that also returns the values.

  Args:
    types: the model's types (`model_types`).
    client_init_fn: the client work's `initialize` (no-argument federated computation).
    client_round: federated `(state, weights, client_data) -> (state, ClientResult, measurements, client_state)`.
    model_aggregator: aggregates the model updates, weighted by the client weights.
    server_optimizer: applies the aggregated update to the global model.
    client_state_type, client_state_key: see `LearningProcessWithClientState`.

  Returns:
    The stock composed process, with `next_with_client_state` giving the state and metrics `next` gives.
  """

  @tff.federated_computation(*client_round.type_signature.parameter)
  def client_work_next(state, weights, client_data):
    new_state, client_result, measurements, _ = client_round(state, weights, client_data)
    return tff.templates.MeasuredProcessOutput(new_state, client_result, measurements)

  client_work = tff.learning.templates.ClientWorkProcess(client_init_fn, client_work_next)
  distributor = broadcast_process(types)
  aggregator = model_aggregator.create(types.trainable_type, tff.TensorType(np.float32))
  finalizer = apply_optimizer_finalizer(server_optimizer, types)
  composed = tff.learning.templates.compose_learning_process(
      types.initial_weights_fn, distributor, client_work, aggregator, finalizer)
  state_type, client_data_type = composed.next.type_signature.parameter

  @tff.federated_computation(state_type, client_data_type)
  def next_with_client_state(state, client_data):
    # `compose_learning_process`'s `next`, step for step, plus the client round's kept values.
    distributor_output = distributor.next(state.distributor, state.global_model_weights)
    client_work_state, client_result, client_measurements, kept_values = client_round(
        state.client_work, distributor_output.result, client_data)
    aggregator_output = aggregator.next(state.aggregator, client_result.update, client_result.update_weight)
    finalizer_output = finalizer.next(state.finalizer, state.global_model_weights, aggregator_output.result)
    new_state = tff.federated_zip(tff.learning.templates.LearningAlgorithmState(
        finalizer_output.result, distributor_output.state, client_work_state, aggregator_output.state,
        finalizer_output.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        distributor=distributor_output.measurements,
        client_work=client_measurements,
        aggregator=aggregator_output.measurements,
        finalizer=finalizer_output.measurements))
    return ClientStateOutput(new_state, metrics, kept_values)

  return LearningProcessWithClientState(composed, next_with_client_state, client_state_type, client_state_key)


def optimizer_hparams(optimizer: tff.learning.optimizers.Optimizer):
  """The optimizer's hyperparameters, read from a state for a whimsy spec (as TFF's client works do)."""
  return optimizer.get_hparams(optimizer.initialize(tf.TensorSpec([], tf.float32)))


# ----------------------------------------------------------------------------------------------------------------
# Plain TF on a VariableModel.


def batch_features(batch):
  """The model input of a batch: `batch['x']` for a mapping, else `batch[0]` (TFF's `(x, y)` convention)."""
  if isinstance(batch, Mapping):
    return batch['x']
  return batch[0]


def output_num_examples(output: tff.learning.models.BatchOutput) -> tf.Tensor:
  if output.num_examples is None:
    return tf.shape(output.predictions, out_type=tf.int64)[0]
  return tf.cast(output.num_examples, tf.int64)


def assign_weights(model_weights: tff.learning.models.ModelWeights, values) -> None:
  tf.nest.map_structure(lambda v, t: v.assign(t), model_weights, values)


def zeros_like_trainable(model_weights: tff.learning.models.ModelWeights) -> tuple:
  """A flat tuple of zeros, one per trainable variable (tuples, not lists, are safe as reduce/loop state)."""
  return tuple(tf.zeros_like(v) for v in tf.nest.flatten(model_weights.trainable))


def gradients_or_zeros(gradients, variables) -> tuple:
  """A flat tuple of gradients with `None` (variable not reached) replaced by zeros."""
  return tuple(tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
               for g, v in zip(tf.nest.flatten(gradients), tf.nest.flatten(variables)))


def initial_optimizer_state(optimizer: tff.learning.optimizers.Optimizer, model_weights, hparams=None):
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in tf.nest.flatten(model_weights.trainable))
  state = optimizer.initialize(specs)
  if hparams is not None:
    state = optimizer.set_hparams(state, hparams)
  return state


def optimizer_step(optimizer: tff.learning.optimizers.Optimizer, optimizer_state, model: Any,
                   model_weights: tff.learning.models.ModelWeights, batch,
                   correct_gradients: Optional[Callable[[tuple], tuple]] = None):
  """One local step on `batch` (`training=True`, metrics updated); returns `(optimizer_state, num_examples)`.

  `correct_gradients` (flat tuple of gradients -> flat tuple) changes the loss gradients before the optimizer
  sees them (SCAFFOLD's control-variate correction); None leaves them as they are.
  """
  with tf.GradientTape() as tape:
    output = model.forward_pass(batch, training=True)
  trainable = tf.nest.flatten(model_weights.trainable)
  gradients = gradients_or_zeros(tape.gradient(output.loss, trainable), trainable)
  if correct_gradients is not None:
    gradients = correct_gradients(gradients)
  optimizer_state, updated = optimizer.next(optimizer_state, tuple(trainable), gradients)
  for variable, value in zip(trainable, updated):
    variable.assign(value)
  return optimizer_state, output_num_examples(output)


class LocalPassResult(NamedTuple):
  """Result of `local_pass`."""
  optimizer_state: Any  # After the last step.
  num_examples: tf.Tensor  # int64: examples trained on (the sum of the steps' counts).
  num_steps: tf.Tensor  # int64: batches trained on.


def local_pass(optimizer: tff.learning.optimizers.Optimizer, optimizer_state, model: Any,
               model_weights: tff.learning.models.ModelWeights, batches, *,
               step_fn: Callable[..., tuple[Any, tf.Tensor]] = optimizer_step) -> LocalPassResult:
  """Local training of every composed method: `step_fn` on each batch of `batches`, in order, once.

  Args:
    optimizer, optimizer_state: the client optimizer and its state at the start of the pass.
    model, model_weights: the model being trained (`model_weights` holds its variables).
    batches: a `tf.data.Dataset`, looped with `Dataset.reduce` (TFF's DATASET_REDUCE), or a `tf.data.Iterator`,
      looped with a while loop over `get_next_as_optional` from where it stands (TFF's DATASET_ITERATOR: what a
      caller passes when earlier batches of the same iterator went elsewhere, as Elastic's sensitivity batches).
    step_fn: `(optimizer, optimizer_state, model, model_weights, batch) -> (optimizer_state, num_examples)`, one
      local step; default `optimizer_step` (a method with its own step wraps it, e.g. SCAFFOLD's correction).

  Returns:
    `LocalPassResult(optimizer_state, num_examples, num_steps)`.
  """

  def step(state, batch):
    optimizer_state, num_examples, num_steps = state
    optimizer_state, batch_examples = step_fn(optimizer, optimizer_state, model, model_weights, batch)
    return optimizer_state, num_examples + batch_examples, num_steps + 1

  initial = (optimizer_state, tf.constant(0, tf.int64), tf.constant(0, tf.int64))
  if isinstance(batches, tf.data.Dataset):
    return LocalPassResult(*batches.reduce(initial, step))
  # Explicit rather than autograph's `for batch in batches`, so that the loop is the same eagerly, under a
  # tf.function and in a plain graph; the optional is a loop variable, so the loop stops at the first empty one.
  _, state = tf.while_loop(
      lambda optional, _: optional.has_value(),
      lambda optional, state: (batches.get_next_as_optional(), step(state, optional.get_value())),
      (batches.get_next_as_optional(), initial))
  return LocalPassResult(*state)


def count_batches(data: tf.data.Dataset) -> tf.Tensor:
  """Number of elements of `data` (int64): its cardinality when known, else one pass over it."""
  cardinality = tf.cast(data.cardinality(), tf.int64)
  return tf.cond(cardinality >= 0, lambda: cardinality,
                 lambda: data.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))


def finish_client_update(initial_trainable, model_weights, num_examples: tf.Tensor, extra=()):
  """`(update, weight, extra, non_finite)`: update = initial - trained, zeroed with `extra` if not all finite.

  `weight` is `num_examples` as float32, or 0 for a non-finite client (the caller resets that client's metrics,
  see `reset_metrics_if`).
  """
  trained = tf.nest.flatten(model_weights.trainable)
  update = tuple(a - b for a, b in zip(tf.nest.flatten(initial_trainable), trained))
  (update, extra), non_finite = zero_all_if_any_non_finite((update, extra))
  weight = tf.where(non_finite > 0, tf.constant(0.0), tf.cast(num_examples, tf.float32))
  return update, weight, extra, non_finite


def paired_client_output(model: Any, initial_trainable, model_weights: tff.learning.models.ModelWeights,
                         num_examples: tf.Tensor, extra_key: str, extra: tuple):
  """`(ClientResult(OrderedDict(update=Delta, <extra_key>=extra), weight), unfinalized metrics)`.

  The output of a client work whose update travels with a second value per trainable variable (Elastic's
  sensitivity, FedGMA's gradient): `finish_client_update` (a non-finite client sends zeros for both, with weight 0,
  and its metrics are reset), then the pair as lists.
  """
  update, weight, extra, non_finite = finish_client_update(initial_trainable, model_weights, num_examples,
                                                           extra=extra)
  reset_metrics_if(model, non_finite)
  value = collections.OrderedDict([('update', list(update)), (extra_key, list(extra))])
  return (tff.learning.templates.ClientResult(update=value, update_weight=weight),
          model.report_local_unfinalized_metrics())


def zero_all_if_any_non_finite(structure):
  """`(structure, 0)` when every element is finite, else `(zeros, 1)` (as TFF's `tensor_utils`)."""
  flat = tf.nest.flatten(structure)
  if not flat:
    return structure, tf.constant(0)
  finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in flat]))
  zeroed = tf.nest.map_structure(lambda t: tf.where(finite, t, tf.zeros_like(t)), structure)
  return zeroed, tf.cast(tf.logical_not(finite), tf.int32)


def reset_metrics_if(model: Any, non_finite: tf.Tensor) -> None:
  """Resets the model's metrics when `non_finite > 0`, so a diverged client's metrics do not reach the server."""
  if non_finite > 0:  # A tf.cond under autograph.
    model.reset_metrics()
