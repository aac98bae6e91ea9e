"""FedGMA (Gradient-Masked Federated Optimization, workshop paper, Algorithm 1) as a composed `tff.learning` process.

Each client sends its model update and its loss gradient at the round's starting model (the text's reading of the
paper, computed before training); the server averages the models and steps along the AND-masked mean gradient
(`tff_gma.aggregators.FedGMAFactory`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators.fedgma import DEFAULT_MASK_THRESHOLD
from tff_gma.aggregators.fedgma import DEFAULT_SERVER_STEP_SIZE
from tff_gma.aggregators.fedgma import FedGMAFactory
from tff_gma.learning import client_lib


# ----------------------------------------------------------------------------------------------------------------
# Plain TF.


def mean_loss_gradient(model: tff.learning.models.VariableModel, variables, data: tf.data.Dataset) -> tuple:
  """Example-weighted mean over `data` of the batch-loss gradients at the current weights (zeros if empty).

  Uses `forward_pass(training=True)`, the training loss; it updates the model's metrics, which the caller resets.
  """

  def reduce_fn(state, batch):
    gradient_sum, count = state
    with tf.GradientTape() as tape:
      output = model.forward_pass(batch, training=True)
    gradient = client_lib.gradients_or_zeros(tape.gradient(output.loss, variables), variables)
    num_examples = client_lib.output_num_examples(output)
    weight = tf.cast(num_examples, tf.float32)
    return tuple(s + weight * g for s, g in zip(gradient_sum, gradient)), count + num_examples

  zeros = tuple(tf.zeros_like(v) for v in variables)
  gradient_sum, count = data.reduce((zeros, tf.constant(0, tf.int64)), reduce_fn)
  return tuple(tf.math.divide_no_nan(s, tf.cast(count, s.dtype)) for s in gradient_sum)


def build_fedgma_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                               gradient_batches: Optional[int]):
  """A `tf.function` (optimizer, hparams, initial_weights, data) -> (ClientResult, unfinalized metrics)."""
  model = model_fn()

  @tf.function
  def client_update(optimizer, optimizer_hparams, initial_weights, data):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    client_lib.assign_weights(model_weights, initial_weights)
    trainable = tf.nest.flatten(model_weights.trainable)
    gradient_data = data if gradient_batches is None else data.take(gradient_batches)
    gradient = mean_loss_gradient(model, trainable, gradient_data)
    model.reset_metrics()  # The metrics report the training pass only.
    optimizer_state = client_lib.initial_optimizer_state(optimizer, model_weights, optimizer_hparams)
    num_examples = client_lib.local_pass(optimizer, optimizer_state, model, model_weights, data).num_examples
    return client_lib.paired_client_output(
        model, initial_weights.trainable, model_weights, num_examples, 'gradient', gradient)

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Client work and builder.


def build_fedgma_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer: tff.learning.optimizers.Optimizer,
    *,
    gradient_batches: Optional[int] = None,
    metrics_aggregator=None,
) -> tff.learning.templates.ClientWorkProcess:
  """FedGMA's client work; state = the client optimizer's hyperparameters.

  From the round's starting model w: grad^k, the example-weighted mean loss gradient over the round's dataset (or
  its first `gradient_batches` batches), computed before training; then local training as FedAvg to w^k. Sends
  `OrderedDict(update=w - w^k, gradient=grad^k)` with weight the number of examples trained on.
  """
  client_lib.check_optimizer(client_optimizer, 'client_optimizer_fn')
  gradient_batches = checks.check_positive_int(gradient_batches, 'gradient_batches', optional=True)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  return client_lib.optimizer_client_work(
      types, client_optimizer, lambda: build_fedgma_client_update(model_fn, gradient_batches))


def build_fedgma(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    *,
    server_step_size: float = DEFAULT_SERVER_STEP_SIZE,
    mask_threshold: float = DEFAULT_MASK_THRESHOLD,
    gradient_batches: Optional[int] = None,
    secure: bool = False,
    value_bound: Optional[float] = None,
    gradient_bound: Optional[float] = None,
    weight_bound: float = 1e4,
    mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
) -> tff.learning.templates.LearningProcess:
  """FedGMA as a `tff.learning.templates.LearningProcess` (composed like TFF's FedAvg; same client datasets).

  Args:
    model_fn: no-arg callable returning a `tff.learning.models.VariableModel`.
    client_optimizer_fn: the client's `tff.learning.optimizers.Optimizer` (the paper: SGD).
    server_optimizer_fn: applied to `Delta + eta_s * masked gradient`; default SGD with learning rate 1, the
      paper's server (weighted model average, then the masked step).
    server_step_size: eta_s >= 0 (the paper tunes it; 0 gives FedAvg).
    mask_threshold: the AND-mask's p in [0, 1], the fraction of clients that must agree on a sign (paper: 0.8;
      `FedGMAFactory`).
    gradient_batches: None (default) for the gradient over the whole round dataset at the starting model, or
      the number of leading batches to use (cheaper: the full pass costs as much as one more local epoch).
    secure, value_bound, gradient_bound, weight_bound, mean_factory: see `FedGMAFactory`.
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(1.0)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')
  aggregator_factory = FedGMAFactory(
      server_step_size=server_step_size, mask_threshold=mask_threshold, secure=secure, value_bound=value_bound,
      gradient_bound=gradient_bound, weight_bound=weight_bound, mean_factory=mean_factory)
  client_work = build_fedgma_client_work(
      model_fn, client_optimizer_fn, gradient_batches=gradient_batches, metrics_aggregator=metrics_aggregator)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  return client_lib.compose_with_aggregator(types, client_work, aggregator_factory, server_optimizer_fn)
