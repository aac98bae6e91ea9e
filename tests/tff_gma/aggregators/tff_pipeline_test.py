"""GMA and RFA as drop-in `model_aggregator`s of TFF's learning algorithms, and an audit of their intrinsics.

* Plug-in: a few rounds of FedAvg (weighted and unweighted), FedProx, FedAdam and FedYogi with each factory on
  the digits data (logistic model, 4 clients): the central loss must fall and the accuracy rise well above
  chance; a client whose data is NaN must not corrupt the model.
* Audit: walk the built computations' building blocks and check that the only intrinsics that take a CLIENTS
  value to the SERVER are `federated_mean` and the secure-sum family (secure mode: secure sums only).
"""

import collections
import functools

import numpy as np
import pytest
import tensorflow_federated as tff
from tensorflow_federated.python.core.impl.compiler import building_blocks

from tff_gma import aggregators
from tff_gma import models
from tff_gma.data import digits
from tests import tiers
from tests.tff_gma import fixtures

NUM_CLIENTS = 4
ROUNDS = 3
BATCH_SIZE = 20

MEAN_INTRINSICS = {'federated_mean', 'federated_weighted_mean'}
SECURE_INTRINSICS = {'federated_secure_sum', 'federated_secure_sum_bitwidth', 'federated_secure_modular_sum'}
# Intrinsics that never move a CLIENTS value to the SERVER.
PLUMBING_INTRINSICS = {
    'federated_apply', 'federated_broadcast', 'federated_eval_at_clients', 'federated_eval_at_server',
    'federated_map', 'federated_map_all_equal', 'federated_value_at_clients', 'federated_value_at_server',
    'federated_zip_at_clients', 'federated_zip_at_server',
}


# ----------------------------------------------------------------------------------------------------------------
# Intrinsic audit.


def _intrinsics(comp) -> list[building_blocks.Intrinsic]:
  """Every intrinsic reachable in the computation's building block (nested lambdas and blocks included)."""
  found, stack = [], [comp.to_building_block()]
  while stack:
    node = stack.pop()
    if isinstance(node, building_blocks.Intrinsic):
      found.append(node)
    stack.extend(node.children())
  return found


def _placements(type_spec) -> set:
  """Placements of the federated types inside `type_spec` (not descending into function types)."""
  if isinstance(type_spec, tff.FederatedType):
    return {type_spec.placement}
  if isinstance(type_spec, tff.StructType):
    return set().union(*[_placements(t) for _, t in tff.structure.iter_elements(type_spec)]) if len(
        type_spec) else set()
  return set()


def _moves_clients_to_server(intrinsic: building_blocks.Intrinsic) -> bool:
  signature = intrinsic.type_signature
  if not isinstance(signature, tff.FunctionType) or signature.parameter is None:
    return False
  return tff.CLIENTS in _placements(signature.parameter) and tff.SERVER in _placements(signature.result)


AUDITED = {
    'gma': lambda: aggregators.GradientMaskedFactory(),
    'gma_secure': lambda: aggregators.GradientMaskedFactory(secure=True, value_bound=1.0),
    'rfa': lambda: aggregators.GeometricMedianFactory(),
    'rfa_secure': lambda: aggregators.GeometricMedianFactory(secure=True, value_bound=1.0),
    'rfa_one_step_secure': lambda: aggregators.GeometricMedianFactory(one_step=True, secure=True, value_bound=1.0),
}


@pytest.mark.parametrize('name', sorted(AUDITED))
def test_only_mean_and_secure_sum_move_client_data(name):
  value_type = tff.to_type(collections.OrderedDict(
      a=tff.TensorType(np.float32, [2, 3]), b=[tff.TensorType(np.float32, [4]), tff.TensorType(np.float32, [])]))
  process = AUDITED[name]().create(value_type, tff.TensorType(np.float32))
  intrinsics = _intrinsics(process.next)
  uris = {i.uri for i in intrinsics}
  to_server = {i.uri for i in intrinsics if _moves_clients_to_server(i)}
  secure = name.endswith('secure')
  allowed = SECURE_INTRINSICS if secure else SECURE_INTRINSICS | MEAN_INTRINSICS
  assert to_server, 'the audit found no aggregation at all: the traversal is broken'
  assert to_server <= allowed, f'{name}: client data reaches the server through {to_server - allowed}'
  assert uris <= allowed | PLUMBING_INTRINSICS, f'{name}: unexpected intrinsics {uris - allowed - PLUMBING_INTRINSICS}'
  assert not uris & {'federated_sum', 'federated_aggregate', 'federated_max', 'federated_min',
                     'federated_select', 'federated_secure_select'}
  assert 'federated_secure_sum' in to_server  # Sign codes / client counts always go through secure sums.
  if not secure:
    assert 'federated_mean' in to_server
  else:
    assert 'federated_secure_sum_bitwidth' in to_server  # TFF's SecureSumFactory carries the floats.


def test_audit_flags_a_plain_sum():
  """The audit itself must catch a forbidden aggregation (so the test above can fail)."""

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def leaky(value):
    return tff.federated_sum(value)

  flagged = {i.uri for i in _intrinsics(leaky) if _moves_clients_to_server(i)}
  assert flagged == {'federated_sum'}


# ----------------------------------------------------------------------------------------------------------------
# Plug-in.


@functools.lru_cache(maxsize=1)
def _setup():
  train = digits.federated_train_data('iid', num_clients=NUM_CLIENTS, seed=0)
  split = digits.load_split()
  build_keras = models.keras_builder('logistic', digits.IMAGE_SHAPE, digits.NUM_CLASSES)
  evaluator = fixtures.central_evaluator(build_keras, split.x_test, split.y_test)
  sample = fixtures.client_dataset(train, train.client_ids[0], local_epochs=1, batch_size=BATCH_SIZE, seed=0,
                                   round_num=0)
  model_fn = models.model_fn(build_keras, sample.element_spec)
  return train, evaluator, model_fn


def _round_data(train, round_num, nan_client=False):
  datasets = fixtures.round_datasets(train, round_num, batch_size=BATCH_SIZE)
  if nan_client:
    datasets[0] = datasets[0].map(lambda b: collections.OrderedDict(x=b['x'] * np.float32(np.nan), y=b['y']))
  return datasets


def _train(process, nan_client=False):
  train, evaluator, _ = _setup()
  state = process.initialize()
  before = evaluator(process.get_model_weights(state))
  aggregator_metrics = []
  for round_num in range(ROUNDS):
    output = process.next(state, _round_data(train, round_num, nan_client))
    state = output.state
    aggregator_metrics.append(output.metrics['aggregator'])
  weights = process.get_model_weights(state)
  return before, evaluator(weights), weights, aggregator_metrics


@functools.lru_cache(maxsize=None)
def _build(algorithm, factory_name):
  """One learning process per (algorithm, factory), built once and shared by the tests that use it."""
  _, _, model_fn = _setup()
  if algorithm == 'unweighted_fedavg':
    factory = (aggregators.UnweightedGradientMaskedFactory() if factory_name == 'gma'
               else aggregators.UnweightedGeometricMedianFactory())
    return tff.learning.algorithms.build_unweighted_fed_avg(
        model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.05, momentum=0.9),
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0), model_aggregator=factory)
  factory = {
      'gma': aggregators.GradientMaskedFactory,
      'rfa': aggregators.GeometricMedianFactory,
      # Secure mode end to end: client weights are example counts (about 90 here), below weight_bound=1e4.
      'gma_secure': functools.partial(aggregators.GradientMaskedFactory, secure=True, value_bound=1.0),
  }[factory_name]()
  return fixtures.fed_avg_family(model_fn, algorithm, factory,
                                 server_lr=0.05 if algorithm in ('fedadam', 'fedyogi') else 1.0)


# Every algorithm with one of the factories, each factory with weighted FedAvg and with two more algorithms,
# GMA also in secure mode: each combination costs a compilation of several seconds on the 2-core test machine.
PLUG_IN_CASES = [
    ('fedavg', 'gma'), ('fedavg', 'rfa'), ('fedavg', 'gma_secure'),
    ('unweighted_fedavg', 'rfa'), ('fedprox', 'gma'), ('fedadam', 'rfa'), ('fedyogi', 'gma'),
]


@pytest.mark.parametrize('algorithm,factory_name', PLUG_IN_CASES)
def test_plugs_into_learning_algorithms(algorithm, factory_name):
  before, after, weights, metrics = _train(_build(algorithm, factory_name))
  assert all(np.all(np.isfinite(w)) for w in weights.trainable)
  assert after['loss'] < before['loss'] - 0.1, (before, after)
  assert after['accuracy'] > 0.5, (before, after)  # Chance is 0.1.
  assert metrics[-1]['participating_clients'] == NUM_CLIENTS
  assert metrics[-1]['dropped_clients'] == 0


@pytest.mark.parametrize('factory_name', ['gma', 'rfa'])
def test_nan_client_does_not_corrupt_the_model(factory_name):
  _, after, weights, metrics = _train(_build('fedavg', factory_name), nan_client=True)
  assert all(np.all(np.isfinite(w)) for w in weights.trainable)
  assert after['accuracy'] > 0.5
  # TFF's client work turns the diverged client into a zero update of weight 0: it is left out of the vote.
  assert metrics[-1]['participating_clients'] == NUM_CLIENTS - 1


# ----------------------------------------------------------------------------------------------------------------
# Every inner mean a TFF user can pass: FedAvg must train with each (RFA hands its inner mean Weiszfeld weights far
# below the clients' own, which a quantizing inner mean once rounded to zero, so the model never moved).

INNER_MEANS = {
    'federated_mean': aggregators.FederatedMeanFactory,
    'secure_weighted_mean': lambda: aggregators.SecureWeightedMeanFactory(value_bound=8.0),
    'tff_mean': tff.aggregators.MeanFactory,
    'tff_secure': lambda: tff.learning.secure_aggregator(zeroing=False, clipping=False),
    'tff_secure_default': tff.learning.secure_aggregator,
    'tff_robust': tff.learning.robust_aggregator,
    'tff_compression': tff.learning.compression_aggregator,
    'tff_clipping': lambda: tff.aggregators.clipping_factory(1.0, tff.aggregators.MeanFactory()),
    'tff_zeroing': lambda: tff.aggregators.zeroing_factory(10.0, tff.aggregators.MeanFactory()),
}
OUTER_FACTORIES = {'rfa': aggregators.GeometricMedianFactory, 'gma': aggregators.GradientMaskedFactory}
INNER_CASES = tiers.cover_once(
    [(outer, inner) for inner in INNER_MEANS for outer in OUTER_FACTORIES],
    keys=[lambda case: case[1] == 'tff_secure'], ids=lambda case: f'{case[0]}-{case[1]}')


@functools.lru_cache(maxsize=None)
def _build_with_inner(outer, inner):
  _, _, model_fn = _setup()
  factory = OUTER_FACTORIES[outer](mean_factory=INNER_MEANS[inner]())
  return fixtures.fed_avg_family(model_fn, 'fedavg', factory, server_lr=1.0)


@pytest.mark.parametrize('outer,inner', INNER_CASES)
def test_fedavg_trains_with_every_inner_mean(outer, inner):
  before, after, weights, metrics = _train(_build_with_inner(outer, inner))
  assert all(np.all(np.isfinite(w)) for w in weights.trainable)
  assert after['loss'] < before['loss'] - 0.1, (before, after)
  assert after['accuracy'] > 0.5, (before, after)
  assert metrics[-1]['nonfinite_result'] == 0 and metrics[-1]['zero_result'] == 0, metrics[-1]
