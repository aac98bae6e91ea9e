"""`GradientMaskedFactory`: Gradient Masked Averaging (GMA) as a `tff.aggregators` factory.

Result (GMA paper, eq. 3 and Algorithm 1; math in `sign_agreement`):

    Delta = sum_n s_n Delta_n / sum_n s_n          (s_n the client weights; an inner weighted-mean factory)
    A_j   = |(1/N) sum_n sign(Delta_n,j)|          (unweighted, over the N participating clients)
    m_j   = 1 if A_j >= tau else (A_j | 0)         (`mask='soft'` | `mask='binary'`)
    out   = m * Delta

`tau = 0` gives m = 1 everywhere, i.e. exactly the inner weighted mean.

Privacy. Only two kinds of intrinsics move client data to the server: the inner weighted mean (`federated_mean`
when `secure=False`; only `federated_secure_sum_bitwidth` when `secure=True`, see `secure_mean`), and
`federated_secure_sum` for the sign codes (`max_input=2`) and the client counts (`max_input=1`). The server thus
learns the weighted mean, the per-coordinate sign counts and the number of clients: aggregates, never a
client's own signs or values. With `secure=True` nothing but secure sums leaves the clients.

Participation and bad input. The agreement is over the clients that contribute to the mean: a finite update and
a positive weight (TFF's own client work already turns a diverged client into a zero update of weight 0; such
a client is left out of N rather than voting sign 0). A client with a NaN/Inf anywhere in its update, or a
non-finite or negative weight, is dropped: zero value, zero weight, zero sign codes, not counted in N, counted
in `dropped_clients`. A round where every client is dropped (or all weights are zero) returns a zero update.
With the unweighted factory every client has weight 1 and votes (as with TFF's `UnweightedMeanFactory`, a
client that TFF's client work zeroed then counts as a zero update).

Defaults: `tau=0.4` and `mask='soft'` as in the paper; `secure=False`, because TFF users expect the plain mean
semantics of `tff.aggregators.MeanFactory` (no bounds to choose, no clipping, no quantization); the sign
agreement is always securely summed. Set `secure=True` (with `value_bound`) to move the mean through secure sums as well (what the audit checks).

Unweighted use: `UnweightedGradientMaskedFactory` (same arguments) is a
`tff.aggregators.UnweightedAggregationFactory` that runs the weighted process with weight 1 for every client,
for `tff.learning.algorithms.build_unweighted_fed_avg`. Two classes, as TFF's `MeanFactory` /
`UnweightedMeanFactory`, rather than one class deriving from both bases: TFF dispatches on
`isinstance(factory, UnweightedAggregationFactory)` in places, and an object that is both would be ambiguous.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import secure_mean
from tff_gma.aggregators import sign_agreement


DEFAULT_TAU = 0.4  # The GMA paper's agreement threshold.


def _int_codes_type(value_type):
  """The value's structure with every tensor as int32 of the same shape."""
  return tff.to_type(tff.types.structure_from_tensor_type_tree(
      lambda t: tff.TensorType(np.int32, t.shape), value_type))


class GradientMaskedFactory(tff.aggregators.WeightedAggregationFactory):
  """Gradient Masked Averaging: the weighted mean, masked by the clients' sign agreement.

  Measurements (all at SERVER):
    masked_fraction: fraction of all coordinates with agreement A < tau (down-weighted or zeroed).
    mean_agreement: mean of A over all coordinates.
    participating_clients: N, the number of clients with a finite update and a positive weight (the voters).
    dropped_clients: clients dropped for a non-finite update or a non-finite/negative weight.
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
    self._tau = secure_mean.check_fraction(tau, 'tau')
    if mask not in sign_agreement.MASKS:
      raise ValueError(f'mask must be one of {sign_agreement.MASKS}, got {mask!r}')
    self._mask = mask
    self._secure = secure_mean.check_bool(secure, 'secure')
    if value_bound is not None:
      secure_mean.check_positive_finite(value_bound, 'value_bound')
    secure_mean.check_positive_finite(weight_bound, 'weight_bound')
    if mean_factory is None:
      mean_factory = secure_mean.weighted_mean_factory(self._secure, value_bound, weight_bound)
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
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
    secure_mean.check_float_structure(value_type)
    secure_mean.check_weight_type(weight_type)
    # The clients cast their weights to float (`secure_mean.drop_invalid_clients`); the mean gets those.
    mean_process = self._mean_factory.create(value_type, secure_mean.float_weight_type(weight_type))
    tau, mask = self._tau, self._mask

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      value, weight, keep = secure_mean.drop_invalid_clients(value, weight)
      # Only clients that contribute to the mean vote: TFF's client work itself sends a zero update with
      # weight 0 for a client whose training diverged, and that zero must not dilute the agreement.
      votes = keep * tf.cast(weight > 0, tf.int32)
      codes = sign_agreement.sign_codes(value, votes)
      return value, weight, codes, (votes, 1 - keep)

    @tff.tensorflow.computation(value_type, _int_codes_type(value_type), tff.TensorType(np.int32))
    def server_mask(delta, code_sum, num_clients):
      agreement = sign_agreement.agreement(code_sum, num_clients)
      masked = sign_agreement.apply_mask(sign_agreement.gradient_mask(agreement, tau, mask), delta)
      masked_fraction, mean_agreement = sign_agreement.mask_statistics(agreement, tau)
      return masked, masked_fraction, mean_agreement

    @tff.federated_computation(mean_process.state_type, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      prepared = tff.federated_map(client_prepare, (value, weight))
      mean_output = mean_process.next(state, prepared[0], prepared[1])
      code_sum = tff.federated_secure_sum(prepared[2], sign_agreement.MAX_SIGN_CODE)
      participating, dropped = secure_mean.secure_count(prepared[3])
      masked, masked_fraction, mean_agreement = tff.federated_map(
          server_mask, (mean_output.result, code_sum, participating))
      measurements = collections.OrderedDict(
          masked_fraction=masked_fraction,
          mean_agreement=mean_agreement,
          participating_clients=participating,
          dropped_clients=dropped,
          mean=mean_output.measurements,
      )
      return tff.templates.MeasuredProcessOutput(mean_output.state, masked, tff.federated_zip(measurements))

    return tff.templates.AggregationProcess(mean_process.initialize, next_fn)


class UnweightedGradientMaskedFactory(tff.aggregators.UnweightedAggregationFactory):
  """`GradientMaskedFactory` with weight 1 for every client (same arguments; `weight_bound` defaults to 1)."""

  def __init__(self, tau: float = DEFAULT_TAU, mask: str = 'soft', secure: bool = False,
               value_bound: Optional[float] = None, weight_bound: float = 1.0,
               mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None):
    self._weighted = GradientMaskedFactory(tau, mask, secure, value_bound, weight_bound, mean_factory)

  def create(self, value_type) -> tff.templates.AggregationProcess:
    return secure_mean.as_unweighted(self._weighted).create(value_type)
