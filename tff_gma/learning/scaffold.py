"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1) as a composed `tff.learning` process, with client momentum.

Clients step on the corrected gradient g - c_i + c with the optimizer they are given (SGD, with momentum or not);
their new control variate is the mean of their minibatch gradients (option II exactly without momentum, still what
it estimates with). c_i comes in with the client's data and goes out through `next_with_client_state`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values
from tff_gma.aggregators import mean
from tff_gma.aggregators import secure_mean
from tff_gma.learning import client_lib

BATCHES = client_lib.BATCHES
CONTROL_VARIATE = 'control_variate'


# ----------------------------------------------------------------------------------------------------------------
# Plain TF.


def control_variate_update(gradient_sum: tuple, num_steps: tf.Tensor, client_control: tuple,
                           valid: tf.Tensor) -> tuple:
  """dc_i = (1 / K) sum_k g_k - c_i (c_i+ - c_i); zeros unless `valid`, K > 0 and it is finite."""
  steps = tf.cast(num_steps, tf.float32)
  mean_gradient = tuple(tf.math.divide_no_nan(s, tf.cast(steps, s.dtype)) for s in gradient_sum)
  ok = tf.logical_and(tf.logical_and(valid, num_steps > 0), client_values.all_finite(mean_gradient))
  return tuple(tf.where(ok, g - ci, tf.zeros_like(g)) for g, ci in zip(mean_gradient, client_control))


def server_control_update(server_control: tuple, mean_control_delta: tuple, num_participants: tf.Tensor,
                          num_clients: Optional[int]) -> tuple:
  """c + (|S| / N) * mean(dc_i); |S| / N = 1 when N is None (full participation)."""
  if num_clients is None:
    fraction = tf.constant(1.0)
  else:
    fraction = tf.cast(num_participants, tf.float32) / float(num_clients)
  return tuple(c + tf.cast(fraction, c.dtype) * d for c, d in zip(server_control, mean_control_delta))


def corrected_step(optimizer: tff.learning.optimizers.Optimizer, state, model, model_weights, batch,
                   correction: tuple):
  """One local step on `g(y) + correction` (`correction` = c - c_i); `state` = (optimizer state, sum of the raw
  gradients g(y) so far). Returns (state, number of examples), as `client_lib.local_pass` steps do."""
  optimizer_state, gradient_sum = state
  with tf.GradientTape() as tape:
    output = model.forward_pass(batch, training=True)
  trainable = tf.nest.flatten(model_weights.trainable)
  gradients = client_lib.gradients_or_zeros(tape.gradient(output.loss, trainable), trainable)
  optimizer_state, updated = optimizer.next(
      optimizer_state, tuple(trainable), tuple(g + c for g, c in zip(gradients, correction)))
  for variable, value in zip(trainable, updated):
    variable.assign(value)
  gradient_sum = tuple(s + g for s, g in zip(gradient_sum, gradients))
  return (optimizer_state, gradient_sum), client_lib.output_num_examples(output)


def build_scaffold_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                                 client_optimizer: tff.learning.optimizers.Optimizer,
                                 client_weighting: tff.learning.ClientWeighting):
  """A `tf.function` (initial_weights, batches, client_control_data, server_control) ->
  (ClientResult, dc_i, c_i+, unfinalized metrics, participation indicator); the local steps are `client_optimizer`'s,
  from its initial state (its own hyperparameters)."""
  model = model_fn()

  @tf.function
  def client_update(initial_weights, batches, client_control_data, server_control):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    client_lib.assign_weights(model_weights, initial_weights)
    server_control = tuple(tf.nest.flatten(server_control))
    zeros = client_lib.zeros_like_trainable(model_weights)
    # The client's stored c_i: the dataset's (last) element, zeros when it is empty (a new client).
    client_control = client_control_data.reduce(zeros, lambda _, c: tuple(tf.nest.flatten(c)))
    correction = tuple(c - ci for c, ci in zip(server_control, client_control))
    step_fn = functools.partial(corrected_step, correction=correction)
    initial_state = (client_lib.initial_optimizer_state(client_optimizer, model_weights), zeros)
    (_, gradient_sum), num_examples, num_steps = client_lib.local_pass(
        client_optimizer, initial_state, model, model_weights, batches, step_fn=step_fn)
    update, weight, _, non_finite = client_lib.finish_client_update(
        initial_weights.trainable, model_weights, num_examples)
    client_lib.reset_metrics_if(model, non_finite)
    if client_weighting == tff.learning.ClientWeighting.UNIFORM:
      weight = tf.cast(weight > 0, tf.float32)
    control_delta = control_variate_update(gradient_sum, num_steps, client_control, tf.equal(non_finite, 0))
    new_client_control = tuple(ci + d for ci, d in zip(client_control, control_delta))
    return (tff.learning.templates.ClientResult(update=list(update), update_weight=weight), control_delta,
            new_client_control, model.report_local_unfinalized_metrics(), tf.constant(1, tf.int32))

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Federated pieces.


def _build_client_round(model_fn, types: client_lib.ModelTypes, client_optimizer: tff.learning.optimizers.Optimizer,
                        client_weighting: tff.learning.ClientWeighting, num_clients: Optional[int],
                        control_mean: tff.aggregators.WeightedAggregationFactory):
  """(init_fn, client_round) where client_round: (state@S, weights@C, data@C) ->
  (state@S, ClientResult@C, measurements@S, new c_i@C)."""
  control_type, data_type = client_lib.client_state_data_type(types, CONTROL_VARIATE)  # c and c_i alike.
  zeros = tuple(np.zeros(t.shape, t.dtype) for t in tff.structure.flatten(control_type))

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value(collections.OrderedDict(control_variate=zeros), tff.SERVER)

  state_type = init_fn.type_signature.result
  # The controls' unweighted mean (weight 1 per client) through one of the library's stateless means (so a fresh
  # state each round is its state): `federated_mean`, or the secure mean with `secure=True`.
  control_mean_process = control_mean.create(control_type, tff.TensorType(np.float32))

  @tff.tensorflow.computation()
  def unit_weight():
    return np.float32(1.0)

  @tff.tensorflow.computation(types.weights_type, data_type, control_type)
  def client_update_computation(initial_weights, data, server_control):
    client_update = build_scaffold_client_update(model_fn, client_optimizer, client_weighting)
    return client_update(initial_weights, data[BATCHES], data[CONTROL_VARIATE], server_control)

  @tff.tensorflow.computation(control_type, control_type, np.int32)
  def update_server_control(server_control, mean_control_delta, num_participants):
    new_control = server_control_update(server_control, mean_control_delta, num_participants, num_clients)
    norm = tf.linalg.global_norm(list(new_control))
    return collections.OrderedDict(control_variate=new_control), norm

  @tff.federated_computation(state_type, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def client_round(state, weights, client_data):
    server_control = tff.federated_broadcast(state.control_variate)
    client_result, control_delta, new_client_control, local_metrics, participated = tff.federated_map(
        client_update_computation, (weights, client_data, server_control))
    num_participants = secure_mean.secure_count(participated)
    mean_control_delta = control_mean_process.next(
        control_mean_process.initialize(), control_delta, tff.federated_eval(unit_weight, tff.CLIENTS)).result
    new_state, control_norm = tff.federated_map(
        update_server_control, (state.control_variate, mean_control_delta, num_participants))
    measurements = tff.federated_zip(collections.OrderedDict(
        train=types.metrics_aggregation_fn(local_metrics),
        participating_clients=num_participants,
        server_control_norm=control_norm,
    ))
    return new_state, client_result, measurements, new_client_control

  return init_fn, client_round, control_type, data_type


def build_scaffold(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_lr: float = 1.0,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    *,
    num_clients: Optional[int] = None,
    client_weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    metrics_aggregator=None,
    secure: bool = False,
    value_bound: Optional[float] = None,
) -> client_lib.LearningProcessWithClientState:
  """SCAFFOLD as a `tff.learning.templates.LearningProcess` whose clients keep c_i.

      client i:  y <- x;  K times (one per batch):  g_k = g_i(y);  y <- optimizer_step(y, g_k - c_i + c)
                 c_i+ = (1 / K) sum_k g_k;    sends  Delta_i = x - y,  dc_i = c_i+ - c_i
      server:    x <- x - eta_g * aggregate(Delta_i)          (`model_aggregator`, then the server optimizer)
                 c <- c + (|S| / N) * mean_i(dc_i)             (unweighted; |S| by a secure count)

  Client data are `OrderedDict(batches=<dataset of batches>, control_variate=<dataset of at most one element: c_i
  as a tuple of arrays>)` (empty: c_i = 0). Train with `next_with_client_state`, which also returns every client's
  c_i+; the plain `next` keeps every c_i at its old value. A client without batches, or whose update or mean
  gradient is not finite, sends a zero update of weight 0 and dc_i = 0.

  Args:
    model_fn: no-arg callable returning a `tff.learning.models.VariableModel`.
    client_optimizer_fn: the clients' `tff.learning.optimizers.Optimizer`, stepped on the corrected gradient from its
      initial state: the paper's plain SGD at eta_l (`tff.learning.optimizers.build_sgdm(eta_l)`, option II
      exactly), or TFF's SGD with momentum (`build_sgdm(eta_l, momentum=...)`), after which c_i+ is still the mean
      minibatch gradient. The control variates never read its learning rate.
    server_lr: eta_g > 0, the server's SGD step on the aggregated update (ignored with `server_optimizer_fn`).
    model_aggregator: weighted factory for the model updates; default the weighted mean
      (`tff_gma.aggregators.FederatedMeanFactory`, one `federated_mean`).
    num_clients: N, the client population, for the control update's |S| / N; None: every client takes part
      in every round.
    client_weighting: `tff.learning.ClientWeighting.NUM_EXAMPLES` (TFF's default) or `UNIFORM` (the paper's
      1/|S|), the weights of the model updates.
    server_optimizer_fn: optional server optimizer replacing SGD(server_lr).
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).
    secure: average the control variates' deltas through `tff_gma.aggregators.SecureWeightedMeanFactory`
      (weight 1 each) instead of `federated_mean` (the model updates go through `model_aggregator`: pass a secure
      one too).
    value_bound: with `secure`, the bound on every coordinate of a client's control delta (clipped to it).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  client_lib.check_optimizer(client_optimizer_fn, 'client_optimizer_fn')
  server_lr = checks.check_positive_finite(server_lr, 'server_lr')
  num_clients = checks.check_positive_int(num_clients, 'num_clients', optional=True)
  if client_weighting not in (tff.learning.ClientWeighting.NUM_EXAMPLES, tff.learning.ClientWeighting.UNIFORM):
    raise ValueError(f'client_weighting must be a tff.learning.ClientWeighting, got {client_weighting!r}')
  if model_aggregator is None:
    model_aggregator = mean.FederatedMeanFactory()
  elif not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
    raise ValueError(f'model_aggregator must be a tff.aggregators.WeightedAggregationFactory, got '
                     f'{model_aggregator!r}')
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(server_lr)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')

  control_mean = mean.weighted_mean_factory(secure, value_bound, weight_bound=1.0)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  init_fn, client_round, control_type, _ = _build_client_round(
      model_fn, types, client_optimizer_fn, client_weighting, None if num_clients is None else int(num_clients),
      control_mean)
  return client_lib.compose_with_client_state(
      types, init_fn, client_round, model_aggregator, server_optimizer_fn, control_type, CONTROL_VARIATE)
