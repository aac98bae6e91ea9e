"""`CenteredClippingFactory`: Centered Clipping (Karimireddy, He, Jaggi, ICML 2021) from weighted means only.

v_{l+1} = v_l + sum_i a_i clip_tau(w_i - v_l) / sum_i a_i, clip_tau(z) = z min(1, tau / ||z||), for L iterations:
each iteration broadcasts v_l and runs ONE weighted mean of the clipped differences, so the server sees means only
(and, with `secure=True`, secure sums only; a clipped difference has norm <= tau, so tau bounds its coordinates).
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

# L: the sequential means per round. The paper's analysis uses L = 1 with worker momentum; 3 is RFA's default
# budget of secure means (`geometric_median.DEFAULT_NUM_PASSES`), so the two compare at equal rounds per call.
DEFAULT_NUM_ITERATIONS = 3
# tau: the radius of the authors' experiments' code and of the common reimplementations; it is in the units of the
# updates, so tune it to their norm (a tau above every honest ||w_i - v|| leaves the honest clients unclipped).
DEFAULT_CLIP_RADIUS = 10.0
DEFAULT_WEIGHT_BOUND = 1e4
# v_0. 'zero': the zero update (the current model), which no client controls. 'previous': the previous call's result,
# kept in the state, as the paper's momentum v_{t-1} (a client that moved it last round still moves it now).
REFERENCES = ('zero', 'previous')
DEFAULT_REFERENCE = 'zero'
# A clipped difference's norm can exceed tau by float32 rounding: the secure bound leaves it room.
_SECURE_BOUND_SLACK = 1 + 1e-5

# ----------------------------------------------------------------------------------------------------------------
# Plain TF: one client's clipping (a structure), and the whole rule on stacked clients (points [n, d], weights [n]).


def clip_difference(point, reference, clip_radius: float):
  """(clip_tau(point - reference), int32 1 if it was clipped), over the whole structure's Euclidean norm."""
  difference = tf.nest.map_structure(tf.subtract, point, reference)
  norm = weiszfeld.flat_norm(difference)
  clipped = norm > clip_radius
  scale = tf.where(clipped, clip_radius / norm, 1.0)
  return (tf.nest.map_structure(lambda x: x * tf.cast(scale, x.dtype), difference), tf.cast(clipped, tf.int32))


def centered_clipping(points: tf.Tensor, weights: tf.Tensor, clip_radius: float, num_iterations: int,
                      reference: Optional[tf.Tensor] = None) -> tuple[tf.Tensor, tf.Tensor]:
  """(v_L, clipped clients per iteration int32[L]) for stacked clients; v_0 = `reference` or zeros."""
  v = tf.zeros_like(points[0]) if reference is None else reference
  weights = tf.cast(weights, points.dtype)
  counts = []
  for _ in range(num_iterations):
    difference = points - v[None]
    norms = tf.norm(difference, axis=1)
    scale = tf.where(norms > clip_radius, clip_radius / tf.maximum(norms, clip_radius), tf.ones_like(norms))
    step = tf.math.divide_no_nan(tf.reduce_sum(difference * (weights * scale)[:, None], axis=0),
                                 tf.reduce_sum(weights))
    v = v + step
    counts.append(tf.reduce_sum(tf.cast(norms > clip_radius, tf.int32)))
  return v, tf.stack(counts)


# ----------------------------------------------------------------------------------------------------------------
# The factory.


class CenteredClippingFactory(tff.aggregators.WeightedAggregationFactory):
  """Centered Clipping in `num_iterations` sequential weighted means (module docstring).

  Iteration l broadcasts v_l; each client sends clip_tau(w_i - v_l) with its weight a_i to the inner weighted
  mean; the server adds the mean to v_l. A client with a non-finite update or a non-finite or negative weight is
  dropped (`client_values.drop_invalid_clients`); a round with zero total weight returns v_0. A non-finite inner
  mean (an inner factory may lose the weights) leaves v_l where it was and is counted. Float16 and bfloat16 values
  are clipped and averaged in float32.

  State: the inner means' states (`iterations`), and with `reference='previous'` the previous result (`reference`).
  Measurements (at SERVER): `clipped_clients` int32[L], the participating clients whose difference was clipped in
  each iteration (a secure sum); `participating_clients`, `dropped_clients` (secure sums); `nonfinite_iterations`;
  `nonfinite_result`, `zero_result` (`result_checks`); `iterations`, the inner means' measurements.
  """

  def __init__(self, clip_radius: float = DEFAULT_CLIP_RADIUS, num_iterations: int = DEFAULT_NUM_ITERATIONS,
               reference: str = DEFAULT_REFERENCE, secure: bool = False, value_bound: Optional[float] = None,
               weight_bound: float = DEFAULT_WEIGHT_BOUND,
               mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None):
    """Initializes the factory.

    Args:
      clip_radius: tau > 0, the radius the differences w_i - v_l are clipped to.
      num_iterations: L >= 1, the sequential weighted means per call.
      reference: v_0, one of `REFERENCES` (see `DEFAULT_REFERENCE`'s comment).
      secure: average through `secure_mean.SecureWeightedMeanFactory` (secure sums only) instead of
        `mean.FederatedMeanFactory`.
      value_bound: the secure mean's bound on |coordinate|; default tau (a clipped difference's norm bound), a
        smaller one clips coordinates (counted in the inner measurements) for a finer quantization.
      weight_bound: the secure mean's largest client weight.
      mean_factory: a weighted-mean factory replacing the one `secure` chooses.
    """
    self._clip_radius = checks.check_positive_finite(clip_radius, 'clip_radius')
    self._num_iterations = checks.check_positive_int(num_iterations, 'num_iterations')
    if reference not in REFERENCES:
      raise ValueError(f'reference must be one of {REFERENCES}, got {reference!r}')
    self._reference = reference
    self._secure = checks.check_bool(secure, 'secure')
    bound = self._clip_radius * _SECURE_BOUND_SLACK if value_bound is None else value_bound
    if mean_factory is None:
      mean_factory = mean.weighted_mean_factory(self._secure, bound, weight_bound)
    elif not isinstance(mean_factory, tff.aggregators.WeightedAggregationFactory):
      raise ValueError(f'mean_factory must be a tff.aggregators.WeightedAggregationFactory, got {mean_factory!r}')
    composition.check_weighted_mean(mean_factory, 'CenteredClippingFactory',
                                    'each iteration is a mean weighted by the client weights')
    self._mean_factory = mean_factory

  @property
  def clip_radius(self) -> float:
    return self._clip_radius

  @property
  def num_iterations(self) -> int:
    return self._num_iterations

  @property
  def reference(self) -> str:
    return self._reference

  def stacked_rule(self, points: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, collections.OrderedDict]:
    """The rule on stacked clients at the server, from the zero update (what `bucketing` applies to buckets)."""
    result, clipped = centered_clipping(points, weights, self._clip_radius, self._num_iterations)
    return result, collections.OrderedDict(clipped_clients=clipped)

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    parts = self._parts(value_type, weight_type)

    @tff.federated_computation(parts.init_fn.type_signature.result, *parts.client_types)
    def next_fn(state, value, weight):
      points, weights, flags = parts.prepare(value, weight)
      work = parts.start(state, flags)
      for index in range(self._num_iterations):
        parts.iterate(work, points, weights, index)
      return parts.finish(work)

    return tff.templates.AggregationProcess(parts.init_fn, next_fn)

  def create_staged(self, value_type, weight_type) -> staged.StagedAggregationProcess:
    """The process `create` returns, with `next` as one computation per iteration (`num_iterations` stages).

    Each stage prepares the clients' points and weights anew and passes on only SERVER-placed values (the state,
    the clients' counts, v_l and the outputs so far); the last returns what `create(...).next` returns.
    """
    parts = self._parts(value_type, weight_type)
    stages, carry_type = [], parts.init_fn.type_signature.result
    for index in range(self._num_iterations):
      stage = _stage(parts, index, index == self._num_iterations - 1, carry_type)
      stages.append(stage)
      carry_type = stage.type_signature.result
    return staged.StagedAggregationProcess(parts.init_fn, tuple(stages))

  def _parts(self, value_type, weight_type) -> '_Parts':
    client_values.check_float_structure(value_type)
    client_values.check_weight_type(weight_type)
    value_type, weight_type = tff.to_type(value_type), tff.to_type(weight_type)
    point_type = client_values.compute_type(value_type)
    scalar = tff.TensorType(np.float32)
    inner = self._mean_factory.create(point_type, scalar)  # Stateless between iterations: one process, L states.
    radius, dtypes = self._clip_radius, [t.dtype for t in client_values.tensor_types(value_type)]

    @tff.tensorflow.computation(value_type, weight_type)
    def client_prepare(value, weight):
      value, weight, keep = client_values.drop_invalid_clients(value, weight)
      value, weight = client_values.to_compute_dtypes(value), tf.cast(weight, tf.float32)
      participating = keep * tf.cast(weight > 0, tf.int32)
      return value, weight, (participating, 1 - keep, result_checks.sends_nonzero(value, participating))

    @tff.tensorflow.computation(point_type, point_type, scalar)
    def client_clip(reference, point, weight):
      clipped, flag = clip_difference(point, reference, radius)
      return clipped, flag * tf.cast(weight > 0, tf.int32)

    @tff.tensorflow.computation(point_type, point_type)
    def server_step(v, step):
      finite = client_values.all_finite(step)
      moved = tf.nest.map_structure(lambda a, b: tf.where(finite, a + b, a), v, step)
      return moved, 1 - tf.cast(finite, tf.int32)

    @tff.tensorflow.computation
    def zeros():
      return tff.types.structure_from_tensor_type_tree(lambda t: tf.zeros(t.shape, t.dtype), point_type)

    @tff.tensorflow.computation(point_type, tff.TensorType(np.int32))
    def server_finish(v, nonzero_clients):
      return result_checks.check_result(client_values.cast_leaves(v, dtypes), nonzero_clients)

    counts_type = tff.StructWithPythonType([np.int32] * self._num_iterations, tuple)

    @tff.tensorflow.computation(counts_type)
    def stack_counts(counts):
      return tf.stack(tf.nest.flatten(counts))

    @tff.tensorflow.computation(counts_type)
    def add_counts(counts):
      return tf.add_n(tf.nest.flatten(counts))

    previous = self._reference == 'previous'

    @tff.federated_computation()
    def init_fn():
      state = collections.OrderedDict(iterations=tuple(inner.initialize() for _ in range(self._num_iterations)))
      if previous:
        state['reference'] = tff.federated_eval(zeros, tff.SERVER)
      return tff.federated_zip(state)

    computations = dict(client_prepare=client_prepare, client_clip=client_clip, server_step=server_step, zeros=zeros,
                        server_finish=server_finish, stack_counts=stack_counts, add_counts=add_counts)
    client_types = (tff.FederatedType(value_type, tff.CLIENTS), tff.FederatedType(weight_type, tff.CLIENTS))
    return _Parts(init_fn, client_types, inner, previous, computations)


# The lists a call builds, one entry per iteration, carried from one stage to the next.
_LISTS = ('inner_states', 'inner_measurements', 'clipped', 'nonfinite')


@dataclasses.dataclass(frozen=True)
class _Parts:
  """One `next` call of a `CenteredClippingFactory` process over one value type: a `work` dict (SERVER values: the
  state, the clients' counts, v_l, and `_LISTS`) that `iterate` advances one weighted mean at a time."""
  init_fn: tff.Computation
  client_types: tuple
  inner: tff.templates.AggregationProcess
  previous: bool
  computations: dict

  def prepare(self, value, weight):
    prepared = tff.federated_map(self.computations['client_prepare'], (value, weight))
    return prepared[0], prepared[1], prepared[2]

  def start(self, state, flags) -> dict:
    v = state['reference'] if self.previous else tff.federated_eval(self.computations['zeros'], tff.SERVER)
    return dict(state=state, counts=secure_mean.secure_count(flags), v=v, **{name: [] for name in _LISTS})

  def iterate(self, work: dict, points, weights, index: int) -> None:
    """Iteration `index`: broadcast v_l, one weighted mean of the clipped differences, v_{l+1} = v_l + the mean."""
    clipped, flag = tff.federated_map(self.computations['client_clip'],
                                      (tff.federated_broadcast(work['v']), points, weights))
    output = self.inner.next(work['state']['iterations'][index], clipped, weights)
    work['v'], nonfinite = tff.federated_map(self.computations['server_step'], (work['v'], output.result))
    for name, item in zip(_LISTS, (output.state, output.measurements, secure_mean.secure_count(flag), nonfinite)):
      work[name].append(item)

  def finish(self, work: dict) -> tff.templates.MeasuredProcessOutput:
    participating, dropped, nonzero = work['counts']
    result, result_flags = tff.federated_map(self.computations['server_finish'], (work['v'], nonzero))
    new_state = collections.OrderedDict(iterations=tuple(work['inner_states']))
    if self.previous:
      new_state['reference'] = work['v']
    measurements = collections.OrderedDict(
        clipped_clients=tff.federated_map(self.computations['stack_counts'], tff.federated_zip(tuple(work['clipped']))),
        participating_clients=participating,
        dropped_clients=dropped,
        nonfinite_iterations=tff.federated_map(self.computations['add_counts'],
                                               tff.federated_zip(tuple(work['nonfinite']))),
        nonfinite_result=result_flags['nonfinite_result'],
        zero_result=result_flags['zero_result'],
        iterations=tff.federated_zip(tuple(work['inner_measurements'])),
    )
    return tff.templates.MeasuredProcessOutput(tff.federated_zip(new_state), result, tff.federated_zip(measurements))

  def to_carry(self, work: dict) -> collections.OrderedDict:
    carry = collections.OrderedDict(state=work['state'], counts=work['counts'], v=work['v'])
    carry.update((name, tuple(work[name])) for name in _LISTS)
    return carry

  @staticmethod
  def from_carry(carry) -> dict:
    work = {name: carry[name] for name in ('state', 'counts', 'v')}
    work.update({name: [carry[name][i] for i in range(len(carry[name].type_signature))] for name in _LISTS})
    return work


def _stage(parts: _Parts, index: int, last: bool, carry_type) -> tff.Computation:
  """Iteration `index` of a call as a computation: from the state (the first) or the carry, to the carry or the
  output (the last)."""

  @tff.federated_computation(carry_type, *parts.client_types)
  def stage(carry, value, weight):
    points, weights, flags = parts.prepare(value, weight)
    work = parts.start(carry, flags) if index == 0 else parts.from_carry(carry)
    parts.iterate(work, points, weights, index)
    return parts.finish(work) if last else parts.to_carry(work)

  return stage


class UnweightedCenteredClippingFactory(tff.aggregators.UnweightedAggregationFactory):
  """`CenteredClippingFactory` with a_i = 1 for every client (same arguments; `weight_bound` defaults to 1)."""

  def __init__(self, clip_radius: float = DEFAULT_CLIP_RADIUS, num_iterations: int = DEFAULT_NUM_ITERATIONS,
               reference: str = DEFAULT_REFERENCE, secure: bool = False, value_bound: Optional[float] = None,
               weight_bound: float = 1.0, mean_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None):
    self._weighted = CenteredClippingFactory(clip_radius, num_iterations, reference, secure, value_bound,
                                             weight_bound, mean_factory)

  def create(self, value_type) -> tff.templates.AggregationProcess:
    """Centered clipping with a_i = 1; refuses to be a slot TFF sums in (`composition`)."""
    composition.check_not_in_sum_slot('UnweightedCenteredClippingFactory', 'a centered-clipping aggregate')
    return mean.as_unweighted(self._weighted).create(value_type)
