"""The registry's contract, for every record: a new aggregator or algorithm is tested here with no test edit.

Per record, the method it names (an aggregator under the first algorithm it runs with; an algorithm with its
default aggregator, or the first private one when that is not private) is built by `methods.build` on a tiny digits
setup and must: be a `LearningProcess`; get the audit verdict its record declares (`private`, with secure client
metrics); aggregate in one stage exactly when it does not declare `multi_stage`, and, built in stages where its
algorithm declares `staged`, run as computations of one stage each, with the same verdict (else be refused on
several workers); and `registry.check` must accept exactly
the client-execution modes it declares; and (slow tier) initialize and run a round through the runner's loop,
client state included, to finite weights that moved.
"""

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import audit
from tff_gma import models
from tff_gma import runtime
from tff_gma.data import loaders
from training.engine import client_execution
from training.engine import methods
from training.engine import registry
from training.runner import round_loop



def _private_aggregator(algorithm: registry.Algorithm) -> str:
  """The algorithm's default aggregator if it is private, else the first private model aggregator it takes: so the
  audit verdict tests the algorithm's own declaration."""
  candidates = [algorithm.default_aggregator] + [a.name for a in registry.AGGREGATOR_RECORDS.values()
                                                 if a.kind == registry.MODEL_AGGREGATOR]
  return next(a for a in candidates if registry.aggregator(a).private and algorithm.name in
              registry.aggregator(a).algorithms)


_METHODS = list(dict.fromkeys(
    [(r.algorithms[0], r.name) for r in registry.AGGREGATOR_RECORDS.values()]
    + [(r.name, _private_aggregator(r)) for r in registry.ALGORITHM_RECORDS.values()]))


@pytest.fixture(scope='module')
def setup():
  data = loaders.load_federated_data('digits', 'iid', 4, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  return data, build_keras, models.model_fn(build_keras, data.input_spec)


def test_every_record_is_covered():
  assert {a for _, a in _METHODS} == set(registry.AGGREGATORS)
  assert {a for a, _ in _METHODS} == set(registry.ALGORITHMS)


@pytest.fixture(scope='module')
def built(setup):
  """Each record's method, built once for both tests below (the full suite runs both)."""
  data, _, model_fn = setup
  methods_by_name = {}

  def get(algorithm, aggregator, staged=False):
    if (algorithm, aggregator, staged) not in methods_by_name:
      methods_by_name[algorithm, aggregator, staged] = methods.build(
          model_fn, algorithm, aggregator, num_clients=len(data.train.client_ids),
          metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize, staged=staged)
    return methods_by_name[algorithm, aggregator, staged]
  return get


_IDS = [f'{a}/{g}' for a, g in _METHODS]


# The slow tier: a round through the runner's loop. The fast tier runs a round of every algorithm and every
# aggregator through `methods.build` against its reference (tests/methods_reference/reference_test.py); the worker's
# first call of each new process (some 2 s) is most of this test's time.
@pytest.mark.slow
@pytest.mark.parametrize('algorithm, aggregator', _METHODS, ids=_IDS)
def test_record_trains_a_round(setup, built, algorithm, aggregator):
  data, build_keras, _ = setup
  method = built(algorithm, aggregator)
  state = round_loop.seeded_initial_state(method.process, build_keras, 0)
  before = method.process.get_model_weights(state).trainable
  inputs = round_loop.ClientInputs(data.train, len(data.train.client_ids), 1, 32, 0)
  loop = round_loop.RoundLoop(method, state, inputs)
  done = loop.step()
  after = method.process.get_model_weights(done.state).trainable
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(not np.allclose(a, b) for a, b in zip(after, before))
  assert done.row  # The round's metrics, flattened.


@pytest.mark.parametrize('algorithm, aggregator', _METHODS, ids=_IDS)
def test_record_contract(built, algorithm, aggregator):
  aggregator_record, algorithm_record = registry.aggregator(aggregator), registry.algorithm(algorithm)
  if aggregator_record.kind == registry.MODEL_AGGREGATOR:
    assert isinstance(registry.build(aggregator), tff.aggregators.WeightedAggregationFactory)
  else:
    with pytest.raises(ValueError, match='not a model aggregator'):
      registry.build(aggregator)

  method = built(algorithm, aggregator)
  assert isinstance(method.process, tff.learning.templates.LearningProcess)
  report = audit.audit_computation(method.process)
  assert report.ok == registry.is_private(algorithm, aggregator), [str(v) for v in report.violations]

  if not aggregator_record.multi_stage:
    assert runtime.check_single_aggregation_stage(method.process) == 1
  else:
    with pytest.raises(ValueError, match='sequential'):
      runtime.check_single_aggregation_stage(method.process)
    if algorithm_record.staged:
      registry.check(algorithm, aggregator, workers='localhost:1')
      staged = built(algorithm, aggregator, staged=True).process
      assert runtime.check_single_aggregation_stage(staged) == 1
      assert len(staged.aggregation.stages) > 1
      assert audit.audit_computation(staged).ok == registry.is_private(algorithm, aggregator)
    else:
      with pytest.raises(ValueError, match='workers'):
        registry.check(algorithm, aggregator, workers='localhost:1')

  local_allowed = (client_execution.LOCAL in algorithm_record.client_execution
                   and aggregator_record.kind == registry.MODEL_AGGREGATOR)
  if local_allowed:
    registry.check(algorithm, aggregator, client_execution=client_execution.LOCAL)
  else:
    with pytest.raises(ValueError, match='client_execution'):
      registry.check(algorithm, aggregator, client_execution=client_execution.LOCAL)
