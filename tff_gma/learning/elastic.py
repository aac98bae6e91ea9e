"""Elastic aggregation (Elastic Aggregation paper, Algorithm 1) as a composed `tff.learning` process.

Each client measures its parameters' sensitivity Omega_k on its round's first batches, trains as FedAvg on the
rest and sends both; the server scales the mean update by the sensitivity (`tff_gma.aggregators.ElasticFactory`).
Unlike the paper, the sensitivity batches are re-drawn each round from the round's stream, so the process takes
TFF's FedAvg client datasets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import elastic as elastic_aggregator
from tff_gma.learning import client_lib

DEFAULT_TAU = elastic_aggregator.DEFAULT_TAU
DEFAULT_MU = 0.95
DEFAULT_SENSITIVITY_FRACTION = 0.1


# ----------------------------------------------------------------------------------------------------------------
# Plain TF on a VariableModel.


def output_norm_gradient(model: tff.learning.models.VariableModel, variables, batch) -> tuple:
  """grad over `variables` of the batch mean of ||F(theta; x_j)||_2^2 (inference mode, no metrics updated)."""
  with tf.GradientTape() as tape:
    predictions = model.predict_on_batch(client_lib.batch_features(batch), training=False)
    per_example = tf.reshape(tf.square(predictions), [tf.shape(predictions)[0], -1])
    objective = tf.reduce_mean(tf.reduce_sum(per_example, axis=1))
  return client_lib.gradients_or_zeros(tape.gradient(objective, variables), variables)


def accumulate_sensitivity(omega: tuple, gradient: tuple, mu: float) -> tuple:
  """Omega <- mu * Omega + (1 - mu) * |g|, leaf by leaf."""
  return tuple(mu * o + (1.0 - mu) * tf.abs(g) for o, g in zip(omega, gradient))


def sensitivity_batch_count(num_batches: tf.Tensor, fraction: float) -> tf.Tensor:
  """k = min(ceil(fraction * n), n - 1), and 0 when n <= 1 (int64)."""
  num_batches = tf.cast(num_batches, tf.int64)
  wanted = tf.cast(tf.math.ceil(fraction * tf.cast(num_batches, tf.float64)), tf.int64)
  return tf.maximum(tf.minimum(wanted, num_batches - 1), 0)


def build_elastic_client_update(
    model_fn: Callable[[], tff.learning.models.VariableModel], mu: float, sensitivity_fraction: float,
):
  """A `tf.function` (optimizer, hparams, initial_weights, data) -> (ClientResult, unfinalized metrics).

  Builds its model once, at call time of this function (inside the caller's graph, as TFF's client works do).
  """
  model = model_fn()

  @tf.function
  def client_update(optimizer, optimizer_hparams, initial_weights, data):
    model_weights = tff.learning.models.ModelWeights.from_model(model)
    client_lib.assign_weights(model_weights, initial_weights)
    trainable = tf.nest.flatten(model_weights.trainable)
    num_sensitivity_batches = sensitivity_batch_count(client_lib.count_batches(data), sensitivity_fraction)
    # One iterator, one pass: its first k batches go to Omega, the rest to training (B_k and D_k disjoint even
    # for a stream that reshuffles per iteration). Two loops rather than a per-batch tf.cond: each loop body holds
    # only its own step, which runs several times faster. k <= n - 1, so get_next() never runs past the end.
    # (n is the dataset's cardinality; only when that is unknown does count_batches make a separate pass, which
    # counts batches and feeds neither B_k nor D_k.)
    iterator = iter(data)
    omega = client_lib.zeros_like_trainable(model_weights)
    for _ in tf.range(num_sensitivity_batches):
      gradient = output_norm_gradient(model, trainable, iterator.get_next())
      omega = accumulate_sensitivity(omega, gradient, mu)
    # The shared local pass, handed the iterator where the sensitivity loop left it: D_k = the remaining batches.
    optimizer_state = client_lib.initial_optimizer_state(optimizer, model_weights, optimizer_hparams)
    num_examples = client_lib.local_pass(optimizer, optimizer_state, model, model_weights, iterator).num_examples
    return client_lib.paired_client_output(
        model, initial_weights.trainable, model_weights, num_examples, 'sensitivity', omega)

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Client work and builder.


def build_elastic_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer: tff.learning.optimizers.Optimizer,
    *,
    mu: float = DEFAULT_MU,
    sensitivity_fraction: float = DEFAULT_SENSITIVITY_FRACTION,
    metrics_aggregator=None,
) -> tff.learning.templates.ClientWorkProcess:
  """The client work of elastic aggregation: state = the client optimizer's hyperparameters.

  Per round, from the round's starting model theta: B_k = the stream's first k = min(ceil(sensitivity_fraction *
  n), n - 1) batches (0 when n <= 1) give Omega_k <- mu * Omega_k + (1 - mu) * |grad ||F(theta; x)||_2^2| (F the
  logits, the batch mean of the per-example squared norms; Omega_k from 0); D_k = the remaining batches train as
  FedAvg. Both come from one pass over one iterator, so they are disjoint. The client sends
  `OrderedDict(update=theta - theta_k, sensitivity=Omega_k)` with weight |D_k| (examples trained on).

  Measurements: `train`, the aggregated training metrics (of the D_k batches only).
  """
  client_lib.check_optimizer(client_optimizer, 'client_optimizer_fn')
  mu = checks.check_fraction(mu, 'mu', high_open=True)
  sensitivity_fraction = checks.check_fraction(sensitivity_fraction, 'sensitivity_fraction', high_open=True)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  return client_lib.optimizer_client_work(
      types, client_optimizer, lambda: build_elastic_client_update(model_fn, mu, sensitivity_fraction))


def build_elastic_fed_avg(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    *,
    tau: float = DEFAULT_TAU,
    mu: float = DEFAULT_MU,
    sensitivity_fraction: float = DEFAULT_SENSITIVITY_FRACTION,
    secure: bool = False,
    value_bound: Optional[float] = None,
    sensitivity_bound: Optional[float] = None,
    weight_bound: float = 1e4,
    metrics_aggregator=None,
) -> tff.learning.templates.LearningProcess:
  """FedAvg with elastic aggregation, as a `tff.learning.templates.LearningProcess`.

  Composed from TFF's broadcast distributor, `build_elastic_client_work`, `ElasticFactory` and TFF's
  apply-optimizer finalizer; `initialize`, `next(state, client_datasets)`, `get_model_weights`,
  `set_model_weights`, `get_hparams`, `set_hparams` behave as for `tff.learning.algorithms.build_weighted_fed_avg`
  and the client datasets are the same (batched, e.g. `training.runner.round_loop.client_dataset` in the harness).

  Args:
    model_fn: no-arg callable returning a `tff.learning.models.VariableModel`.
    client_optimizer_fn: the client's `tff.learning.optimizers.Optimizer`.
    server_optimizer_fn: the server's `tff.learning.optimizers.Optimizer`; default SGD with learning rate 1.
    tau: elasticity (paper: 0.5); zeta lies in [tau, 1 + tau].
    mu: sensitivity momentum in [0, 1) (paper: 0.95).
    sensitivity_fraction: fraction in [0, 1) of the round's batches used for the sensitivity (not trained on);
      0 gives Omega = 0, hence zeta = 1: plain FedAvg.
    secure, value_bound, sensitivity_bound, weight_bound: see `ElasticFactory`.
    metrics_aggregator: as in TFF's builders; default `tff.learning.metrics.sum_then_finalize` (pass
      `tff.learning.metrics.secure_sum_then_finalize` to keep metrics to secure sums too).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(1.0)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')
  aggregator_factory = elastic_aggregator.ElasticFactory(
      tau=tau, secure=secure, value_bound=value_bound, sensitivity_bound=sensitivity_bound,
      weight_bound=weight_bound)
  client_work = build_elastic_client_work(
      model_fn, client_optimizer_fn, mu=mu, sensitivity_fraction=sensitivity_fraction,
      metrics_aggregator=metrics_aggregator)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  return client_lib.compose_with_aggregator(types, client_work, aggregator_factory, server_optimizer_fn)
