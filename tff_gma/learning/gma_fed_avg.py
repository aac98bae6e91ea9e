"""GMA for any server optimizer (GMA paper, Algorithm 2: FedAvg, FedAdam, FedYogi) as a composed `tff.learning` process.

The server optimizer's state sees the unmasked weighted mean and the GMA mask scales its step, w + m * (w_opt - w),
where `GradientMaskedFactory` as a model aggregator masks the optimizer's input (the same for SGD; an adaptive
optimizer largely cancels a soft mask). The mask rides beside the mean in the aggregator's result, so the process
keeps `build_weighted_fed_avg`'s state and metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import gradient_masked
from tff_gma.learning import client_lib


# ----------------------------------------------------------------------------------------------------------------
# Plain TF.


def masked_optimizer_step(optimizer: tff.learning.optimizers.Optimizer, optimizer_state, weights, mean, mask):
  """Algorithm 2's server step: `(optimizer state after seeing mean, w + m * (optimizer step of w - w))`.

  The optimizer's state (its moments) is updated with the unmasked `mean`; only the weights' change is masked,
  coordinate by coordinate, so m = 1 keeps the optimizer's step and m = 0 keeps the old weight.
  """
  new_state, stepped = optimizer.next(optimizer_state, weights, mean)
  masked = tf.nest.map_structure(lambda w, s, m: w + tf.cast(m, w.dtype) * (s - w), weights, stepped, mask)
  return new_state, masked


# ----------------------------------------------------------------------------------------------------------------
# Federated pieces.


def build_gma_finalizer(
    optimizer: tff.learning.optimizers.Optimizer,
    model_weights_type: tff.StructWithPythonType,
    should_reject_update: Callable[[Any, Any], Any] = tff.learning.templates.reject_non_finite_update,
) -> tff.learning.templates.FinalizerProcess:
  """TFF's `build_apply_optimizer_finalizer` with the GMA mask applied to the step (`masked_optimizer_step`).

  `next(state, weights, update)` takes `update = OrderedDict(mean=Delta, mask=m)` (the result of
  `GradientMaskedFactory.create_mean_and_mask`) and returns the new `ModelWeights` (non-trainable ones unchanged).
  As TFF's finalizer: the state is the optimizer's state, `get_hparams`/`set_hparams` are the optimizer's, and
  `should_reject_update(new_optimizer_state, Delta)` (default: TFF's rejection of a non-finite update, measured
  as `update_non_finite`) keeps the old state and weights for a rejected round.

  Args:
    optimizer: the server's `tff.learning.optimizers.Optimizer` (fed the unmasked mean).
    model_weights_type: the type of the model's `tff.learning.models.ModelWeights`.
    should_reject_update: as in `tff.learning.templates.build_apply_optimizer_finalizer`.

  Raises:
    ValueError: if `optimizer` is not a `tff.learning.optimizers.Optimizer`.
    TypeError: if `model_weights_type` is not an unplaced `ModelWeights` type.
  """
  client_lib.check_optimizer(optimizer, 'optimizer')
  if (not isinstance(model_weights_type, tff.StructWithPythonType)
      or model_weights_type.python_container is not tff.learning.models.ModelWeights):
    raise TypeError(f'model_weights_type must be the unplaced type of tff.learning.models.ModelWeights, got '
                    f'{model_weights_type}')
  trainable_type = model_weights_type.trainable
  update_type = gradient_masked.mean_and_mask_type(trainable_type)

  @tff.tensorflow.computation()
  def init_tf():
    return optimizer.initialize(tff.types.type_to_tf_tensor_specs(trainable_type))

  state_type = init_tf.type_signature.result

  @tff.tensorflow.computation(state_type, trainable_type, update_type)
  @tf.function
  def next_tf(optimizer_state, trainable, update):
    mean = update[gradient_masked.MEAN]
    new_state, new_trainable = masked_optimizer_step(
        optimizer, optimizer_state, trainable, mean, update[gradient_masked.MASK])
    should_reject, measurements = should_reject_update(new_state, mean)
    if should_reject:  # A tf.cond: the round leaves state and weights as they were.
      return optimizer_state, trainable, measurements
    return new_state, new_trainable, measurements

  @tff.federated_computation()
  def init_fn():
    return tff.federated_eval(init_tf, tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(model_weights_type, tff.SERVER),
                             tff.FederatedType(update_type, tff.SERVER))
  def next_fn(state, weights, update):
    new_state, new_trainable, measurements = tff.federated_map(next_tf, (state, weights.trainable, update))
    new_weights = tff.federated_zip(tff.learning.models.ModelWeights(new_trainable, weights.non_trainable))
    return tff.templates.MeasuredProcessOutput(new_state, new_weights, measurements)

  @tff.tensorflow.computation(state_type)
  def get_hparams_fn(state):
    return optimizer.get_hparams(state)

  @tff.tensorflow.computation(state_type, get_hparams_fn.type_signature.result)
  def set_hparams_fn(state, hparams):
    return optimizer.set_hparams(state, hparams)

  return tff.learning.templates.FinalizerProcess(
      init_fn, next_fn, get_hparams_fn=get_hparams_fn, set_hparams_fn=set_hparams_fn)


def build_gma_server_processes(
    masking: gradient_masked.GradientMaskedFactory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    model_weights_type: tff.StructWithPythonType,
) -> tuple[tff.templates.AggregationProcess, tff.learning.templates.FinalizerProcess]:
  """(aggregator, finalizer) of Algorithm 2, to compose in place of (model_aggregator's process, TFF's finalizer).

  `masking` gives tau, the mask and the inner weighted mean (secure or not); its aggregation of the model updates
  (weights float32, as TFF's `build_weighted_fed_avg`) returns the unmasked mean and the mask, which
  `build_gma_finalizer` applies to `server_optimizer`'s step.
  """
  if not isinstance(masking, gradient_masked.GradientMaskedFactory):
    raise ValueError(f'masking must be a tff_gma.aggregators.GradientMaskedFactory, got {masking!r}')
  aggregator = masking.create_mean_and_mask(model_weights_type.trainable, tff.TensorType(np.float32))
  return aggregator, build_gma_finalizer(server_optimizer, model_weights_type)


# ----------------------------------------------------------------------------------------------------------------
# Builder.


def _functional_model_weights_fn(model: tff.learning.models.FunctionalModel) -> tff.Computation:
  """The initial `ModelWeights` of a functional model, as TFF's `build_weighted_fed_avg` builds them."""

  @tff.tensorflow.computation()
  def initial_weights_fn():
    trainable, non_trainable = model.initial_weights
    return tff.learning.models.ModelWeights(tuple(tf.convert_to_tensor(w) for w in trainable),
                                            tuple(tf.convert_to_tensor(w) for w in non_trainable))

  return initial_weights_fn


def _check_builder_options(model_aggregator, client_weighting, loop_implementation, metrics_aggregator) -> None:
  """Raises ValueError, naming the argument, for an invalid option of `build_gma_fed_avg`."""
  if model_aggregator is not None and (
      not isinstance(model_aggregator, tff.aggregators.WeightedAggregationFactory)
      or isinstance(model_aggregator, gradient_masked.GradientMaskedFactory)):
    raise ValueError(f'model_aggregator must be a weighted-mean tff.aggregators.WeightedAggregationFactory (the '
                     f'mean inside GMA; tau and mask are set here), got {model_aggregator!r}')
  if not isinstance(client_weighting, tff.learning.ClientWeighting):
    raise ValueError(f'client_weighting must be a tff.learning.ClientWeighting, got {client_weighting!r}')
  if not isinstance(loop_implementation, tff.learning.LoopImplementation):
    raise ValueError(f'loop_implementation must be a tff.learning.LoopImplementation, got {loop_implementation!r}')
  if metrics_aggregator is not None and not callable(metrics_aggregator):
    raise ValueError(f'metrics_aggregator must be callable (e.g. tff.learning.metrics.secure_sum_then_finalize), '
                     f'got {metrics_aggregator!r}')


def _model_delta_client_work(
    model_fn, client_optimizer_fn, client_weighting, metrics_aggregator, loop_implementation,
) -> tuple[tff.Computation, tff.learning.templates.ClientWorkProcess]:
  """(initial `ModelWeights` computation, TFF's model-delta client work) for a model builder or a functional model."""
  if isinstance(model_fn, tff.learning.models.FunctionalModel):
    initial_weights_fn = _functional_model_weights_fn(model_fn)
    client_work = tff.learning.templates.build_functional_model_delta_client_work(
        model=model_fn, optimizer=client_optimizer_fn, client_weighting=client_weighting,
        metrics_aggregator=metrics_aggregator, loop_implementation=loop_implementation)
    return initial_weights_fn, client_work
  if not callable(model_fn):
    raise ValueError(f'model_fn must be a no-argument callable returning a tff.learning.models.VariableModel, or a '
                     f'tff.learning.models.FunctionalModel, got {model_fn!r}')
  initial_weights_fn = client_lib.model_types(model_fn, metrics_aggregator).initial_weights_fn
  client_work = tff.learning.templates.build_model_delta_client_work(
      model_fn, client_optimizer_fn, client_weighting, metrics_aggregator,
      loop_implementation=loop_implementation)
  return initial_weights_fn, client_work


def build_gma_fed_avg(
    model_fn: Callable[[], tff.learning.models.VariableModel] | tff.learning.models.FunctionalModel,
    client_optimizer_fn: tff.learning.optimizers.Optimizer,
    server_optimizer_fn: Optional[tff.learning.optimizers.Optimizer] = None,
    *,
    tau: float = gradient_masked.DEFAULT_TAU,
    mask: str = 'soft',
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    client_weighting: tff.learning.ClientWeighting = tff.learning.ClientWeighting.NUM_EXAMPLES,
    metrics_aggregator=None,
    loop_implementation: tff.learning.LoopImplementation = client_lib.DEFAULT_LOOP_IMPLEMENTATION,
) -> tff.learning.templates.LearningProcess:
  """GMA with any server optimizer (Algorithm 2), as `build_weighted_fed_avg` builds FedAvg.

  Each round: Delta = the clients' weighted mean update, m = GMA's mask of their signs, the server optimizer's
  state updated with the unmasked Delta and its step masked, w_t = w + m * (w_opt - w).

  Composed with `tff.learning.templates.compose_learning_process` from TFF's broadcast, TFF's model-delta client
  work, GMA's mean-and-mask aggregator and `build_gma_finalizer`: `initialize`, `next(state, client_datasets)`,
  `get_model_weights`, `set_model_weights`, `get_hparams`, `set_hparams`, the state and the metrics
  (`distributor`, `client_work`, `aggregator` = GMA's measurements, `finalizer` = `update_non_finite`) are those
  of `tff.learning.algorithms.build_weighted_fed_avg`, whose arguments this mirrors. With SGD as the server
  optimizer it equals `build_weighted_fed_avg(..., model_aggregator=GradientMaskedFactory(tau, mask))`.

  Args:
    model_fn: a no-arg callable returning a `tff.learning.models.VariableModel`, or a
      `tff.learning.models.FunctionalModel` (then trained by TFF's functional model-delta client work), as TFF's
      `build_weighted_fed_avg` accepts.
    client_optimizer_fn: the client's `tff.learning.optimizers.Optimizer`.
    server_optimizer_fn: the server's `tff.learning.optimizers.Optimizer`, fed the unmasked mean (e.g.
      `tff_gma.optimizers.build_reddi_adam` / `build_reddi_yogi`, FedAdam/FedYogi as Reddi et al.'s Algorithm 2,
      which the paper follows; or TFF's bias-corrected `build_adam` / `build_yogi`); default SGD with learning
      rate 1, as TFF's FedAvg.
    tau: GMA's agreement threshold in [0, 1] (paper: 0.4).
    mask: 'soft' (the paper's GMA) or 'binary' (the AND-mask).
    model_aggregator: the inner weighted-mean factory (it must return the weighted mean, zero for zero total
      weight); default `tff_gma.aggregators.FederatedMeanFactory()`, the mean `GradientMaskedFactory` uses, so that
      client updates leave the clients through `federated_mean` only (pass a `SecureWeightedMeanFactory` for
      secure sums only). Not a `GradientMaskedFactory`: the mask is this builder's.
    client_weighting: a `tff.learning.ClientWeighting` (default: number of examples).
    metrics_aggregator: as in TFF's builders (default `tff.learning.metrics.sum_then_finalize`).
    loop_implementation: the client work's training loop, a `tff.learning.LoopImplementation`; default
      `client_lib.DEFAULT_LOOP_IMPLEMENTATION`, DATASET_ITERATOR (the harness's loop too), not TFF's DATASET_REDUCE:
      the same batches in the same order and identical weights, at about half the client CPU per round.

  Raises:
    ValueError: for an invalid argument (the message names it).
  """
  client_lib.check_optimizer(client_optimizer_fn, 'client_optimizer_fn')
  if server_optimizer_fn is None:
    server_optimizer_fn = tff.learning.optimizers.build_sgdm(1.0)
  client_lib.check_optimizer(server_optimizer_fn, 'server_optimizer_fn')
  _check_builder_options(model_aggregator, client_weighting, loop_implementation, metrics_aggregator)
  masking = gradient_masked.GradientMaskedFactory(tau=tau, mask=mask, mean_factory=model_aggregator)
  initial_weights_fn, client_work = _model_delta_client_work(
      model_fn, client_optimizer_fn, client_weighting, metrics_aggregator, loop_implementation)
  weights_type = initial_weights_fn.type_signature.result
  aggregator, finalizer = build_gma_server_processes(masking, server_optimizer_fn, weights_type)
  return tff.learning.templates.compose_learning_process(
      initial_weights_fn, tff.learning.templates.build_broadcast_process(weights_type), client_work, aggregator,
      finalizer)
