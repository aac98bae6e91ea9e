"""`ElasticFactory`: Elastic aggregation (Elastic Aggregation paper, Algorithm 1) as a `tff.aggregators` factory.

The weighted mean update scaled per parameter by zeta = 1 + tau - Omega / max(Omega), Omega the clients' weighted
mean sensitivity, the max taken per tensor (client work: `tff_gma.learning.elastic`). A tensor without sensitivity
keeps zeta = 1, so FedAvg is the limit.
"""

from __future__ import annotations

import collections
import math
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values
from tff_gma.aggregators import mean
from tff_gma.aggregators import paired_values
from tff_gma.aggregators import result_checks
from tff_gma.aggregators import secure_mean

UPDATE = 'update'
SENSITIVITY = 'sensitivity'
DEFAULT_TAU = 0.5  # The Elastic aggregation paper's tau.


# ----------------------------------------------------------------------------------------------------------------
# Plain TF.


def elastic_scale(omega: tf.Tensor, tau: float) -> tf.Tensor:
  """zeta = 1 + tau - omega / max(omega) for one tensor; all ones when max(omega) <= 0.

  Zero sensitivity says nothing about which parameters are more sensitive, so such a tensor keeps its plain mean
  (zeta = 1, as FedAvg) rather than `1 + tau`, which would scale its server learning rate; a negative max (only
  from the secure mean's quantization noise) is treated the same way.
  """
  top = tf.reduce_max(omega) if omega.shape.num_elements() != 0 else tf.zeros([], omega.dtype)
  ratio = tf.math.divide_no_nan(omega, top)
  scaled = 1.0 + tf.constant(tau, omega.dtype) - ratio
  return tf.where(top > 0, scaled, tf.ones_like(omega))


def elastic_scales(sensitivity, tau: float):
  """`elastic_scale` for every tensor of the structure `sensitivity`, each tensor scaled by its own max."""
  return tf.nest.map_structure(lambda omega: elastic_scale(omega, tau), sensitivity)


def apply_elastic_scales(scales, mean_update):
  """zeta * Delta, leaf by leaf."""
  return tf.nest.map_structure(lambda z, d: tf.cast(z, d.dtype) * d, scales, mean_update)


def scale_statistics(scales) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """(min, max, mean) of zeta over all coordinates of the structure (float32)."""
  flat = tf.concat([tf.reshape(tf.cast(z, tf.float32), [-1]) for z in tf.nest.flatten(scales)], axis=0)
  return tf.reduce_min(flat), tf.reduce_max(flat), tf.reduce_mean(flat)


def scaled_update_error_bound(omega, delta, omega_error, delta_error, tau: float, eps: float = 2.0**-24):
  """Per-coordinate bound on |out' - zeta * Delta| for one tensor in secure mode (NumPy).

  Infinite when the tensor's max sensitivity is not above its secure error.

  Args:
    omega, delta: the exact weighted means of the sensitivity and of the update, for one tensor.
    omega_error, delta_error: per-coordinate bounds on their secure errors (`secure_mean.error_bound`).
    tau: the elasticity.
    eps: the unit roundoff of the tensor's dtype (float32).
  """
  omega, delta = np.asarray(omega, np.float64), np.asarray(delta, np.float64)
  omega_error = np.broadcast_to(np.asarray(omega_error, np.float64), omega.shape)
  delta_error = np.broadcast_to(np.asarray(delta_error, np.float64), delta.shape)
  top, top_error = float(np.max(omega)), float(np.max(omega_error))
  if top <= 0 and top_error == 0:
    return delta_error + eps * (np.abs(delta) + delta_error)
  if top <= top_error:
    return np.full(delta.shape, np.inf)
  ratio = omega / top
  zeta = 1 + tau - ratio
  ratio_error = (omega_error + ratio * top_error + eps * (omega + omega_error)) / (top - top_error)
  zeta_error = 1.0001 * (ratio_error + eps * (2 + 3 * tau))
  return (zeta_error + eps * (zeta + zeta_error)) * (np.abs(delta) + delta_error) + zeta * delta_error


# ----------------------------------------------------------------------------------------------------------------
# Factory.


def _check_tau(tau) -> float:
  try:
    value = float(tau)
  except (TypeError, ValueError):
    raise ValueError(f'tau must be a finite non-negative number, got {tau!r}') from None
  if isinstance(tau, bool) or not math.isfinite(value) or value < 0:
    raise ValueError(f'tau must be a finite non-negative number, got {tau!r}')
  return value


class ElasticFactory(tff.aggregators.WeightedAggregationFactory):
  """Elastic aggregation: the weighted mean update, scaled per parameter by the aggregated sensitivity.

  Values: `collections.OrderedDict(update=<structure>, sensitivity=<same structure>)`; result: the scaled update
  (the `update` structure). With w_k the clients' normalized weights:

      Omega = sum_k w_k Omega_k,        Delta = sum_k w_k Delta_k                 (two weighted means)
      zeta  = 1 + tau - Omega / max(Omega)      (per tensor: the max is over one tensor, the paper's "layer")
      out   = zeta * Delta                      (elementwise; zeta = 1 for a tensor with max(Omega) <= 0)

  The two weighted means are the only flows of client values (secure sums only with `secure=True`). A client with
  a non-finite value, or a non-finite or negative weight, is dropped; a round without weight returns zeros.

  Measurements (all at SERVER):
    zeta_min, zeta_max, zeta_mean: statistics of the scale over all coordinates.
    dropped_clients: clients dropped for a non-finite value or a non-finite/negative weight.
    nonfinite_result, zero_result: 0/1, the scaled mean was non-finite and replaced by a zero update / is all
      zeros although a participating client sent a non-zero update (`result_checks`).
    update, sensitivity: the measurements of the two inner weighted means.
  """

  def __init__(
      self,
      tau: float = DEFAULT_TAU,
      secure: bool = False,
      value_bound: Optional[float] = None,
      sensitivity_bound: Optional[float] = None,
      weight_bound: float = 1e4,
  ):
    """Initializes the factory.

    Args:
      tau: the elasticity, >= 0 (paper default 0.5): zeta ranges over [tau, 1 + tau].
      secure: if True both weighted means go through secure sums only (`secure_mean.SecureWeightedMeanFactory`).
      value_bound: bound on |coordinate| of a client update; required when `secure=True`.
      sensitivity_bound: bound on a client's sensitivity coordinates when `secure=True`; defaults to
        `value_bound`.
      weight_bound: largest client weight (examples per client) in secure mode.

    Raises:
      ValueError: for an invalid argument (the message names it).
    """
    self._tau = _check_tau(tau)
    self._secure = checks.check_bool(secure, 'secure')
    if value_bound is not None:
      checks.check_positive_finite(value_bound, 'value_bound')
    if sensitivity_bound is not None:
      checks.check_positive_finite(sensitivity_bound, 'sensitivity_bound')
    else:
      sensitivity_bound = value_bound
    checks.check_positive_finite(weight_bound, 'weight_bound')
    if self._secure and value_bound is None:
      raise ValueError('value_bound is required when secure=True, got None')
    self._update_mean = mean.weighted_mean_factory(self._secure, value_bound, weight_bound)
    self._sensitivity_mean = mean.weighted_mean_factory(self._secure, sensitivity_bound, weight_bound)

  @property
  def tau(self) -> float:
    return self._tau

  @property
  def secure(self) -> bool:
    return self._secure

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    update_type, sensitivity_type = paired_values.split_paired_value_type(value_type, UPDATE, SENSITIVITY)
    client_values.check_weight_type(weight_type)
    # The clients cast their weights to float (`client_values.drop_invalid_clients`); the means get those.
    float_weight_type = client_values.float_weight_type(weight_type)
    update_process = self._update_mean.create(update_type, float_weight_type)
    sensitivity_process = self._sensitivity_mean.create(sensitivity_type, float_weight_type)
    tau = self._tau

    @tff.federated_computation()
    def init_fn():
      return tff.federated_zip(collections.OrderedDict(
          update=update_process.initialize(), sensitivity=sensitivity_process.initialize()))

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      value, weight, keep = client_values.drop_invalid_clients(value, weight)
      nonzero = result_checks.sends_nonzero(value[UPDATE], keep * tf.cast(weight > 0, tf.int32))
      return value[UPDATE], value[SENSITIVITY], weight, (1 - keep, nonzero)

    @tff.tensorflow.computation(update_type, sensitivity_type, tff.TensorType(np.int32))
    def server_scale(mean_update, mean_sensitivity, nonzero_clients):
      # A non-finite sensitivity mean would make every zeta NaN; such a round keeps the plain mean (zeta = 1).
      mean_sensitivity, _ = result_checks.finite_or_zero(mean_sensitivity)
      scales = elastic_scales(mean_sensitivity, tau)
      zeta_min, zeta_max, zeta_mean = scale_statistics(scales)
      result, flags = result_checks.check_result(apply_elastic_scales(scales, mean_update), nonzero_clients)
      return result, zeta_min, zeta_max, zeta_mean, flags

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      update, sensitivity, clean_weight, counts = tff.federated_map(client_prepare, (value, weight))
      dropped, nonzero = secure_mean.secure_count(counts)
      update_output = update_process.next(state[UPDATE], update, clean_weight)
      sensitivity_output = sensitivity_process.next(state[SENSITIVITY], sensitivity, clean_weight)
      result, zeta_min, zeta_max, zeta_mean, result_flags = tff.federated_map(
          server_scale, (update_output.result, sensitivity_output.result, nonzero))
      new_state = tff.federated_zip(collections.OrderedDict(
          update=update_output.state, sensitivity=sensitivity_output.state))
      measurements = tff.federated_zip(collections.OrderedDict(
          zeta_min=zeta_min,
          zeta_max=zeta_max,
          zeta_mean=zeta_mean,
          dropped_clients=dropped,
          nonfinite_result=result_flags['nonfinite_result'],
          zero_result=result_flags['zero_result'],
          update=update_output.measurements,
          sensitivity=sensitivity_output.measurements,
      ))
      return tff.templates.MeasuredProcessOutput(new_state, result, measurements)

    return tff.templates.AggregationProcess(init_fn, next_fn)
