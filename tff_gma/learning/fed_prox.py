"""FedProx (Li et al., 2020) with the paper's proximal term, as a composed `tff.learning` process.

Every local step uses grad F_k(w) + mu * (w - w_t), which pulls the client back toward the server model w_t. TFF
0.87's own FedProx adds mu * (w_t - w) and pushes it away, the more so the larger mu; these pieces replace its
client work with the same types. tests/tff_gma/learning/fed_prox_test.py pins TFF's sign to notice a fix upstream.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.learning import client_lib

VariableModelFn = Callable[[], tff.learning.models.VariableModel]


def check_proximal_strength(value) -> float:
  """`float(value)` when it is a finite number >= 0 (FedProx's mu); ValueError naming `proximal_strength`."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise ValueError(f'proximal_strength must be a finite number >= 0 (FedProx\'s mu), got {value!r}')
  number = float(value)
  if not math.isfinite(number) or number < 0:
    raise ValueError(f'proximal_strength must be a finite number >= 0 (FedProx\'s mu), got {value!r}')
  return number


def add_proximal_term(gradients: Sequence[tf.Tensor], weights: Sequence, initial: Sequence[tf.Tensor],
                      proximal_strength: float) -> tuple:
  """`g + mu * (w - w_t)` leaf by leaf: the gradient of F_k(w) + mu/2 ||w - w_t||^2 from F_k's gradient `g`.

  `weights` are the current weights (tensors or variables, read now), `initial` the round's server weights w_t,
  all flat sequences in one order. mu = 0 returns the gradients unchanged (FedAvg's step, bit for bit).
  """
  if proximal_strength == 0.0:
    return tuple(gradients)
  return tuple(g + proximal_strength * (w - w0) for g, w, w0 in zip(gradients, weights, initial))


def _check_weighting(client_weighting) -> None:
  if not isinstance(client_weighting, tff.learning.ClientWeighting):
    raise ValueError(f'client_weighting must be a tff.learning.ClientWeighting, got {client_weighting!r}')


def _check_loop(loop_implementation) -> None:
  if not isinstance(loop_implementation, tff.learning.LoopImplementation):
    raise ValueError(f'loop_implementation must be a tff.learning.LoopImplementation, got {loop_implementation!r}')


def build_fed_prox_update(
    model_fn: VariableModelFn,
    *,
    proximal_strength: float,
    weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    loop_implementation: tff.learning.LoopImplementation = client_lib.DEFAULT_LOOP_IMPLEMENTATION,
):
  """FedProx's client update, a `tf.function` (optimizer, initial_weights, data) -> (ClientResult, metrics).

  TFF's FedProx update (`proximal_client_work.build_model_delta_update_with_tff_optimizer`'s signature and
  outputs) with the paper's term: each step on a batch of `data` applies `optimizer` (fresh state) to
  `add_proximal_term(grad F_k, w, w_t, mu)`; the result is `ClientResult(w_t - w, weight)` (weight: examples
  trained on, or 1 for UNIFORM; 0 with a zero update when the update is not finite, the metrics then reset) and
  the model's unfinalized metrics. Builds its model now, so call it where the update will run (inside the client
  computation, or under a device), as TFF's update builders are called.
  """
  mu = check_proximal_strength(proximal_strength)
  _check_weighting(weighting)
  _check_loop(loop_implementation)
  model = model_fn()

  @tf.function
  def client_update(optimizer, initial_weights, data):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    client_lib.assign_weights(model_weights, initial_weights)
    initial = tuple(tf.nest.flatten(initial_weights.trainable))
    trainable = tuple(tf.nest.flatten(model_weights.trainable))

    def proximal(gradients):  # Called before the step assigns the variables: w is the step's starting point.
      return add_proximal_term(gradients, trainable, initial, mu)

    step_fn = functools.partial(client_lib.optimizer_step, correct_gradients=proximal)
    optimizer_state = client_lib.initial_optimizer_state(optimizer, model_weights)
    batches = iter(data) if loop_implementation == tff.learning.LoopImplementation.DATASET_ITERATOR else data
    num_examples = client_lib.local_pass(optimizer, optimizer_state, model, model_weights, batches,
                                         step_fn=step_fn).num_examples
    update, weight, _, non_finite = client_lib.finish_client_update(initial, model_weights, num_examples)
    if weighting == tff.learning.ClientWeighting.UNIFORM:
      weight = tf.where(non_finite > 0, tf.constant(0.0), tf.constant(1.0))
    client_lib.reset_metrics_if(model, non_finite)
    return (tff.learning.templates.ClientResult(
        update=tf.nest.pack_sequence_as(initial_weights.trainable, update), update_weight=weight),
            model.report_local_unfinalized_metrics())

  return client_update


def build_fed_prox_client_work(
    model_fn: VariableModelFn,
    client_optimizer: tff.learning.optimizers.Optimizer,
    client_weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    *,
    proximal_strength: float,
    metrics_aggregator=None,
    loop_implementation: tff.learning.LoopImplementation = client_lib.DEFAULT_LOOP_IMPLEMENTATION,
) -> tff.learning.templates.ClientWorkProcess:
  """FedProx's client work (`build_fed_prox_update` per client), typed as TFF's FedProx client work.

  `initialize() -> ()@SERVER`; `next(state, weights@CLIENTS, datasets@CLIENTS)` -> the clients' `ClientResult`s
  and `OrderedDict(train=<metrics_aggregator over the clients' metrics>)` (default
  `tff.learning.metrics.sum_then_finalize`), the signatures of
  `proximal_client_work.build_model_delta_client_work`. Raises ValueError naming a bad argument.
  """
  client_lib.check_optimizer(client_optimizer, 'client_optimizer_fn')
  mu = check_proximal_strength(proximal_strength)
  _check_weighting(client_weighting)
  _check_loop(loop_implementation)
  types = client_lib.model_types(model_fn, metrics_aggregator)

  def build_update():
    update = build_fed_prox_update(model_fn, proximal_strength=mu, weighting=client_weighting,
                                   loop_implementation=loop_implementation)
    return lambda optimizer, hparams, weights, data: update(optimizer, weights, data)

  return client_lib.stateless_client_work(types, client_optimizer, build_update)


def build_weighted_fed_prox(
    model_fn: VariableModelFn,
    proximal_strength: float,
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    *,
    client_weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    loop_implementation: tff.learning.LoopImplementation = client_lib.DEFAULT_LOOP_IMPLEMENTATION,
) -> tff.learning.templates.LearningProcess:
  """FedProx with the paper's proximal term, as `tff.learning.algorithms.build_weighted_fed_prox` builds FedProx.

  Composed with `tff.learning.templates.compose_learning_process` from TFF's broadcast, `build_fed_prox_client_work`,
  `model_aggregator` (weights float32) and TFF's apply-optimizer finalizer: `initialize`, `next(state,
  client_datasets)`, `get_model_weights`, `set_model_weights`, `get_hparams`, `set_hparams`, the state and the
  metrics have the types of TFF's builder with the same arguments; only the clients' local steps differ (the
  paper's `+ mu * (w - w_t)`, `add_proximal_term`, where TFF 0.87's adds `mu * (w_t - w)`). With
  `proximal_strength=0` the updates are FedAvg's.

  Args:
    model_fn: a no-argument callable returning a `tff.learning.models.VariableModel` (TFF's builder also takes a
      `FunctionalModel`, whose FedProx client work has the same sign; not offered here).
    proximal_strength: FedProx's mu, a finite number >= 0.
    client_optimizer_fn: the client's `tff.learning.optimizers.Optimizer` (e.g. `build_sgdm(0.05, momentum=0.9)`).
    server_optimizer_fn: the server's `tff.learning.optimizers.Optimizer`; default SGD with learning rate 1, the
      paper's FedProx (the new model is the weighted mean of the client models), as TFF's default.
    client_weighting: a `tff.learning.ClientWeighting` (default: number of examples; UNIFORM: 1 per client).
    model_aggregator: a `tff.aggregators.WeightedAggregationFactory` for the model updates (default TFF's
      `MeanFactory`), e.g. `tff_gma.aggregators.GradientMaskedFactory()` for FedProx with GMA.
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).
    loop_implementation: the clients' training loop; default `client_lib.DEFAULT_LOOP_IMPLEMENTATION`
      (DATASET_ITERATOR, as `build_gma_fed_avg`; TFF's builder defaults to DATASET_REDUCE: same weights).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  if isinstance(model_fn, tff.learning.models.FunctionalModel) or not callable(model_fn):
    raise ValueError(f'model_fn must be a no-argument callable returning a tff.learning.models.VariableModel (a '
                     f'FunctionalModel is not supported: TFF\'s functional FedProx has the same wrong sign), got '
                     f'{model_fn!r}')
  mu = check_proximal_strength(proximal_strength)
  client_lib.check_optimizer(client_optimizer_fn, 'client_optimizer_fn')
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(1.0)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')
  if model_aggregator is None:
    model_aggregator = tff.aggregators.MeanFactory()
  if not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
    raise ValueError(f'model_aggregator must be a tff.aggregators.WeightedAggregationFactory (wrap an unweighted '
                     f'one with tff.aggregators.as_weighted_aggregator), got {model_aggregator!r}')
  client_work = build_fed_prox_client_work(
      model_fn, client_optimizer_fn, client_weighting, proximal_strength=mu, metrics_aggregator=metrics_aggregator,
      loop_implementation=loop_implementation)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  return client_lib.compose_with_aggregator(types, client_work, model_aggregator, server_optimizer_fn)
