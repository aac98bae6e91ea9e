"""Personalized RFA (RFA paper, Algorithm 4): shared parameters aggregated by RFA, personal parameters on device.

A client predicts with w + v_k and trains its personal v_k, then the shared w, each on the other's residual; the
server aggregates the shared updates (RFA by default). v_k comes in with the client's data and goes out through
`next_with_client_state`, since TFF has no client state.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import geometric_median
from tff_gma.aggregators import staged as aggregators_staged
from tff_gma.learning import client_lib
from tff_gma.learning import staged as staged_lib

BATCHES = client_lib.BATCHES
PERSONAL = 'personal'


# ----------------------------------------------------------------------------------------------------------------
# Plain TF (client side).


def build_personalized_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                                     optimizer: tff.learning.optimizers.Optimizer):
  """A `tf.function` (initial_weights, batches, personal_data) -> (ClientResult, v_k', unfinalized metrics)."""
  model = model_fn()

  @tf.function
  def client_update(initial_weights, batches, personal_data):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    trainable = tf.nest.flatten(model_weights.trainable)
    shared = tuple(tf.nest.flatten(initial_weights.trainable))
    zeros = client_lib.zeros_like_trainable(model_weights)
    personal = personal_data.reduce(zeros, lambda _, p: tuple(tf.nest.flatten(p)))
    client_lib.assign_weights(model_weights, initial_weights)
    for variable, w, v in zip(trainable, shared, personal):
      variable.assign(w + v)

    def local_pass():  # One pass over the round's batches from a fresh optimizer state; its example count.
      optimizer_state = client_lib.initial_optimizer_state(optimizer, model_weights)
      return client_lib.local_pass(optimizer, optimizer_state, model, model_weights, batches).num_examples

    # Phase 1: the personal parameters on the residual of the shared ones (w fixed).
    local_pass()
    new_personal = tuple(t - w for t, w in zip(trainable, shared))
    new_personal, personal_non_finite = client_lib.zero_all_if_any_non_finite(new_personal)
    new_personal = tuple(tf.where(personal_non_finite > 0, v, n) for v, n in zip(personal, new_personal))
    for variable, w, v in zip(trainable, shared, new_personal):
      variable.assign(w + v)
    model.reset_metrics()
    # Phase 2: the shared parameters on the residual of the new personal ones (v_k' fixed).
    start = tuple(tf.identity(t) for t in trainable)
    num_examples = local_pass()
    update, weight, _, non_finite = client_lib.finish_client_update(start, model_weights, num_examples)
    client_lib.reset_metrics_if(model, non_finite)
    return (tff.learning.templates.ClientResult(update=list(update), update_weight=weight), new_personal,
            model.report_local_unfinalized_metrics())

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Federated pieces.


def build_personalized_rfa(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    *,
    staged: bool = False,
) -> client_lib.LearningProcessWithClientState | staged_lib.StagedLearningProcess:
  """Personalized RFA (RFA paper, Algorithm 4): a `LearningProcess` whose clients keep v_k.

      client k:  phase 1 (personal): from w + v_k, local SGD on its batches with w fixed  -> v_k' = trained - w
                 phase 2 (shared):   from w + v_k', local SGD on its batches with v_k' fixed -> w_k = trained - v_k'
                 sends w - w_k with its number of examples as weight
      server:    w <- finalizer(w, aggregate(w - w_k))

  Each phase is one pass over the round's batches from a fresh optimizer state; metrics are phase 2's. A client
  whose personal step is not finite keeps its v_k; one whose update is not finite sends zero with weight 0. Client
  data are `OrderedDict(batches=<dataset of batches>, personal=<dataset of at most one element: v_k as a tuple of
  arrays>)` (empty: v_k = 0); `next_with_client_state` also returns every client's v_k', the plain `next` drops it.

  Args:
    model_fn: no-arg callable returning a `tff.learning.models.VariableModel`.
    client_optimizer_fn: the local optimizer of both phases (e.g. `tff.learning.optimizers.build_sgdm(0.05)`).
    server_optimizer_fn: applied to the aggregated update; default SGD with learning rate 1 (w <- aggregate).
    model_aggregator: weighted factory for the shared updates; default RFA,
      `tff_gma.aggregators.GeometricMedianFactory()` (3 passes).
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).
    staged: the same round as a `tff_gma.learning.StagedLearningProcess`, the aggregator's sequential
      aggregations one computation each (RFA's passes), as TFF's several workers run them.

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  client_optimizer = client_lib.check_optimizer(client_optimizer_fn, 'client_optimizer_fn')
  server_optimizer = client_lib.check_optimizer(
      server_optimizer_fn if server_optimizer_fn is not None else tff.learning.optimizers.build_sgdm(1.0),
      'server_optimizer_fn')
  if model_aggregator is None:
    model_aggregator = geometric_median.GeometricMedianFactory()
  elif not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
    raise ValueError(f'model_aggregator must be a tff.aggregators.WeightedAggregationFactory, got '
                     f'{model_aggregator!r}')
  types = client_lib.model_types(model_fn, metrics_aggregator)
  personal_type, data_type = client_lib.client_state_data_type(types, PERSONAL)

  @tff.tensorflow.computation(types.weights_type, data_type)
  def client_update_computation(initial_weights, data):
    client_update = build_personalized_client_update(model_fn, client_optimizer)
    return client_update(initial_weights, data[BATCHES], data[PERSONAL])

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(types.weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def client_round(state, weights, client_data):
    client_result, new_personal, local_metrics = tff.federated_map(client_update_computation, (weights, client_data))
    measurements = tff.federated_zip(collections.OrderedDict(train=types.metrics_aggregation_fn(local_metrics)))
    return state, client_result, measurements, new_personal

  if staged:
    return staged_lib.compose_staged(
        types.initial_weights_fn, client_lib.broadcast_process(types), init_fn, client_round,
        aggregators_staged.create_staged(model_aggregator, types.trainable_type, tff.TensorType(np.float32)),
        client_lib.apply_optimizer_finalizer(server_optimizer, types), personal_type, PERSONAL)
  return client_lib.compose_with_client_state(
      types, init_fn, client_round, model_aggregator, server_optimizer, personal_type, PERSONAL)
