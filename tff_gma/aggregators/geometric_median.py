"""`GeometricMedianFactory`: Robust Federated Aggregation (RFA) as a `tff.aggregators` factory.

The smoothed geometric median of the client updates by smoothed Weiszfeld with a budget of `num_passes` weighted
means, each one sequential client->server round (RFA paper, Algorithms 2 and 3; math in `weiszfeld`). It starts
from the zero update by default, not the paper's mean, which an omniscient attacker controls (`DEFAULT_INIT`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import client_values
from tff_gma.aggregators import composition
from tff_gma.aggregators import mean
from tff_gma.aggregators import result_checks
from tff_gma.aggregators import secure_mean
from tff_gma.aggregators import staged
from tff_gma.aggregators import weiszfeld

DEFAULT_NUM_PASSES = 3  # The RFA paper's budget of secure averages per round.
DEFAULT_SMOOTHING = 1e-6  # nu.
DEFAULT_WEIGHT_BOUND = 1e4
DEFAULT_MAX_WEIGHT_RATIO = 1e3
INITS = ('mean', 'zero')
# Where Weiszfeld starts. The paper's start, the weighted mean, is the one point an omniscient attacker places (at
# minus the honest mean), and a few passes from it do not get back. The zero update is the current model, which no
# client can move.
DEFAULT_INIT = 'zero'


def _check_num_passes(num_passes, one_step: bool) -> int:
  if num_passes is None:
    return 1 if one_step else DEFAULT_NUM_PASSES
  num_passes = checks.check_positive_int(num_passes, 'num_passes')
  if one_step and num_passes != 1:
    raise ValueError(f'num_passes must be 1 (or None) with one_step=True, got {num_passes!r}')
  return num_passes


def _check_init(init, one_step: bool) -> str:
  if init is None:
    return 'zero' if one_step else DEFAULT_INIT
  if init not in INITS:
    raise ValueError(f'init must be one of {INITS}, got {init!r}')
  if one_step and init != 'zero':
    raise ValueError(f"init must be 'zero' (or None) with one_step=True, got {init!r}")
  return init


def _sum_flags(flags_at_server):
  """The int32 sum at SERVER of a list of int32 scalars at SERVER (0 for none)."""
  if not flags_at_server:
    return tff.federated_value(np.int32(0), tff.SERVER)
  zipped = tff.federated_zip(tuple(flags_at_server))

  @tff.tensorflow.computation(zipped.type_signature.member)
  def add(flags):
    return tf.add_n(tf.nest.flatten(flags))

  return tff.federated_map(add, zipped)


def _stack_scalars(scalars_at_server):
  """A float32 vector at SERVER from a list of float32 scalars at SERVER."""
  if not scalars_at_server:
    return tff.federated_value(np.zeros([0], np.float32), tff.SERVER)
  zipped = tff.federated_zip(tuple(scalars_at_server))

  @tff.tensorflow.computation(zipped.type_signature.member)
  def stack(scalars):
    return tf.stack(tf.nest.flatten(scalars))

  return tff.federated_map(stack, zipped)


def prepare_client(value, weight, secure: bool, value_bound: Optional[float], weight_bound: float):
  """One client's point and weight, as every pass of the round uses them, and its counts.

  Drops an invalid client (`client_values.drop_invalid_clients`), casts the weight to float32 and a float16 or
  bfloat16 value to float32 (`client_values.compute_dtype`: RFA's weights a_i nu / d_i are float16 subnormals),
  and, when `secure`, clips the value and the weight to the secure bounds. Returns `(value, weight,
  (participating, dropped, value_clipped, weight_clipped, nonzero))`, the flags int32 0/1; a client participates
  when kept with a positive weight, and is nonzero when it also sends a non-zero update.
  """
  value, weight, keep = client_values.drop_invalid_clients(value, weight)
  value = client_values.to_compute_dtypes(value)
  weight = tf.cast(weight, tf.float32)
  if secure:
    value, weight, value_clipped, weight_clipped = client_values.clip_to_bounds(
        value, weight, value_bound, weight_bound)
  else:
    value_clipped = weight_clipped = tf.constant(0, tf.int32)
  participating = keep * tf.cast(weight > 0, tf.int32)
  nonzero = result_checks.sends_nonzero(value, participating)
  return value, weight, (participating, 1 - keep, value_clipped, weight_clipped, nonzero)


def is_exact_mean(mean_factory: tff.aggregators.WeightedAggregationFactory) -> bool:
  """Whether `mean_factory` is a weighted mean known to carry weights of any size (float sums, no quantizer).

  `FederatedMeanFactory`, and TFF's `MeanFactory` with its default `SumFactory` sums. Any other factory (secure
  sums, TFF's `secure_aggregator`, compression, wrappers whose inside is not known) may quantize the weights with
  a fixed resolution, so RFA gives it weights a quantizer can carry (`GeometricMedianFactory`, the smoothing).
  """
  if isinstance(mean_factory, mean.FederatedMeanFactory):
    return True
  if type(mean_factory) is tff.aggregators.MeanFactory:  # pylint: disable=unidiomatic-typecheck
    sums = (getattr(mean_factory, '_value_sum_factory', None), getattr(mean_factory, '_weight_sum_factory', None))
    return all(type(s) is tff.aggregators.SumFactory for s in sums)  # pylint: disable=unidiomatic-typecheck
  return False


@dataclasses.dataclass(frozen=True)
class _Computations:
  """The TF computations of RFA's rounds, over one value type (`_build_computations`)."""
  client_prepare: tff.Computation  # (value, weight) -> `prepare_client`'s triple.
  client_norm: tff.Computation  # value -> ||value||, the distance to v_0 = 0.
  client_distance: tff.Computation  # (estimate, value) -> ||estimate - value||.
  client_reweight: tff.Computation  # (weight, distance, smoothing) -> (Vardi-Zhang weight, spread vector).
  client_plain_spread: tff.Computation  # distance -> the spread vector of a plain mean's pass (`weiszfeld`).
  server_smoothing: tff.Computation  # previous objective -> the floored smoothing c = max(nu, S / K).
  server_first_finite: tff.Computation  # estimate -> (estimate, or v_0 = 0 when non-finite; 0/1 flag).
  server_keep_finite: tff.Computation  # (previous, estimate) -> (estimate, or previous when non-finite; flag).
  server_step: tff.Computation  # (iterate, far mean, spread, c) -> (Vardi-Zhang step, stalled, near share).
  server_first_step: tff.Computation  # (far mean, spread, c) -> the step from v_0 = 0.
  server_near_smoothing: tff.Computation  # (c, scale) -> max(c, near_fraction * scale).
  server_median_distance: tff.Computation  # spread -> the weighted median distance it measured.
  server_finish: tff.Computation  # (estimate, nonzero clients) -> (result in the value's dtypes, checks).


def _build_computations(value_type, weight_type, secure: bool, value_bound: Optional[float], weight_bound: float,
                        nu: float, ratio: float, near_fraction: float) -> _Computations:
  """`_Computations` for `value_type` and `weight_type`, around `prepare_client` and `weiszfeld`'s math."""
  scalar = tff.TensorType(np.float32)
  point_type = client_values.compute_type(value_type)
  near_rule = near_fraction > 0

  @tff.tensorflow.computation(value_type, weight_type)
  def client_prepare(value, weight):
    return prepare_client(value, weight, secure, value_bound, weight_bound)

  @tff.tensorflow.computation(point_type)
  def client_norm(value):
    return weiszfeld.flat_norm(value)

  @tff.tensorflow.computation(point_type, point_type)
  def client_distance(estimate, value):
    return weiszfeld.flat_distance(estimate, value)

  @tff.tensorflow.computation(scalar, scalar, scalar)
  def client_reweight(weight, distance, smoothing):
    return weiszfeld.reweight(weight, distance, smoothing, near_rule)  # Without it, every client is a far one.

  @tff.tensorflow.computation(scalar)
  def client_plain_spread(distance):
    return weiszfeld.plain_spread(distance)

  spread_type = tff.TensorType(np.float32, [weiszfeld.spread_size()])

  def step(iterate, far_mean, spread, smoothing):
    estimate, stalled = weiszfeld.vardi_zhang_step(iterate, far_mean, spread, smoothing)
    return estimate, stalled, spread[weiszfeld.NEAR]

  server_step = tff.tensorflow.computation(step, point_type, point_type, spread_type, scalar)

  @tff.tensorflow.computation(point_type, spread_type, scalar)
  def server_first_step(far_mean, spread, smoothing):
    return step(tf.nest.map_structure(tf.zeros_like, far_mean), far_mean, spread, smoothing)

  @tff.tensorflow.computation(scalar, scalar)
  def server_near_smoothing(smoothing, scale):
    return weiszfeld.near_smoothing(smoothing, scale, near_fraction)

  @tff.tensorflow.computation(spread_type)
  def server_median_distance(spread):
    return weiszfeld.median_distance(spread)

  @tff.tensorflow.computation(scalar)
  def server_smoothing(previous_objective):
    return weiszfeld.secure_smoothing(nu, previous_objective, ratio)

  @tff.tensorflow.computation(point_type)
  def server_first_finite(estimate):
    return result_checks.finite_or_zero(estimate)

  @tff.tensorflow.computation(point_type, point_type)
  def server_keep_finite(previous, estimate):
    finite = client_values.all_finite(estimate)
    kept = tf.nest.map_structure(lambda p, e: tf.where(finite, e, p), previous, estimate)
    return kept, 1 - tf.cast(finite, tf.int32)

  dtypes = [t.dtype for t in client_values.tensor_types(value_type)]

  @tff.tensorflow.computation(point_type, tff.TensorType(np.int32))
  def server_finish(estimate, nonzero_clients):
    return result_checks.check_result(client_values.cast_leaves(estimate, dtypes), nonzero_clients)

  return _Computations(client_prepare, client_norm, client_distance, client_reweight, client_plain_spread,
                       server_smoothing, server_first_finite, server_keep_finite, server_step, server_first_step,
                       server_near_smoothing, server_median_distance, server_finish)


# The entries of the carry from one stage of a call to the next (`_RoundLedger.carry`), in order.
_CARRIED_LISTS = ('pass_states', 'pass_measurements', 'nonfinite_flags', 'objective_states', 'objective_measurements',
                  'objectives', 'smoothings', 'spread_states', 'spread_measurements', 'spreads', 'near_weights',
                  'stalled_flags')


class _RoundLedger:
  """Runs one `next` call's weighted means (estimate passes, objectives) in call order and keeps their outputs.

  The i-th pass (objective) run uses the i-th process and the i-th entry of the state's `passes` (`objectives`).
  What it keeps is SERVER-placed, so a call can run as stages (`carry`, `from_carry`) that each get the clients'
  prepared points and weights anew.
  """

  def __init__(self, state, counts, processes, points, weights, computations):
    self._state, self.counts, self._points, self._computations = state, counts, points, computations
    self._pass_processes, self._objective_processes, self._spread_processes = processes
    self.points, self.weights = points, weights
    self.estimate = None
    self.pass_states, self.pass_measurements, self.nonfinite_flags = [], [], []
    self.objective_states, self.objective_measurements, self.objectives, self.smoothings = [], [], [], []
    self.spread_states, self.spread_measurements, self.spreads, self.near_weights, self.stalled_flags = (
        [], [], [], [], [])

  @property
  def scale(self):
    """The weighted median distance the latest pass measured; before any, the previous call's (the state's)."""
    if self.spreads:
      return tff.federated_map(self._computations.server_median_distance, self.spreads[-1])
    return self._state['scale']

  def carry(self) -> collections.OrderedDict:
    """What a later stage needs: the state, the clients' counts, the estimate and every output so far."""
    carry = collections.OrderedDict(state=self._state, counts=self.counts)
    if self.estimate is not None:
      carry['estimate'] = self.estimate
    for name in _CARRIED_LISTS:
      if getattr(self, name):  # An empty tuple is not a federated value; `from_carry` reads it as none yet.
        carry[name] = tuple(getattr(self, name))
    return carry

  @classmethod
  def from_carry(cls, carry, processes, points, weights, computations) -> '_RoundLedger':
    names = tff.structure.name_list(carry.type_signature)
    ledger = cls(carry['state'], carry['counts'], processes, points, weights, computations)
    ledger.estimate = carry['estimate'] if 'estimate' in names else None
    for name in _CARRIED_LISTS:
      if name in names:
        setattr(ledger, name, [carry[name][i] for i in range(len(carry[name].type_signature))])
    return ledger

  def measure_objective(self, distance) -> None:
    """D(v) from the clients' d_i = ||v - w_i||: a weighted mean with the original weights a_i."""
    index = len(self.objective_states)
    output = self._objective_processes[index].next(self._state['objectives'][index], distance, self.weights)
    self.objective_states.append(output.state)
    self.objective_measurements.append(output.measurements)
    self.objectives.append(output.result)

  def _measure_spread(self, spread_values) -> None:
    index = len(self.spread_states)
    output = self._spread_processes[index].next(self._state['spreads'][index], spread_values, self.weights)
    self.spread_states.append(output.state)
    self.spread_measurements.append(output.measurements)
    self.spreads.append(output.result)

  def _finite(self, mean):
    """`mean`, or the estimate before it (v_0 = 0 in the first pass) where an inner mean that lost the weights or
    overflowed made it non-finite, counted, so that the passes after it start from a finite point."""
    if self.estimate is None:
      mean, nonfinite = tff.federated_map(self._computations.server_first_finite, mean)
    else:
      mean, nonfinite = tff.federated_map(self._computations.server_keep_finite, (self.estimate, mean))
    self.nonfinite_flags.append(nonfinite)
    return mean

  def _mean_of_points(self, pass_weights):
    index = len(self.pass_states)
    output = self._pass_processes[index].next(self._state['passes'][index], self._points, pass_weights)
    self.pass_states.append(output.state)
    self.pass_measurements.append(output.measurements)
    return output.result

  def mean_pass(self, distance) -> None:
    """The paper's first pass from the mean start: the weighted mean with the weights a_i."""
    self._measure_spread(tff.federated_map(self._computations.client_plain_spread, distance))
    self.estimate = self._finite(self._mean_of_points(self.weights))

  def reweighted_pass(self, distance, smoothing) -> None:
    """A Weiszfeld pass by Vardi and Zhang's rule: the clients reweight by their `distance` to the current
    estimate with smoothing c, those within c sending weight 0, and the server steps (`weiszfeld`)."""
    smoothing = tff.federated_map(self._computations.server_near_smoothing, (smoothing, self.scale))
    self.smoothings.append(smoothing)
    pass_weights, spread_values = tff.federated_map(
        self._computations.client_reweight, (self.weights, distance, tff.federated_broadcast(smoothing)))
    self._measure_spread(spread_values)
    far_mean = self._finite(self._mean_of_points(pass_weights))
    spread = self.spreads[-1]
    if self.estimate is None:
      step = tff.federated_map(self._computations.server_first_step, (far_mean, spread, smoothing))
    else:
      step = tff.federated_map(self._computations.server_step, (self.estimate, far_mean, spread, smoothing))
    estimate, stalled, near_share = step[0], step[1], step[2]
    self.near_weights.append(near_share)
    self.stalled_flags.append(stalled)
    self.estimate = estimate

  def distance_to_estimate(self):
    """Each client's d_i: to v_0 = 0 before the first pass, else to the broadcast estimate."""
    if self.estimate is None:
      return tff.federated_map(self._computations.client_norm, self._points)
    return tff.federated_map(self._computations.client_distance,
                             (tff.federated_broadcast(self.estimate), self._points))


class GeometricMedianFactory(tff.aggregators.WeightedAggregationFactory):
  """RFA: the smoothed geometric median in `num_passes` rounds of secure averages.

  The inner mean gets weights in [0, a_i]; unless it is known to be exact (`is_exact_mean`), or with `secure`,
  the smoothing is floored at c = max(nu, S / K) so that no weight falls below about a_i / K of the clients at the
  scale S (see `weiszfeld`). Float16 and bfloat16 values are averaged in float32 and the result cast back.

  Pass 1 reweights from the zero update (`init='zero'`, the default: b_i = a_i / max(nu, ||w_i||)) or is the
  weighted mean (`init='mean'`, the paper's Algorithm 2); pass k > 1 broadcasts v_{k-1}, each client computes its
  distance d_i = ||v_{k-1} - w_i|| and its weight b_i = a_i / max(nu, d_i), and the server receives only the
  weighted mean of the w_i with weights b_i. The clients also send a_i d_i, for the objective D(v) (the weighted
  mean distance), in the same round. Bad input: dropped clients get zero weight in every pass; a round with zero
  total weight returns a zero update.

  Measurements (all at SERVER):
    objective: float32[num_passes] (+1 with `report_final_objective`), entry k = D(v_k): the objective at the
      zero update (k = 0) and at the estimate broadcast by pass k + 1; the last entry is D(v_R), the objective of
      the result, only with `report_final_objective`.
    smoothing: the c used by each reweighting pass: float32[num_passes] from the zero start (every pass
      reweights; one-step: [1]), float32[num_passes - 1] from the mean (pass 1 is the plain weighted mean).
    aggregation_calls: the number of sequential client->server aggregation rounds run this call (`num_rounds`):
      num_passes, plus one with `report_final_objective`, plus one for a zero start's D(0) when the smoothing is
      floored without a value bound. (Each round holds the estimate's weighted mean and the objective's, computed
      side by side; the final-objective round holds the objective's only.)
    participating_clients: clients with a finite update and a positive weight.
    dropped_clients: clients dropped for a non-finite update or a non-finite or negative weight.
    value_clipped_clients, weight_clipped_clients: clients clipped to the secure bounds (0 unless secure).
    nonfinite_passes: passes whose inner mean returned a NaN or Inf; each was replaced by the estimate before it.
    nonfinite_result, zero_result: 0/1, the result was non-finite and replaced by zeros / is all zeros although a
      participating client sent a non-zero update (`result_checks`).
    near_weight: float32[one per reweighting pass], the share of the clients' weight within the smoothing of the
      iterate, which Vardi and Zhang's step counts as at it.
    stalled_passes: reweighting passes that left the estimate where it was (the near clients outweighed every pull
      away, as at a geometric median on a data point, or no client lay beyond the smoothing).
    passes, objectives, spreads: the inner weighted-mean processes' measurements (`objectives[k]` measured D(v_k);
      `spreads[k]` the k-th pass's near and far shares and distance histogram).

  No client can pin the estimate: each pass takes Vardi and Zhang's modified Weiszfeld step (`weiszfeld`), in which
  the clients within the smoothing c of the iterate send weight 0 and count only as a weight at the iterate, so a
  client sending a zero, tiny or near-zero update cannot hold a zero start at zero. c is raised to `near_fraction`
  of the weighted median distance the previous round measured (the first pass: the previous call's median norm,
  kept in the state; none in the first call), from a histogram of the distances the clients send beside each pass.
  A cohort that lies wholly within c of the iterate leaves it there (within c of every client).
  """

  def __init__(
      self,
      num_passes: Optional[int] = None,
      smoothing: float = DEFAULT_SMOOTHING,
      one_step: bool = False,
      secure: bool = False,
      value_bound: Optional[float] = None,
      weight_bound: float = DEFAULT_WEIGHT_BOUND,
      max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
      mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
      report_final_objective: bool = False,
      init: Optional[str] = None,
      near_fraction: float = weiszfeld.DEFAULT_NEAR_FRACTION,
  ):
    """Initializes the factory.

    Args:
      num_passes: secure averages (= sequential rounds) forming the estimate; default 3 (1 with
        `one_step=True`, which needs 1).
      smoothing: nu > 0, the smallest distance used in b_i = a_i / max(nu, d_i).
      one_step: one-step RFA (a single reweighted pass from the zero update).
      secure: if True every average goes through secure sums only (`secure_mean.SecureWeightedMeanFactory`),
        with coordinates clipped to `[-value_bound, value_bound]` and weights to `[0, weight_bound]`.
      value_bound: bound on |coordinate| of a client update; required when `secure=True`.
      weight_bound: largest client weight a_i in secure mode (keep it tight; see `secure_mean`).
      max_weight_ratio: K in the secure smoothing c = max(nu, S / K) (see `weiszfeld`); > 1. Larger K keeps
        the exact smoothing down to closer points but costs quantization precision (error grows about as K).
      mean_factory: optional weighted-mean factory for the estimate passes, replacing the one chosen by
        `secure` (it must return a weighted mean and accept weights in [0, a_i]). A factory not known to be
        exact (`is_exact_mean`) gets the floored smoothing, as in secure mode.
      report_final_objective: also measure D(v_R), the objective of the result. Costs one more sequential
        round per call (the clients compute their distance to the result and send it through one more
        weighted mean): num_passes + 1 rounds instead of num_passes.
      near_fraction: f in [0, 1): the smoothing of a reweighting pass is at least f times the median distance of
        the round before; 0 turns the near rule off (the paper's smoothed Weiszfeld, which one client at the
        start can pin).
      init: where Weiszfeld starts. 'mean' (the RFA paper's Algorithm 2): pass 1 is the weighted mean.
        'zero': pass 1 is a Weiszfeld reweighting from v_0 = 0 (the current server model), i.e. one-step RFA,
        and each further pass reweights from the previous estimate. Default: 'zero' with `one_step=True`
        (which is `init='zero', num_passes=1`), else `DEFAULT_INIT` (see its comment for why).

    Raises:
      ValueError: for an invalid argument (the message names it).
    """
    self._one_step = checks.check_bool(one_step, 'one_step')
    self._num_passes = _check_num_passes(num_passes, self._one_step)
    self._init = _check_init(init, self._one_step)
    self._smoothing = checks.check_positive_finite(smoothing, 'smoothing')
    self._secure = checks.check_bool(secure, 'secure')
    self._value_bound = None if value_bound is None else checks.check_positive_finite(
        value_bound, 'value_bound')
    self._weight_bound = checks.check_positive_finite(weight_bound, 'weight_bound')
    self._max_weight_ratio = checks.check_positive_finite(max_weight_ratio, 'max_weight_ratio')
    if self._max_weight_ratio <= 1:
      raise ValueError(f'max_weight_ratio must be greater than 1, got {max_weight_ratio!r}')
    default_mean = mean.weighted_mean_factory(self._secure, self._value_bound, self._weight_bound)
    if mean_factory is None:
      mean_factory = default_mean
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
    composition.check_weighted_mean(
        mean_factory, 'GeometricMedianFactory',
        "RFA's passes are means weighted by the Weiszfeld weights, so it would return a plain mean")
    self._mean_factory = mean_factory
    self._report_final_objective = checks.check_bool(report_final_objective, 'report_final_objective')
    self._near_fraction = checks.check_fraction(near_fraction, 'near_fraction', high_open=True)
    # Weights a quantizer can carry: the smoothing is floored at S / K for every mean not known to be exact.
    self._floored = self._secure or not is_exact_mean(mean_factory)
    # With no value bound to scale a zero start's first pass, its S is D(0), measured in a round of its own.
    self._measures_start_scale = self._floored and not self._secure and self._init == 'zero'

  @property
  def num_passes(self) -> int:
    return self._num_passes

  @property
  def one_step(self) -> bool:
    return self._one_step

  @property
  def init(self) -> str:
    return self._init

  @property
  def secure(self) -> bool:
    return self._secure

  @property
  def report_final_objective(self) -> bool:
    return self._report_final_objective

  @property
  def num_rounds(self) -> int:
    """Sequential client->server rounds per call: num_passes, plus one with `report_final_objective`, plus one
    when a zero start's first smoothing needs D(0) first (a mean not known to be exact, `secure=False`)."""
    return self._num_objectives + int(self._measures_start_scale)

  @property
  def _num_objectives(self) -> int:
    return self._num_passes + int(self._report_final_objective)

  def _objective_factory(self, num_elements: int) -> tff.aggregators.WeightedAggregationFactory:
    if not self._secure:
      return mean.FederatedMeanFactory()
    return secure_mean.SecureWeightedMeanFactory(
        weiszfeld.distance_bound(self._value_bound, num_elements), self._weight_bound)

  def _spread_factory(self) -> tff.aggregators.WeightedAggregationFactory:
    if not self._secure:
      return mean.FederatedMeanFactory()
    return secure_mean.SecureWeightedMeanFactory(1.0, self._weight_bound)  # Every entry of a spread is in [0, 1].

  def _first_smoothing(self, num_elements: int) -> np.float32:
    """The c of a zero start's first reweighting: a constant, known before the round (`weiszfeld`)."""
    if self._secure and self._init == 'zero':
      return np.float32(weiszfeld.one_step_secure_smoothing(
          self._smoothing, self._value_bound, num_elements, self._max_weight_ratio))
    return np.float32(self._smoothing)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    parts = self._call_parts(value_type, weight_type)
    value_type, weight_type = parts.value_type, parts.weight_type

    @tff.federated_computation(parts.init_fn.type_signature.result, tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      ledger = parts.start(state, value, weight)
      for run_round in parts.rounds:
        run_round(ledger)
      return parts.finish(ledger)

    return tff.templates.AggregationProcess(parts.init_fn, next_fn)

  def create_staged(self, value_type, weight_type) -> staged.StagedAggregationProcess:
    """The process `create` returns, with `next` as one computation per sequential round (`num_rounds` stages).

    Stage k runs round k (its estimate's and objective's weighted means, side by side); the first also counts the
    clients, the last also finishes the result. Each stage prepares the clients' points and weights from their
    values anew (the same way every time), and the stages pass on only SERVER-placed values: the state, the
    estimate, the smoothings, and the inner means' states and measurements so far. The last stage's
    `MeasuredProcessOutput` equals `create(...).next`'s.
    """
    parts = self._call_parts(value_type, weight_type)
    client_types = (tff.FederatedType(parts.value_type, tff.CLIENTS), tff.FederatedType(parts.weight_type, tff.CLIENTS))
    stages, carry_type = [], parts.init_fn.type_signature.result
    for index, run_round in enumerate(parts.rounds):
      stage = _stage_computation(parts, index, run_round, carry_type, client_types)
      stages.append(stage)
      carry_type = stage.type_signature.result
    return staged.StagedAggregationProcess(parts.init_fn, tuple(stages))

  def _call_parts(self, value_type, weight_type) -> '_CallParts':
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    value_type, weight_type = tff.to_type(value_type), tff.to_type(weight_type)
    scalar = tff.TensorType(np.float32)
    num_elements = client_values.num_elements(value_type)
    # One objective per pass: D(v_0), ..., D(v_{R-1}) alongside the passes, D(v_R) in the optional last round.
    point_type = client_values.compute_type(value_type)
    # One inner process for every pass (and one for every objective): a process holds no state of its own (each
    # pass's is its entry of the state's `passes`), so creating it once, tracing its computations once, is enough.
    pass_processes = [self._mean_factory.create(point_type, scalar)] * self._num_passes
    objective_processes = [self._objective_factory(num_elements).create(scalar, scalar)] * self._num_objectives
    spread_type = tff.TensorType(np.float32, [weiszfeld.spread_size()])
    spread_processes = [self._spread_factory().create(spread_type, scalar)] * self._num_passes
    computations = _build_computations(value_type, weight_type, self._secure, self._value_bound,
                                       self._weight_bound, self._smoothing, self._max_weight_ratio,
                                       self._near_fraction)

    @tff.federated_computation()
    def init_fn():
      return tff.federated_zip(collections.OrderedDict(
          passes=tuple(p.initialize() for p in pass_processes),
          objectives=tuple(p.initialize() for p in objective_processes),
          spreads=tuple(p.initialize() for p in spread_processes),
          scale=tff.federated_value(np.float32(0), tff.SERVER),
      ))

    processes = (pass_processes, objective_processes, spread_processes)
    return _CallParts(value_type, weight_type, init_fn, processes, computations,
                      self._rounds(computations, self._first_smoothing(num_elements)), self.num_rounds)

  def _rounds(self, computations: _Computations, first_smoothing: np.float32) -> list:
    """The sequential rounds of one `next` call (the class docstring), in order, each a step on the ledger."""

    def start(ledger: _RoundLedger) -> None:
      # Round 1: the distances to v_0 = 0 give D(v_0) (and the weights of a zero start, as in one-step RFA).
      # Nothing in it depends on an aggregate, and the zero start's smoothing is a constant, so it is one round.
      distance = ledger.distance_to_estimate()
      ledger.measure_objective(distance)
      if self._init == 'mean':
        ledger.mean_pass(distance)
      elif not self._measures_start_scale:
        ledger.reweighted_pass(distance, tff.federated_value(first_smoothing, tff.SERVER))

    def scaled_start(ledger: _RoundLedger) -> None:
      # A zero start whose smoothing is floored at D(0) / K with D(0) not known beforehand waits a round for it.
      smoothing = tff.federated_map(computations.server_smoothing, ledger.objectives[-1])
      ledger.reweighted_pass(ledger.distance_to_estimate(), smoothing)

    def weiszfeld(ledger: _RoundLedger) -> None:
      # Round k = 2..R: broadcast v_{k-1}; its distances give both D(v_{k-1}) and the weights of pass k. The
      # floored smoothing comes from D(v_{k-2}), measured in round k - 1, so the round waits for nothing else.
      previous_objective = ledger.objectives[-1]
      distance = ledger.distance_to_estimate()
      ledger.measure_objective(distance)
      if self._floored:
        smoothing = tff.federated_map(computations.server_smoothing, previous_objective)
      else:
        smoothing = tff.federated_value(np.float32(self._smoothing), tff.SERVER)
      ledger.reweighted_pass(distance, smoothing)

    def final_objective(ledger: _RoundLedger) -> None:  # Round R + 1, only on request: D(v_R).
      ledger.measure_objective(ledger.distance_to_estimate())

    rounds = [start] + [scaled_start] * self._measures_start_scale + [weiszfeld] * (self._num_passes - 1)
    return rounds + [final_objective] * self._report_final_objective


@dataclasses.dataclass(frozen=True)
class _CallParts:
  """What one `next` call of a `GeometricMedianFactory` process is made of, over one value type."""
  value_type: tff.Type
  weight_type: tff.Type
  init_fn: tff.Computation
  processes: tuple  # (pass processes, objective processes, spread processes): lists, one entry a use.
  computations: _Computations
  rounds: list  # Each `(ledger) -> None`, one sequential round (`GeometricMedianFactory._rounds`).
  num_rounds: int

  def prepared(self, value, weight):
    """The clients' (points, weights, flags) from their values (`prepare_client`)."""
    prepared = tff.federated_map(self.computations.client_prepare, (value, weight))
    return prepared[0], prepared[1], prepared[2]

  def start(self, state, value, weight) -> _RoundLedger:
    points, weights, flags = self.prepared(value, weight)
    return _RoundLedger(state, secure_mean.secure_count(flags), self.processes, points, weights, self.computations)

  def resume(self, carry, value, weight) -> _RoundLedger:
    points, weights, _ = self.prepared(value, weight)
    return _RoundLedger.from_carry(carry, self.processes, points, weights, self.computations)

  def finish(self, ledger: _RoundLedger) -> tff.templates.MeasuredProcessOutput:
    participating, dropped, value_clipped, weight_clipped, nonzero = ledger.counts
    result, result_flags = tff.federated_map(self.computations.server_finish, (ledger.estimate, nonzero))
    new_state = tff.federated_zip(collections.OrderedDict(
        passes=tuple(ledger.pass_states), objectives=tuple(ledger.objective_states),
        spreads=tuple(ledger.spread_states),
        scale=tff.federated_map(self.computations.server_median_distance, ledger.spreads[0])))
    measurements = collections.OrderedDict(
        objective=_stack_scalars(ledger.objectives),
        smoothing=_stack_scalars(ledger.smoothings),
        aggregation_calls=tff.federated_value(np.int32(self.num_rounds), tff.SERVER),
        participating_clients=participating,
        dropped_clients=dropped,
        value_clipped_clients=value_clipped,
        weight_clipped_clients=weight_clipped,
        nonfinite_passes=_sum_flags(ledger.nonfinite_flags),
        near_weight=_stack_scalars(ledger.near_weights),
        stalled_passes=_sum_flags(ledger.stalled_flags),
        nonfinite_result=result_flags['nonfinite_result'],
        zero_result=result_flags['zero_result'],
        passes=tff.federated_zip(tuple(ledger.pass_measurements)),
        objectives=tff.federated_zip(tuple(ledger.objective_measurements)),
        spreads=tff.federated_zip(tuple(ledger.spread_measurements)),
    )
    return tff.templates.MeasuredProcessOutput(new_state, result, tff.federated_zip(measurements))


def _stage_computation(parts: _CallParts, index: int, run_round, carry_type, client_types) -> tff.Computation:
  """Round `index` of a call as a computation: from the state (the first) or the carry, to the carry or the output
  (the last)."""
  last = index == len(parts.rounds) - 1

  @tff.federated_computation(carry_type, *client_types)
  def stage(carry, value, weight):
    ledger = parts.start(carry, value, weight) if index == 0 else parts.resume(carry, value, weight)
    run_round(ledger)
    return parts.finish(ledger) if last else ledger.carry()

  return stage


class UnweightedGeometricMedianFactory(tff.aggregators.UnweightedAggregationFactory):
  """`GeometricMedianFactory` with a_i = 1 for every client (same arguments; `weight_bound` defaults to 1)."""

  def __init__(self, num_passes: Optional[int] = None, smoothing: float = DEFAULT_SMOOTHING, one_step: bool = False,
               secure: bool = False, value_bound: Optional[float] = None, weight_bound: float = 1.0,
               max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
               mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
               report_final_objective: bool = False, init: Optional[str] = None,
               near_fraction: float = weiszfeld.DEFAULT_NEAR_FRACTION):
    self._weighted = GeometricMedianFactory(num_passes, smoothing, one_step, secure, value_bound, weight_bound,
                                            max_weight_ratio, mean_factory, report_final_objective, init,
                                            near_fraction)

  def create(self, value_type) -> tff.templates.AggregationProcess:
    """The geometric median with a_i = 1; refuses to be a slot TFF sums in (`composition`)."""
    composition.check_not_in_sum_slot('UnweightedGeometricMedianFactory', 'a geometric median')
    return mean.as_unweighted(self._weighted).create(value_type)
