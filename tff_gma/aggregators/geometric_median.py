"""`GeometricMedianFactory`: Robust Federated Aggregation (RFA) as a `tff.aggregators` factory.

The result is the smoothed geometric median of the client updates computed by the smoothed Weiszfeld algorithm
with a budget of `num_passes` secure averages (RFA paper, Algorithm 2; math in `weiszfeld`):

  pass 1:      v_1 = weighted mean of w_i with weights a_i
  pass k > 1:  broadcast v_{k-1}; client i computes d_i = ||v_{k-1} - w_i|| (whole flattened update) and its own
               weight b_i = a_i / max(nu, d_i); the server receives only the weighted mean of w_i with weights b_i.

`one_step=True` is one-step RFA (Algorithm 3): a single pass with b_i = a_i / max(nu, ||w_i||), i.e. from the
zero update (the current server model).

Every average goes through one weighted-mean process (`federated_mean` when `secure=False`; only secure sums when
`secure=True`, see `secure_mean`), so the server learns the estimates, never a client's update, distance or
weight. The weights are sent scaled as b'_i = a_i * c / max(c, d_i) (a common factor that cancels): they never
exceed a_i, so they stay inside the secure weight bound; in secure mode c = max(nu, D / max_weight_ratio) keeps
them above the quantization resolution (see `weiszfeld` for why, and what it changes).

Objective. After each pass the objective at the new estimate, D_k = sum_i a_i ||v_k - w_i|| / sum_i a_i (the
weighted mean distance, i.e. sum_i a_i ||v_k - w_i|| normalized by the total weight), is computed by one more
weighted mean of the clients' distances (secure in secure mode, with the bound 2 * value_bound * sqrt(dim)
that clipped points and their convex combinations cannot exceed). In secure mode D_{k-1} also sets the
smoothing of pass k (one-step RFA in secure mode first evaluates D at the zero update for the same purpose).

Measurements (all at SERVER):
  objective: float32[num_passes], D_k after each pass (the last entry is the objective of the result).
  smoothing: float32[num_passes - 1] (one-step: [1]), the c used by each reweighting pass.
  aggregation_calls: the number of weighted means run this round: num_passes for the estimate plus one per
    objective evaluation (num_passes, plus one at the zero update for one-step RFA in secure mode).
  participating_clients: clients with a finite update and a positive weight.
  dropped_clients: clients dropped for a non-finite update or a non-finite or negative weight.
  value_clipped_clients, weight_clipped_clients: clients clipped to the secure bounds (0 unless secure).
  passes, objectives: the inner weighted-mean processes' measurements.

Bad input: as `GradientMaskedFactory` (dropped clients get zero weight in every pass; a round with zero total
weight returns a zero update).

Defaults: num_passes = 3 (the RFA paper's budget; 1 with `one_step=True`), smoothing nu = 1e-6, `secure=False`
(mean semantics by default, as TFF's `MeanFactory`; set `secure=True` with `value_bound` for secure sums only).
`UnweightedGeometricMedianFactory` is the unweighted variant (a_i = 1), for `build_unweighted_fed_avg`.
"""

from __future__ import annotations

import collections
import numbers
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma.aggregators import secure_mean
from tff_gma.aggregators import weiszfeld

DEFAULT_NUM_PASSES = 3


def _check_num_passes(num_passes, one_step: bool) -> int:
  if num_passes is None:
    return 1 if one_step else DEFAULT_NUM_PASSES
  if isinstance(num_passes, bool) or not isinstance(num_passes, numbers.Integral) or num_passes < 1:
    raise ValueError(f'num_passes must be a positive integer, got {num_passes!r}')
  if one_step and num_passes != 1:
    raise ValueError(f'num_passes must be 1 (or None) with one_step=True, got {num_passes!r}')
  return int(num_passes)


def _stack_scalars(scalars_at_server):
  """A float32 vector at SERVER from a list of float32 scalars at SERVER."""
  if not scalars_at_server:
    return tff.federated_value(np.zeros([0], np.float32), tff.SERVER)
  zipped = tff.federated_zip(tuple(scalars_at_server))

  @tff.tensorflow.computation(zipped.type_signature.member)
  def stack(scalars):
    return tf.stack(tf.nest.flatten(scalars))

  return tff.federated_map(stack, zipped)


class GeometricMedianFactory(tff.aggregators.WeightedAggregationFactory):
  """RFA: the smoothed geometric median by `num_passes` secure averages (see the module docstring)."""

  def __init__(
      self,
      num_passes: Optional[int] = None,
      smoothing: float = 1e-6,
      one_step: bool = False,
      secure: bool = False,
      value_bound: Optional[float] = None,
      weight_bound: float = 1e4,
      max_weight_ratio: float = 1e3,
      mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
  ):
    """Initializes the factory.

    Args:
      num_passes: secure averages forming the estimate; default 3 (1 with `one_step=True`, which needs 1).
      smoothing: nu > 0, the smallest distance used in b_i = a_i / max(nu, d_i).
      one_step: one-step RFA (a single reweighted pass from the zero update).
      secure: if True every average goes through secure sums only (`secure_mean.SecureWeightedMeanFactory`),
        with coordinates clipped to `[-value_bound, value_bound]` and weights to `[0, weight_bound]`.
      value_bound: bound on |coordinate| of a client update; required when `secure=True`.
      weight_bound: largest client weight a_i in secure mode (keep it tight; see `secure_mean`).
      max_weight_ratio: K in the secure smoothing c = max(nu, D / K) (see `weiszfeld`); > 1. Larger K keeps
        the exact smoothing down to closer points but costs quantization precision (error grows about as K).
      mean_factory: optional weighted-mean factory for the estimate passes, replacing the one chosen by
        `secure` (it must return a weighted mean, zero for zero total weight, and accept weights in [0, a_i]).

    Raises:
      ValueError: for an invalid argument (the message names it).
    """
    self._one_step = secure_mean.check_bool(one_step, 'one_step')
    self._num_passes = _check_num_passes(num_passes, self._one_step)
    self._smoothing = secure_mean.check_positive_finite(smoothing, 'smoothing')
    self._secure = secure_mean.check_bool(secure, 'secure')
    self._value_bound = None if value_bound is None else secure_mean.check_positive_finite(
        value_bound, 'value_bound')
    self._weight_bound = secure_mean.check_positive_finite(weight_bound, 'weight_bound')
    self._max_weight_ratio = secure_mean.check_positive_finite(max_weight_ratio, 'max_weight_ratio')
    if self._max_weight_ratio <= 1:
      raise ValueError(f'max_weight_ratio must be greater than 1, got {max_weight_ratio!r}')
    default_mean = secure_mean.weighted_mean_factory(self._secure, self._value_bound, self._weight_bound)
    if mean_factory is None:
      mean_factory = default_mean
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
    self._mean_factory = mean_factory

  @property
  def num_passes(self) -> int:
    return self._num_passes

  @property
  def one_step(self) -> bool:
    return self._one_step

  @property
  def secure(self) -> bool:
    return self._secure

  def _objective_factory(self, num_elements: int) -> tff.aggregators.WeightedAggregationFactory:
    if not self._secure:
      return secure_mean.FederatedMeanFactory()
    return secure_mean.SecureWeightedMeanFactory(
        weiszfeld.distance_bound(self._value_bound, num_elements), self._weight_bound)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    secure_mean.check_float_structure(value_type)
    secure_mean.check_weight_type(weight_type)
    scalar = tff.TensorType(np.float32)
    secure, one_step = self._secure, self._one_step
    nu, ratio = self._smoothing, self._max_weight_ratio
    value_bound, weight_bound = self._value_bound, self._weight_bound
    num_passes = self._num_passes
    num_objectives = num_passes + (1 if one_step and secure else 0)
    pass_processes = [self._mean_factory.create(value_type, scalar) for _ in range(num_passes)]
    objective_factory = self._objective_factory(secure_mean.num_elements(value_type))
    objective_processes = [objective_factory.create(scalar, scalar) for _ in range(num_objectives)]

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      value, weight, keep = secure_mean.drop_invalid_clients(value, weight)
      weight = tf.cast(weight, tf.float32)
      if secure:
        value, weight, value_clipped, weight_clipped = secure_mean.clip_to_bounds(
            value, weight, value_bound, weight_bound)
      else:
        value_clipped = weight_clipped = tf.constant(0, tf.int32)
      participating = keep * tf.cast(weight > 0, tf.int32)
      return value, weight, (participating, 1 - keep, value_clipped, weight_clipped)

    @tff.tensorflow.computation(value_type)
    def client_norm(value):
      return weiszfeld.flat_norm(value)

    @tff.tensorflow.computation(value_type, value_type)
    def client_distance(estimate, value):
      return weiszfeld.flat_distance(estimate, value)

    @tff.tensorflow.computation(scalar, scalar, scalar)
    def client_reweight(weight, distance, smoothing):
      return weiszfeld.weiszfeld_weight(weight, distance, smoothing)

    @tff.tensorflow.computation(scalar)
    def server_smoothing(objective):
      return weiszfeld.secure_smoothing(nu, objective, ratio)

    @tff.federated_computation()
    def init_fn():
      return tff.federated_zip(collections.OrderedDict(
          passes=tuple(p.initialize() for p in pass_processes),
          objectives=tuple(p.initialize() for p in objective_processes),
      ))

    @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      prepared = tff.federated_map(client_prepare, (value, weight))
      points, weights = prepared[0], prepared[1]
      participating, dropped, value_clipped, weight_clipped = secure_mean.secure_count(prepared[2])
      pass_states, pass_measurements = [], []
      objective_states, objective_measurements, objectives, smoothings = [], [], [], []

      def run_objective(distance):
        output = objective_processes[len(objective_states)].next(
            state['objectives'][len(objective_states)], distance, weights)
        objective_states.append(output.state)
        objective_measurements.append(output.measurements)
        return output.result

      def run_pass(pass_weights):
        output = pass_processes[len(pass_states)].next(state['passes'][len(pass_states)], points, pass_weights)
        pass_states.append(output.state)
        pass_measurements.append(output.measurements)
        return output.result

      def smoothing_from(objective):
        if secure:
          return tff.federated_map(server_smoothing, objective)
        return tff.federated_value(np.float32(nu), tff.SERVER)

      def reweighted_pass(distance, smoothing):
        smoothings.append(smoothing)
        pass_weights = tff.federated_map(
            client_reweight, (weights, distance, tff.federated_broadcast(smoothing)))
        return run_pass(pass_weights)

      if one_step:
        distance = tff.federated_map(client_norm, points)
        smoothing = smoothing_from(run_objective(distance) if secure else None)
        estimate = reweighted_pass(distance, smoothing)
      else:
        estimate = run_pass(weights)
        for _ in range(num_passes - 1):
          distance = tff.federated_map(client_distance, (tff.federated_broadcast(estimate), points))
          objective = run_objective(distance)
          objectives.append(objective)
          estimate = reweighted_pass(distance, smoothing_from(objective))
      final_distance = tff.federated_map(client_distance, (tff.federated_broadcast(estimate), points))
      objectives.append(run_objective(final_distance))

      new_state = tff.federated_zip(collections.OrderedDict(
          passes=tuple(pass_states), objectives=tuple(objective_states)))
      measurements = collections.OrderedDict(
          objective=_stack_scalars(objectives),
          smoothing=_stack_scalars(smoothings),
          aggregation_calls=tff.federated_value(np.int32(num_passes + num_objectives), tff.SERVER),
          participating_clients=participating,
          dropped_clients=dropped,
          value_clipped_clients=value_clipped,
          weight_clipped_clients=weight_clipped,
          passes=tff.federated_zip(tuple(pass_measurements)),
          objectives=tff.federated_zip(tuple(objective_measurements)),
      )
      return tff.templates.MeasuredProcessOutput(new_state, estimate, tff.federated_zip(measurements))

    return tff.templates.AggregationProcess(init_fn, next_fn)


class UnweightedGeometricMedianFactory(tff.aggregators.UnweightedAggregationFactory):
  """`GeometricMedianFactory` with a_i = 1 for every client (same arguments; `weight_bound` defaults to 1)."""

  def __init__(self, num_passes: Optional[int] = None, smoothing: float = 1e-6, one_step: bool = False,
               secure: bool = False, value_bound: Optional[float] = None, weight_bound: float = 1.0,
               max_weight_ratio: float = 1e3,
               mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None):
    self._weighted = GeometricMedianFactory(num_passes, smoothing, one_step, secure, value_bound, weight_bound,
                                            max_weight_ratio, mean_factory)

  def create(self, value_type) -> tff.templates.AggregationProcess:
    return secure_mean.as_unweighted(self._weighted).create(value_type)
