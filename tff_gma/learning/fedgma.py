"""FedGMA (Gradient-Masked Federated Optimization, workshop paper, Algorithm 1) as a composed `tff.learning` process.

Client k, from the round's starting model w:
  * grad^k = the gradient of its loss at w: the example-weighted mean of the batch-loss gradients over the
    round's client dataset, or over its first `gradient_batches` batches (computed before training; the paper's
    Algorithm 1 writes the last local step's gradient, its text "the gradient of their loss with respect to the
    initial parameters": this is the latter, the full-data gradient at w);
  * w^k = w after local training as FedAvg; it sends the model update Delta_k = w - w^k (TFF's sign).
Both go up as `OrderedDict(update=Delta_k, gradient=grad^k)` with weight m_k (examples trained on).

Server (`FedGMAFactory`, then the finalizer):
    Delta = sum_k m_k Delta_k / sum_k m_k                 so   w - Delta = sum_k m_k w^k / sum_k m_k (line 8)
    grad  = AND-mask(grad^1..K) * sum_k m_k grad^k / sum_k m_k                                       (line 7)
    update = Delta + eta_s * grad;   w_t = w - server_lr * update                                   (line 9)
With the default server optimizer (SGD, learning rate 1) this is the paper's `w_t = w - eta_s * grad` with
`w` the weighted average of the client models; another server optimizer treats `update` as a pseudo-gradient.

AND-mask threshold. The issue and the paper's experiments (Sec. 4: "p = 0.8, that is, at least 80% of the clients
should be agreeing on gradient signs") define p as the fraction of clients that must agree on a coordinate's
sign; that is what `mask_threshold` means here. The server only learns the secure sum of the sign codes, i.e.
the agreement `A = |mean_k sign(g^k)|`; with q the fraction of clients on the majority sign and no zero
gradients, `A = 2q - 1`, so the mask keeps a coordinate iff `A >= 2p - 1` (`agreement_threshold(p)`, 0 for
p <= 1/2), the `binary` GMA mask (`tff_gma.aggregators.GradientMaskedFactory(tau=2p - 1, mask='binary')`,
used as is, so signs reach the server only as secure sums of sign codes). A client whose gradient coordinate is
exactly 0 counts half for each side there (it moves the sum of signs by 0). The paper's Sec. 3 formula,
`I{p * k <= |sum_k sign(g^k)|}`, thresholds A at p directly; to get it, pass `mask_threshold = (1 + p) / 2`.
Since the mask is the same for every client, the mean of the masked gradients is the masked mean.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import gradient_masked
from tff_gma.aggregators import secure_mean
from tff_gma.learning import client_lib

DEFAULT_MASK_THRESHOLD = 0.8  # The paper's p.
DEFAULT_SERVER_STEP_SIZE = 0.1
AGREEMENT_EPSILON = 1e-6
UPDATE = 'update'
GRADIENT = 'gradient'


# ----------------------------------------------------------------------------------------------------------------
# Plain TF.


def agreement_threshold(mask_threshold: float) -> float:
  """The GMA agreement threshold 2p - 1 (clipped at 0) for "at least a fraction p of the clients agree".

  Less `AGREEMENT_EPSILON`: the agreement is a multiple of 1/N computed in float32, and a round where exactly a
  fraction p agrees must not be masked by rounding (harmless for N < 1e5 clients, where 1/N > 1e-5).
  """
  return max(0.0, 2.0 * mask_threshold - 1.0 - AGREEMENT_EPSILON)


def fedgma_server_update(mean_update, masked_mean_gradient, server_step_size: float):
  """Delta + eta_s * masked mean gradient: what the server optimizer applies (module docstring)."""
  return tf.nest.map_structure(lambda d, g: d + tf.cast(server_step_size, d.dtype) * g,
                               mean_update, masked_mean_gradient)


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

    def reduce_fn(state, batch):
      num_examples, optimizer_state = state
      optimizer_state, batch_examples = client_lib.optimizer_step(
          optimizer, optimizer_state, model, model_weights, batch)
      return num_examples + batch_examples, optimizer_state

    initial_state = (tf.constant(0, tf.int64),
                     client_lib.initial_optimizer_state(optimizer, model_weights, optimizer_hparams))
    num_examples, _ = data.reduce(initial_state, reduce_fn)
    update, weight, gradient, non_finite = client_lib.finish_client_update(
        initial_weights.trainable, model_weights, num_examples, extra=gradient)
    client_lib.reset_metrics_if(model, non_finite)
    value = collections.OrderedDict(update=list(update), gradient=list(gradient))
    return (tff.learning.templates.ClientResult(update=value, update_weight=weight),
            model.report_local_unfinalized_metrics())

  return client_update


# ----------------------------------------------------------------------------------------------------------------
# Aggregator.


def _split_value_type(value_type):
  if not isinstance(value_type, tff.StructType) or isinstance(value_type, tff.FederatedType):
    raise TypeError(f'value_type must be a struct with fields {UPDATE!r} and {GRADIENT!r}, got {value_type}')
  names = [name for name, _ in tff.structure.iter_elements(value_type)]
  if names != [UPDATE, GRADIENT]:
    raise TypeError(f'value_type must have exactly the fields ({UPDATE!r}, {GRADIENT!r}), got {names}')
  update_type, gradient_type = value_type[UPDATE], value_type[GRADIENT]
  secure_mean.check_float_structure(update_type, 'value_type.update')
  secure_mean.check_float_structure(gradient_type, 'value_type.gradient')
  if not update_type.is_equivalent_to(gradient_type):
    raise TypeError(f'value_type.update and value_type.gradient must have the same type, got {update_type} and '
                    f'{gradient_type}')
  return update_type, gradient_type


class FedGMAFactory(tff.aggregators.WeightedAggregationFactory):
  """FedGMA's server step: mean update plus `server_step_size` times the AND-masked mean gradient.

  Values: `OrderedDict(update=<structure>, gradient=<same structure>)`; result: `fedgma_server_update` of the
  two aggregates (the `update` structure).

  Measurements (at SERVER): `update`, the model-update aggregator's measurements; `gradient`, those of the
  `GradientMaskedFactory` (masked_fraction, mean_agreement, participating_clients, dropped_clients, mean).
  """

  def __init__(
      self,
      server_step_size: float = DEFAULT_SERVER_STEP_SIZE,
      mask_threshold: float = DEFAULT_MASK_THRESHOLD,
      secure: bool = False,
      value_bound: Optional[float] = None,
      gradient_bound: Optional[float] = None,
      weight_bound: float = 1e4,
      model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
  ):
    """Initializes the factory.

    Args:
      server_step_size: eta_s >= 0, the step along the masked mean gradient (0: plain FedAvg).
      mask_threshold: p in [0, 1]: keep a coordinate iff at least a fraction p of the clients agree on its sign
        (agreement |mean of signs| >= 2p - 1; module docstring).
      secure: both means through secure sums only (`secure_mean.SecureWeightedMeanFactory`).
      value_bound: bound on |coordinate| of a model update; required when `secure=True` (unless
        `model_aggregator` is given).
      gradient_bound: bound on |coordinate| of a client gradient when `secure=True`; defaults to `value_bound`.
      weight_bound: largest client weight in secure mode.
      model_aggregator: weighted factory for the model updates (default: the weighted mean chosen by `secure`).

    Raises:
      ValueError: for an invalid argument (the message names it).
    """
    try:
      step = float(server_step_size)
    except (TypeError, ValueError):
      raise ValueError(f'server_step_size must be a non-negative number, got {server_step_size!r}') from None
    if isinstance(server_step_size, bool) or not step >= 0 or step == float('inf'):
      raise ValueError(f'server_step_size must be a finite non-negative number, got {server_step_size!r}')
    self._server_step_size = step
    self._mask_threshold = client_lib.check_fraction(mask_threshold, 'mask_threshold')
    secure = secure_mean.check_bool(secure, 'secure')
    if value_bound is not None:
      secure_mean.check_positive_finite(value_bound, 'value_bound')
    if gradient_bound is None:
      gradient_bound = value_bound
    if secure and gradient_bound is None:
      raise ValueError('gradient_bound (or value_bound) is required when secure=True, got None')
    if model_aggregator is None:
      model_aggregator = secure_mean.weighted_mean_factory(secure, value_bound, weight_bound)
    elif not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'model_aggregator must be a tff.aggregators.WeightedAggregationFactory, '
                       f'got {model_aggregator!r}')
    self._model_aggregator = model_aggregator
    self._gradient_aggregator = gradient_masked.GradientMaskedFactory(
        tau=agreement_threshold(self._mask_threshold), mask='binary', secure=secure, value_bound=gradient_bound,
        weight_bound=weight_bound)

  @property
  def server_step_size(self) -> float:
    return self._server_step_size

  @property
  def mask_threshold(self) -> float:
    return self._mask_threshold

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    update_type, gradient_type = _split_value_type(value_type)
    secure_mean.check_weight_type(weight_type)
    update_process = self._model_aggregator.create(update_type, weight_type)
    gradient_process = self._gradient_aggregator.create(gradient_type, weight_type)
    step = self._server_step_size

    @tff.federated_computation()
    def init_fn():
      return tff.federated_zip(collections.OrderedDict(
          update=update_process.initialize(), gradient=gradient_process.initialize()))

    @tff.tensorflow.computation(value_type)
    def split(value):
      return value[UPDATE], value[GRADIENT]

    @tff.tensorflow.computation(update_type, gradient_type)
    def server_update(mean_update, masked_gradient):
      return fedgma_server_update(mean_update, masked_gradient, step)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      update, gradient = tff.federated_map(split, value)
      update_output = update_process.next(state.update, update, weight)
      gradient_output = gradient_process.next(state.gradient, gradient, weight)
      result = tff.federated_map(server_update, (update_output.result, gradient_output.result))
      new_state = tff.federated_zip(collections.OrderedDict(
          update=update_output.state, gradient=gradient_output.state))
      measurements = tff.federated_zip(collections.OrderedDict(
          update=update_output.measurements, gradient=gradient_output.measurements))
      return tff.templates.MeasuredProcessOutput(new_state, result, measurements)

    return tff.templates.AggregationProcess(init_fn, next_fn)


# ----------------------------------------------------------------------------------------------------------------
# Client work and builder.


def build_fedgma_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    client_optimizer: tff.learning.optimizers.Optimizer,
    *,
    gradient_batches: Optional[int] = None,
    metrics_aggregator=None,
) -> tff.learning.templates.ClientWorkProcess:
  """FedGMA's client work (module docstring); state = the client optimizer's hyperparameters."""
  client_lib.check_optimizer(client_optimizer, 'client_optimizer_fn')
  if gradient_batches is not None and (isinstance(gradient_batches, bool) or not isinstance(gradient_batches, int)
                                       or gradient_batches < 1):
    raise ValueError(f'gradient_batches must be None or a positive int, got {gradient_batches!r}')
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
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
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
      module docstring).
    gradient_batches: None (default) for the gradient over the whole round dataset at the starting model, or
      the number of leading batches to use (cheaper: the full pass costs as much as one more local epoch).
    secure, value_bound, gradient_bound, weight_bound, model_aggregator: see `FedGMAFactory`.
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(1.0)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')
  aggregator_factory = FedGMAFactory(
      server_step_size=server_step_size, mask_threshold=mask_threshold, secure=secure, value_bound=value_bound,
      gradient_bound=gradient_bound, weight_bound=weight_bound, model_aggregator=model_aggregator)
  client_work = build_fedgma_client_work(
      model_fn, client_optimizer_fn, gradient_batches=gradient_batches, metrics_aggregator=metrics_aggregator)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  result_type = client_work.next.type_signature.result.result.member
  aggregator = aggregator_factory.create(result_type.update, result_type.update_weight)
  return tff.learning.templates.compose_learning_process(
      types.initial_weights_fn,
      client_lib.broadcast_process(types),
      client_work,
      aggregator,
      client_lib.apply_optimizer_finalizer(server_optimizer_fn, types),
  )
