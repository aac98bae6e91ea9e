"""`FedGMAFactory`: FedGMA's server step (Gradient-Masked Federated Optimization, Algorithm 1) as a factory.

The weighted mean of the clients' model updates plus `server_step_size` times the AND-masked weighted mean of their
gradients at the round's start (client work: `tff_gma.learning.fedgma`); the mask, GMA's binary one, keeps a
coordinate iff at least a fraction p of the clients agree on its sign (agreement >= 2p - 1).
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values
from tff_gma.aggregators import composition
from tff_gma.aggregators import gradient_masked
from tff_gma.aggregators import mean
from tff_gma.aggregators import paired_values
from tff_gma.aggregators import result_checks
from tff_gma.aggregators import secure_mean

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
  """Delta + eta_s * masked mean gradient: what the server optimizer applies.

  With SGD at learning rate 1 the server then moves to the weighted average of the client models, w - Delta, less
  eta_s times the masked gradient: the paper's `w_t = w - eta_s * grad`.
  """
  return tf.nest.map_structure(lambda d, g: d + tf.constant(server_step_size, d.dtype) * g,
                               mean_update, masked_mean_gradient)


# ----------------------------------------------------------------------------------------------------------------
# Factory.


class FedGMAFactory(tff.aggregators.WeightedAggregationFactory):
  """FedGMA's server step: mean update plus `server_step_size` times the AND-masked mean gradient.

  Values: `OrderedDict(update=<structure>, gradient=<same structure>)`; result: `fedgma_server_update` of the
  two aggregates (the `update` structure).

  State (at SERVER): `update`, the state of the model updates' mean (`mean_factory`'s process); `gradient`, that
  of the `GradientMaskedFactory`.
  Measurements (at SERVER): `update`, the measurements of the model updates' mean; `gradient`, those of the
  `GradientMaskedFactory` (masked_fraction, mean_agreement, participating_clients, dropped_clients, mean);
  `nonfinite_result`, `zero_result` (`result_checks`) of the step. A client with a non-finite update or gradient
  (or a non-finite or negative weight) reaches the update's mean as a zero update of weight 0.
  """

  def __init__(
      self,
      server_step_size: float = DEFAULT_SERVER_STEP_SIZE,
      mask_threshold: float = DEFAULT_MASK_THRESHOLD,
      secure: bool = False,
      value_bound: Optional[float] = None,
      gradient_bound: Optional[float] = None,
      weight_bound: float = 1e4,
      mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
  ):
    """Initializes the factory.

    Args:
      server_step_size: eta_s >= 0, the step along the masked mean gradient (0: plain FedAvg).
      mask_threshold: p in [0, 1]: keep a coordinate iff at least a fraction p of the clients agree on its sign
        (agreement |mean of signs| >= 2p - 1; the paper's Sec. 3 formula, which thresholds the agreement at p,
        is `mask_threshold=(1 + p) / 2`).
      secure: both means through secure sums only (`secure_mean.SecureWeightedMeanFactory`).
      value_bound: bound on |coordinate| of a model update; required when `secure=True` (unless
        `mean_factory` is given).
      gradient_bound: bound on |coordinate| of a client gradient when `secure=True`; defaults to `value_bound`.
      weight_bound: largest client weight in secure mode.
      mean_factory: weighted factory for the model updates (default: the weighted mean chosen by `secure`).
        It gets the client weights as given to `create` (the default means accept any float or integer dtype).

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
    self._mask_threshold = checks.check_fraction(mask_threshold, 'mask_threshold')
    secure = checks.check_bool(secure, 'secure')
    if value_bound is not None:
      checks.check_positive_finite(value_bound, 'value_bound')
    if gradient_bound is None:
      gradient_bound = value_bound
    if secure and gradient_bound is None:
      raise ValueError('gradient_bound (or value_bound) is required when secure=True, got None')
    if mean_factory is None:
      mean_factory = mean.weighted_mean_factory(secure, value_bound, weight_bound)
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
    composition.check_weighted_mean(
        mean_factory, 'FedGMAFactory', "FedGMA's update is the clients' weighted mean, a dropped client weight 0")
    self._mean_factory = mean_factory
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
    update_type, gradient_type = paired_values.split_paired_value_type(
        value_type, UPDATE, GRADIENT, same_dtypes=True)
    client_values.check_weight_type(weight_type)
    # The clients cast their weights to float (`client_values.drop_invalid_clients`), as GMA's and RFA's do: TFF's
    # secure_aggregator takes float weights only.
    update_process = self._mean_factory.create(update_type, client_values.float_weight_type(weight_type))
    gradient_process = self._gradient_aggregator.create(gradient_type, weight_type)
    step = self._server_step_size

    @tff.federated_computation()
    def init_fn():
      return tff.federated_zip(collections.OrderedDict(
          update=update_process.initialize(), gradient=gradient_process.initialize()))

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      # The update's mean is the inner factory's: it gets a dropped client as a zero update of weight 0.
      clean, clean_weight, keep = client_values.drop_invalid_clients(value, weight)
      nonzero = result_checks.sends_nonzero(clean, keep * tf.cast(clean_weight > 0, tf.int32))
      return clean[UPDATE], value[GRADIENT], clean_weight, nonzero

    @tff.tensorflow.computation(update_type, gradient_type, tff.TensorType(np.int32))
    def server_update(mean_update, masked_gradient, nonzero_clients):
      return result_checks.check_result(fedgma_server_update(mean_update, masked_gradient, step), nonzero_clients)

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      update, gradient, update_weight, nonzero = tff.federated_map(client_prepare, (value, weight))
      update_output = update_process.next(state.update, update, update_weight)
      gradient_output = gradient_process.next(state.gradient, gradient, weight)
      result, result_flags = tff.federated_map(
          server_update, (update_output.result, gradient_output.result, secure_mean.secure_count(nonzero)))
      new_state = tff.federated_zip(collections.OrderedDict(
          update=update_output.state, gradient=gradient_output.state))
      measurements = tff.federated_zip(collections.OrderedDict(
          update=update_output.measurements, gradient=gradient_output.measurements,
          nonfinite_result=result_flags['nonfinite_result'], zero_result=result_flags['zero_result']))
      return tff.templates.MeasuredProcessOutput(new_state, result, measurements)

    return tff.templates.AggregationProcess(init_fn, next_fn)
