"""`GradientMaskedFactory`: Gradient Masked Averaging (GMA) as a `tff.aggregators` factory.

The weighted mean times a mask of the clients' sign agreement (GMA paper, eq. 3 and Algorithm 1), the signs
reaching the server only as secure sums. The mask sits before the server optimizer; adaptive servers take
`tff_gma.learning.build_gma_fed_avg`.
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
from tff_gma.aggregators import context_check
from tff_gma.aggregators import mean
from tff_gma.aggregators import result_checks
from tff_gma.aggregators import secure_mean
from tff_gma.aggregators import sign_agreement


DEFAULT_TAU = 0.4  # The GMA paper's agreement threshold.


MEAN = 'mean'  # The fields of `create_mean_and_mask`'s result.
MASK = 'mask'


def _same_shapes(value_type, dtype):
  """The value's structure with every tensor as `dtype` of the same shape."""
  return tff.to_type(tff.types.structure_from_tensor_type_tree(
      lambda t: tff.TensorType(dtype, t.shape), value_type))


def mean_and_mask_type(value_type):
  """Type of `create_mean_and_mask`'s result: `<mean=value_type, mask=value_type's shapes as float32>`.

  The mask is float32 whatever the value's dtypes: it is computed from the agreement, a float32 fraction, and cast
  to each leaf's dtype where it is applied (`sign_agreement.apply_mask`).
  """
  return tff.to_type(collections.OrderedDict([(MEAN, value_type), (MASK, _same_shapes(value_type, np.float32))]))


class GradientMaskedFactory(tff.aggregators.WeightedAggregationFactory):
  """Gradient Masked Averaging: the weighted mean, masked by the clients' sign agreement.

      Delta = sum_n s_n Delta_n / sum_n s_n          (s_n the client weights; the inner weighted-mean factory)
      A_j   = |(1/N) sum_n sign(Delta_n,j)|          (unweighted, over the N participating clients)
      m_j   = 1 if A_j >= tau else (A_j | 0)         (`mask='soft'` | `mask='binary'`)
      out   = m * Delta                              (`tau = 0`: exactly the inner weighted mean)

  The signs reach the server only as a `federated_secure_sum` of sign codes, the clients' number as a secure
  count. A client with a non-finite update, or a non-finite or negative weight, is dropped (zero value and weight,
  no vote); a round without weight returns a zero update.

  The result m * Delta is the update a server optimizer then applies: the mask is placed before the server
  optimizer. That equals the GMA paper's Algorithm 2 only for an SGD server; for FedAdam/FedYogi (whose moments
  Algorithm 2 updates with the unmasked Delta, masking the step) use `tff_gma.learning.build_gma_fed_avg`.

  Measurements (all at SERVER):
    masked_fraction: fraction of all coordinates with agreement A < tau (down-weighted or zeroed).
    mean_agreement: mean of A over all coordinates.
    participating_clients: N, the number of clients with a finite update and a positive weight (the voters).
    dropped_clients: clients dropped for a non-finite update or a non-finite/negative weight.
    nonfinite_result, zero_result: 0/1, the inner mean was non-finite and the result replaced by a zero update /
      the result is all zeros although a participating client sent a non-zero update (`result_checks`).
    mean: the inner weighted-mean factory's measurements (secure mode: `value_clipped_clients`,
      `weight_clipped_clients`).
  """

  def __init__(
      self,
      tau: float = DEFAULT_TAU,
      mask: str = 'soft',
      secure: bool = False,
      value_bound: Optional[float] = None,
      weight_bound: float = 1e4,
      mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
  ):
    """Initializes the factory.

    Args:
      tau: agreement threshold in [0, 1]; coordinates with A >= tau keep the full weighted mean.
      mask: 'soft' (m = A below tau, the GMA paper) or 'binary' (m = 0 below tau, the AND-mask).
      secure: if True the weighted mean goes through secure sums only (`secure_mean.SecureWeightedMeanFactory`),
        clipping every coordinate to `[-value_bound, value_bound]` and every weight to `[0, weight_bound]`.
      value_bound: bound on |coordinate| of a client update; required when `secure=True`.
      weight_bound: largest client weight (e.g. examples per client) in secure mode; keep it tight, the
        discretization error grows with it (see `secure_mean`).
      mean_factory: optional weighted-mean factory replacing the one chosen by `secure` (it must return a
        weighted mean, and zero for zero total weight, e.g. `tff.aggregators.MeanFactory(no_nan_division=True)`
        with secure-sum inner factories).

    Raises:
      ValueError: for an invalid argument (the message names it).
    """
    self._tau = checks.check_fraction(tau, 'tau')
    if mask not in sign_agreement.MASKS:
      raise ValueError(f'mask must be one of {sign_agreement.MASKS}, got {mask!r}')
    self._mask = mask
    self._secure = checks.check_bool(secure, 'secure')
    if value_bound is not None:
      checks.check_positive_finite(value_bound, 'value_bound')
    checks.check_positive_finite(weight_bound, 'weight_bound')
    if mean_factory is None:
      mean_factory = mean.weighted_mean_factory(self._secure, value_bound, weight_bound)
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
    composition.check_weighted_mean(
        mean_factory, 'GradientMaskedFactory',
        "GMA's mean weights each client by its weight and gives a dropped client weight 0")
    self._mean_factory = mean_factory

  @property
  def tau(self) -> float:
    return self._tau

  @property
  def mask(self) -> str:
    return self._mask

  @property
  def secure(self) -> bool:
    return self._secure

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    """The masked weighted mean m * Delta at SERVER (`create_mean_and_mask`'s aggregation, with the mask applied)."""
    return self._create(value_type, weight_type, apply_mask=True)

  def create_mean_and_mask(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    """The unmasked weighted mean and the mask, for a server that applies the mask itself (Algorithm 2).

    The one implementation of GMA's aggregation (`create` applies the mask to this result): same clients,
    secure sums, dropping, state and measurements. The result at SERVER is
    `OrderedDict(mean=Delta, mask=m)` (`mean_and_mask_type(value_type)`): one value, because a
    `tff.templates.AggregationProcess` hands the next stage of a composed learning process only its result
    (see `tff_gma.learning.gma_fed_avg`).
    """
    return self._create(value_type, weight_type, apply_mask=False)

  def _create(self, value_type, weight_type, apply_mask: bool) -> tff.templates.AggregationProcess:
    """GMA's aggregation; the result m * Delta when `apply_mask`, else `OrderedDict(mean=Delta, mask=m)`.

    Either way the result is finite (a non-finite mean becomes a zero update) and `nonfinite_result` and
    `zero_result` describe the result the server gets (`result_checks`).
    """
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    # The clients cast their weights to float (`client_values.drop_invalid_clients`); the mean gets those.
    mean_process = self._mean_factory.create(value_type, client_values.float_weight_type(weight_type))
    tau, mask = self._tau, self._mask

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      value, weight, keep = client_values.drop_invalid_clients(value, weight)
      # Only clients that contribute to the mean vote: TFF's client work itself sends a zero update with
      # weight 0 for a client whose training diverged, and that zero must not dilute the agreement.
      votes = keep * tf.cast(weight > 0, tf.int32)
      codes = sign_agreement.sign_codes(value, votes)
      return value, weight, codes, (votes, 1 - keep, result_checks.sends_nonzero(value, votes))

    @tff.tensorflow.computation(_same_shapes(value_type, np.int32), tff.TensorType(np.int32))
    def server_mask(code_sum, num_clients):
      agreement = sign_agreement.agreement(code_sum, num_clients)
      masked_fraction, mean_agreement = sign_agreement.mask_statistics(agreement, tau)
      return sign_agreement.gradient_mask(agreement, tau, mask), masked_fraction, mean_agreement

    @tff.tensorflow.computation(value_type, _same_shapes(value_type, np.float32), tff.TensorType(np.int32))
    def server_finish(mean_value, gradient_mask, nonzero_clients):
      mean_value, nonfinite = result_checks.finite_or_zero(mean_value)
      update = sign_agreement.apply_mask(gradient_mask, mean_value) if apply_mask else mean_value
      zero = tf.cast(tf.logical_and(result_checks.is_all_zero(update), nonzero_clients > 0), tf.int32)
      if apply_mask:
        return update, nonfinite, zero
      return collections.OrderedDict([(MEAN, mean_value), (MASK, gradient_mask)]), nonfinite, zero

    @tff.federated_computation(mean_process.state_type, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      prepared = tff.federated_map(client_prepare, (value, weight))
      mean_output = mean_process.next(state, prepared[0], prepared[1])
      context_check.warn_if_context_cannot_run('federated_secure_sum')  # Not through secure_count: checked itself.
      code_sum = tff.federated_secure_sum(prepared[2], sign_agreement.MAX_SIGN_CODE)
      participating, dropped, nonzero = secure_mean.secure_count(prepared[3])
      gradient_mask, masked_fraction, mean_agreement = tff.federated_map(server_mask, (code_sum, participating))
      result, nonfinite, zero = tff.federated_map(server_finish, (mean_output.result, gradient_mask, nonzero))
      measurements = collections.OrderedDict(
          masked_fraction=masked_fraction,
          mean_agreement=mean_agreement,
          participating_clients=participating,
          dropped_clients=dropped,
          nonfinite_result=nonfinite,
          zero_result=zero,
          mean=mean_output.measurements,
      )
      return tff.templates.MeasuredProcessOutput(mean_output.state, result, tff.federated_zip(measurements))

    return tff.templates.AggregationProcess(mean_process.initialize, next_fn)


class UnweightedGradientMaskedFactory(tff.aggregators.UnweightedAggregationFactory):
  """`GradientMaskedFactory` with weight 1 for every client (same arguments; `weight_bound` defaults to 1)."""

  def __init__(self, tau: float = DEFAULT_TAU, mask: str = 'soft', secure: bool = False,
               value_bound: Optional[float] = None, weight_bound: float = 1.0,
               mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None):
    self._weighted = GradientMaskedFactory(tau, mask, secure, value_bound, weight_bound, mean_factory)

  def create(self, value_type) -> tff.templates.AggregationProcess:
    """The masked mean with weight 1 per client; refuses to be a slot TFF sums in (`composition`)."""
    composition.check_not_in_sum_slot('UnweightedGradientMaskedFactory', 'a masked mean')
    return mean.as_unweighted(self._weighted).create(value_type)
