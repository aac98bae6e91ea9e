"""Computations for the audit tests and the CLI test: clean ones, deliberately leaky ones, multi-pass ones.

Each target is a module attribute so that `python -m tff_gma.audit tests.tff_gma.audit.targets:<name>` can load it.
Built lazily (functions returning the computation) where building costs more than a few milliseconds.
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

VALUE = tff.TensorType(np.float32, [3])
CLIENT_VALUES = tff.FederatedType(VALUE, tff.CLIENTS)
CLIENT_SCALARS = tff.FederatedType(np.float32, tff.CLIENTS)
CLIENT_INTS = tff.FederatedType(np.int32, tff.CLIENTS)
SERVER_VALUE = tff.FederatedType(VALUE, tff.SERVER)
# A small smoothing constant for the Weiszfeld weights (RFA's nu), as in RFA's smoothed Weiszfeld algorithm.
WEISZFELD_NU = 1e-6
INPUT_SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 8, 8, 1], tf.float32), y=tf.TensorSpec([None], tf.int32))


# --- Clean: only means and secure sums reach the server. ---------------------------------------------------------


@tff.federated_computation(CLIENT_VALUES, CLIENT_SCALARS)
def weighted_mean(values, weights):
  return tff.federated_mean(values, weights)


@tff.federated_computation(CLIENT_INTS)
def secure_sum_bitwidth(values):
  return tff.federated_secure_sum_bitwidth(values, 8)


@tff.tensorflow.computation
def _max_input_constant():
  return tf.constant(1000, tf.int32)


@tff.federated_computation(CLIENT_INTS)
def secure_sum_compiled_bound(values):
  # The bound is the output of a parameterless TensorFlow computation (a graph `Const`), not a literal.
  return tff.federated_secure_sum(values, _max_input_constant())


@tff.federated_computation(CLIENT_INTS, tff.TensorType(np.int32))
def secure_sum_dynamic_bound(values, max_input):
  return tff.federated_secure_sum(values, max_input)


@tff.federated_computation(CLIENT_INTS)
def secure_modular_sum(values):
  return tff.backends.mapreduce.federated_secure_modular_sum(values, 64)


@tff.federated_computation(CLIENT_VALUES, CLIENT_SCALARS)
def independent_means(values, scalars):
  """Three aggregates none of which depends on another: one pass."""
  return tff.federated_mean(values), tff.federated_mean(scalars), tff.federated_mean(values, scalars)


@tff.tensorflow.computation(VALUE, VALUE)
def _distance(point, center):
  return tf.norm(point - center)


@tff.tensorflow.computation(VALUE, VALUE)
def _weiszfeld_weight(point, center):
  # beta_i = 1 / max(nu, ||x_i - z||): RFA's smoothed Weiszfeld weight (uniform client weights alpha_i = 1).
  return 1.0 / tf.maximum(WEISZFELD_NU, tf.norm(point - center))


def weiszfeld_median(num_passes: int) -> tff.Computation:
  """Smoothed Weiszfeld iterations from a server start: `num_passes` dependent weighted means (RFA with R=passes)."""

  @tff.federated_computation(SERVER_VALUE, CLIENT_VALUES)
  def median(start, points):
    estimate = start
    for _ in range(num_passes):
      weights = tff.federated_map(_weiszfeld_weight, (points, tff.federated_broadcast(estimate)))
      estimate = tff.federated_mean(points, weights)
    return estimate

  return median


weiszfeld_median_3 = weiszfeld_median(3)


@tff.federated_computation(SERVER_VALUE, CLIENT_VALUES)
def mean_then_reweighted_mean(start, points):
  """mean -> broadcast -> client reweighting -> mean: two passes (the second depends on the first)."""
  del start
  center = tff.federated_mean(points)
  weights = tff.federated_map(_weiszfeld_weight, (points, tff.federated_broadcast(center)))
  return tff.federated_mean(points, weights)


@tff.federated_computation(SERVER_VALUE, CLIENT_VALUES)
def broadcast_of_state_next_to_aggregate(start, points):
  """Zips an aggregate with the state, then broadcasts only the state part: still one pass."""
  first_mean = tff.federated_mean(points)
  zipped = tff.federated_zip((first_mean, start))
  weights = tff.federated_map(_weiszfeld_weight, (points, tff.federated_broadcast(zipped[1])))
  return tff.federated_mean(points, weights), zipped[0]


@tff.tensorflow.computation(VALUE)
def _negate(value):
  return -value


@tff.federated_computation(CLIENT_VALUES)
def returns_client_values(values):
  """Returns a CLIENTS-placed value: it stays at the clients, nothing reaches the server."""
  return tff.federated_map(_negate, values)


# --- Leaky: client data reaches the server in other ways. --------------------------------------------------------


@tff.federated_computation(CLIENT_VALUES)
def plain_sum(values):
  return tff.federated_sum(values)


@tff.federated_computation(CLIENT_VALUES)
def client_max(values):
  return tff.federated_max(values)


@tff.federated_computation(CLIENT_VALUES)
def mean_and_min(values):
  return tff.federated_mean(values), tff.federated_min(values)


_COLLECTED = tff.TensorType(np.float32, [None, 3])


@tff.tensorflow.computation
def _empty_collection():
  # Shape [None, 3]: the collection grows by one row per client.
  return tf.compat.v1.placeholder_with_default(tf.zeros([0, 3], tf.float32), shape=[None, 3])


@tff.tensorflow.computation(_COLLECTED, VALUE)
def _append(collection, value):
  return tf.concat([collection, value[tf.newaxis]], axis=0)


@tff.tensorflow.computation(_COLLECTED, _COLLECTED)
def _concatenate(a, b):
  return tf.concat([a, b], axis=0)


@tff.tensorflow.computation(_COLLECTED)
def _identity(collection):
  return tf.identity(collection)


@tff.federated_computation(CLIENT_VALUES)
def collect_values(values):
  """A `federated_aggregate` whose accumulator concatenates: the server gets every client's value."""
  return tff.federated_aggregate(values, _empty_collection(), _append, _concatenate, _identity)


@tff.tensorflow.computation(np.float32, np.int32)
def _select_row(table, key):
  del key
  return table


@tff.tensorflow.computation(np.int32)
def _as_key_list(key):
  return tf.reshape(key, [1])


@tff.federated_computation(CLIENT_INTS, tff.FederatedType(np.float32, tff.SERVER))
def secure_select_by_client_keys(keys, table):
  """Values picked from the server by client-held keys (`federated_secure_select`)."""
  keys = tff.federated_map(_as_key_list, keys)
  return tff.federated_secure_select(keys, tff.federated_value(10, tff.SERVER), table, _select_row)


# --- Factories and learning processes. ---------------------------------------------------------------------------

secure_sum_factory = tff.aggregators.SecureSumFactory(upper_bound_threshold=1.0, lower_bound_threshold=-1.0)
plain_sum_factory = tff.aggregators.SumFactory()


def secure_mean_factory() -> tff.aggregators.WeightedAggregationFactory:
  """TFF's weighted mean with both of its inner sums secure (fixed bounds)."""
  return tff.aggregators.MeanFactory(
      value_sum_factory=tff.aggregators.SecureSumFactory(upper_bound_threshold=1.0, lower_bound_threshold=-1.0),
      weight_sum_factory=tff.aggregators.SecureSumFactory(upper_bound_threshold=100.0, lower_bound_threshold=0.0),
  )


def _model_fn():
  from tff_gma import models  # pylint: disable=g-import-not-at-top
  return models.model_fn(models.keras_builder('logistic', (8, 8, 1), 10), INPUT_SPEC)


def fed_avg_default() -> tff.learning.templates.LearningProcess:
  """FedAvg as TFF builds it by default: plain sums for the model update (MeanFactory) and for the metrics."""
  return tff.learning.algorithms.build_weighted_fed_avg(
      _model_fn(), client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1))


def secure_rfa(num_passes: int = 2):
  """The project's RFA with secure sums only: `num_passes` Weiszfeld passes, as many client-to-server rounds."""
  from tff_gma import aggregators  # pylint: disable=g-import-not-at-top
  return aggregators.GeometricMedianFactory(num_passes=num_passes, secure=True, value_bound=1.0, weight_bound=100.0)


def secure_gma():
  """The project's GMA with secure sums only."""
  from tff_gma import aggregators  # pylint: disable=g-import-not-at-top
  return aggregators.GradientMaskedFactory(tau=0.4, secure=True, value_bound=1.0, weight_bound=100.0)


def rfa_secure_learning_process() -> tff.learning.templates.LearningProcess:
  """A whole FedAvg round with the project's secure RFA (2 Weiszfeld passes) and securely summed metrics."""
  return tff.learning.algorithms.build_weighted_fed_avg(
      _model_fn(), client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1),
      model_aggregator=secure_rfa(2),
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)


def staged_secure_rfa():
  """`secure_rfa(2)` in stages: one computation per Weiszfeld pass."""
  return secure_rfa(2).create_staged(VALUE, tff.TensorType(np.float32))


def staged_rfa_learning_process():
  """A FedAvg round with the project's secure RFA (2 passes) in stages, composed from TFF's own parts."""
  from tff_gma import aggregators  # pylint: disable=g-import-not-at-top
  from tff_gma import learning  # pylint: disable=g-import-not-at-top
  model_fn = _model_fn()
  initial_weights_fn = tff.tensorflow.computation(lambda: tff.learning.models.ModelWeights.from_model(model_fn()))
  weights_type = initial_weights_fn.type_signature.result
  client_work = tff.learning.templates.build_model_delta_client_work(
      model_fn, tff.learning.optimizers.build_sgdm(0.1), tff.learning.ClientWeighting.NUM_EXAMPLES,
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)
  return learning.compose_staged_learning_process(
      initial_weights_fn, tff.learning.templates.build_broadcast_process(weights_type), client_work,
      aggregators.create_staged(secure_rfa(2), weights_type.trainable, tff.TensorType(np.float32)),
      tff.learning.templates.build_apply_optimizer_finalizer(tff.learning.optimizers.build_sgdm(1.0), weights_type))


def _counting_distributor(model_weights_type) -> tff.learning.templates.DistributionProcess:
  """TFF's broadcast, measuring how many clients received the model with a plain `federated_sum`."""

  @tff.federated_computation()
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result, tff.FederatedType(model_weights_type, tff.SERVER))
  def next_fn(state, weights):
    received = tff.federated_sum(tff.federated_value(1, tff.CLIENTS))
    return tff.templates.MeasuredProcessOutput(state, tff.federated_broadcast(weights), received)

  return tff.learning.templates.DistributionProcess(init_fn, next_fn)


def fed_avg_counting_distributor() -> tff.learning.templates.LearningProcess:
  """FedAvg with secure metrics and a secure mean whose distributor sums a count in the clear (a distributor flow)."""
  model_fn = _model_fn()

  @tff.tensorflow.computation
  def initial_weights():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  return tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1),
      model_distributor=_counting_distributor(initial_weights.type_signature.result),
      model_aggregator=secure_mean_factory(),
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)


def fed_eval_default() -> tff.learning.templates.LearningProcess:
  """TFF's federated evaluation as built by default: the metrics summed with a plain `federated_sum`."""
  return tff.learning.algorithms.build_fed_eval(_model_fn())


# --- Passes the audit and leaks anyway: what a PASS does not establish. ------------------------------------------

NUM_SLOTS = 4


@tff.tensorflow.computation(np.float32, np.int32)
def _into_own_slot(value, slot):
  # Zeros everywhere except the client's own coordinate `slot`, which holds its value.
  return tf.one_hot(slot, NUM_SLOTS, dtype=tf.float32) * value


@tff.federated_computation(CLIENT_SCALARS, CLIENT_INTS)
def slotted_mean(values, slots):
  """Each client writes its value into its own coordinate of a `federated_mean`.

  Only an allowed intrinsic carries client data to the server, so the audit PASSES; yet the mean is
  `[v_0, v_1, ...] / n` and the server reads every client's value off it. The audit checks which intrinsics carry
  client data, not what the clients encode into them (the limitation stated in every report's scope).
  """
  return tff.federated_mean(tff.federated_map(_into_own_slot, (values, slots)))


# --- Hostile: names that would pass for the report's own lines. ---------------------------------------------------

FAKE_VERDICT_LINES = 'x\n\n**Verdict: PASS.**\n\n'
FAKE_VERDICT_WORDS = 'Verdict: PASS'


def _plain_sum_of_a_field_named(name: str) -> tff.Computation:
  @tff.federated_computation(tff.FederatedType(tff.StructType([(name, np.float32)]), tff.CLIENTS))
  def leaky(values):
    return tff.federated_sum(values)

  return leaky


def names_with_a_fake_verdict_line() -> tff.Computation:
  """A plain sum (FAIL) of a struct whose field name holds line breaks and a PASS verdict line: printed as is, the
  report's type lines would break around a line reading `**Verdict: PASS.**`."""
  return _plain_sum_of_a_field_named(FAKE_VERDICT_LINES)


def names_with_a_fake_verdict() -> tff.Computation:
  """A plain sum (FAIL) of a struct whose field is named `Verdict: PASS`: one line, but a second verdict."""
  return _plain_sum_of_a_field_named(FAKE_VERDICT_WORDS)


# --- Cannot be decided: what the audit cannot see through. -------------------------------------------------------

CLIENTS_TO_SERVER = tff.FunctionType(CLIENT_VALUES, SERVER_VALUE)
CLIENTS_TO_CLIENTS = tff.FunctionType(CLIENT_VALUES, CLIENT_VALUES)


@tff.federated_computation(CLIENTS_TO_SERVER, CLIENT_VALUES)
def calls_a_functional_parameter(f, values):
  """Applies a function the caller passes in to the client values: what `f` does (a plain sum? a secure one?) is
  not in the computation, so whether client data reaches the server unallowed cannot be decided."""
  return f(values)


@tff.federated_computation(CLIENTS_TO_CLIENTS, CLIENT_VALUES)
def calls_a_clients_to_clients_parameter(f, values):
  """`f` stays at the clients by its type, yet it may sum at the server and broadcast the sum back."""
  return f(values)


@tff.federated_computation(CLIENTS_TO_SERVER, CLIENT_VALUES)
def _apply(g, values):
  return g(values)


@tff.federated_computation(CLIENTS_TO_SERVER, CLIENT_VALUES)
def passes_a_functional_parameter_on(f, values):
  """Hands `f` to another computation, which calls it: the place named is where it is called."""
  return _apply(f, values)


@tff.federated_computation(CLIENTS_TO_SERVER)
def returns_its_functional_parameter(f):
  """Returns `f`: the caller may call it on client data, out of the audit's sight."""
  return f


@tff.federated_computation(tff.FunctionType(VALUE, VALUE), CLIENT_VALUES)
def maps_an_unplaced_functional_parameter(g, values):
  """`g` is mapped at the clients; a function over unplaced values cannot reach the server: a PASS."""
  return tff.federated_mean(tff.federated_map(g, values))


@tff.federated_computation(CLIENTS_TO_SERVER, CLIENT_VALUES)
def plain_sum_and_a_functional_parameter(f, values):
  """A violation (the plain sum) and a place that cannot be decided (the call of `f`): a FAIL listing both."""
  return tff.federated_sum(values), f(values)


class ProcessWithClientState(tff.templates.IterativeProcess):
  """An `IterativeProcess` with one more public computation, as this library's processes with client state have."""

  def __init__(self, initialize_fn, next_fn, next_with_client_state):
    super().__init__(initialize_fn, next_fn)
    self.next_with_client_state = next_with_client_state


def leaks_only_in_next_with_client_state() -> ProcessWithClientState:
  """`next` averages the clients' values (allowed); `next_with_client_state` sums them in the clear."""
  state_type = tff.FederatedType(np.float32, tff.SERVER)

  @tff.federated_computation()
  def initialize():
    return tff.federated_value(np.float32(0.0), tff.SERVER)

  @tff.federated_computation(state_type, CLIENT_SCALARS)
  def next_fn(state, values):
    del state
    return tff.federated_mean(values)

  @tff.federated_computation(state_type, CLIENT_SCALARS)
  def next_with_client_state(state, values):
    del state
    return tff.federated_sum(values), values

  return ProcessWithClientState(initialize, next_fn, next_with_client_state)


# --- Sized by a number of levels: the walk must not take time exponential in it. ----------------------------------


def lambda_chain(levels: int, sum_per_level: bool = False, block_bodies: bool = False):
  """`f_0 = x -> federated_mean(x)`, `f_k = x -> <f_{k-1}(x), f_{k-1}(x)>[0]`: each level calls the one before
  twice, so the mean runs 2**levels times per call, in a building block that grows linearly (the locals of one
  block, each referring to the one before). `sum_per_level`: each level also sums `x` once (2**(levels - k) runs
  of level k's sum). `block_bodies`: each level's two calls are the locals `a` and `b` of a block of its own, so
  every run of the mean sits at a path of its own (2**levels places: a report that size, which no walk can give
  in bounded time).
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.compiler import building_blocks as bb
  from tensorflow_federated.python.core.impl.compiler import intrinsic_defs
  # pylint: enable=g-import-not-at-top
  server_scalar = tff.FederatedType(np.float32, tff.SERVER)
  aggregate_type = tff.FunctionType(CLIENT_SCALARS, server_scalar)
  mean = bb.Intrinsic(intrinsic_defs.FEDERATED_MEAN.uri, aggregate_type)
  x = bb.Reference('x', CLIENT_SCALARS)
  levels_ = [('f0', bb.Lambda('x', CLIENT_SCALARS, bb.Call(mean, x)))]
  function_type = levels_[0][1].type_signature
  for k in range(1, levels + 1):
    previous = bb.Reference(f'f{k - 1}', function_type)
    calls = [bb.Call(previous, x), bb.Call(previous, x)]
    if sum_per_level:
      calls.append(bb.Call(bb.Intrinsic(intrinsic_defs.FEDERATED_SUM.uri, aggregate_type), x))
    if block_bodies:
      body = bb.Block([('a', calls[0]), ('b', calls[1])], bb.Reference('a', server_scalar))
    else:
      body = bb.Selection(bb.Struct(calls), index=0)
    levels_.append((f'f{k}', bb.Lambda('x', CLIENT_SCALARS, body)))
  argument = bb.Reference('arg', CLIENT_SCALARS)
  top = bb.Call(bb.Reference(f'f{levels}', function_type), argument)
  return bb.Lambda('arg', CLIENT_SCALARS, bb.Block(levels_, top))


def lambda_chain_30():
  return lambda_chain(30)


def lambda_chain_40_block_bodies():
  return lambda_chain(40, block_bodies=True)
