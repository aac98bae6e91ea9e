"""`StagedAggregationProcess`: RFA's passes one computation each, equal to the one-computation process, stage by stage.

Each stage must aggregate in one stage (what TFF's several workers run), pass on only SERVER-placed values, and the
last must return what `create(...).next` returns, bit for bit, in every mode of the factory.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import runtime
from tff_gma.aggregators import staged

VALUE_TYPE = tff.to_type([tff.TensorType(np.float32, [2, 3]), tff.TensorType(np.float32, [4])])
WEIGHT_TYPE = tff.TensorType(np.float32)

# Every way a call's rounds are laid out: both starts, one-step, 1-5 passes, the final objective, secure sums, and
# an inner mean not known to be exact (a zero start then waits a round for D(0)).
_MODES = {
    'zero-3': dict(),
    'mean-3': dict(init='mean'),
    'one_step': dict(one_step=True),
    'zero-1': dict(num_passes=1),
    'mean-5-final': dict(init='mean', num_passes=5, report_final_objective=True),
    'secure-zero-2': dict(num_passes=2, secure=True, value_bound=4.0),
    'secure-mean-4': dict(num_passes=4, init='mean', secure=True, value_bound=4.0),
    'inexact-zero-2': dict(num_passes=2, mean_factory=aggregators.SecureWeightedMeanFactory(4.0, 10.0)),
}


def _client_values(seed: int, count: int):
  rng = np.random.default_rng(seed)
  values = [[rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32)] for _ in range(count)]
  values[0] = [v * 30 for v in values[0]]  # An outlier, so the median and the mean differ.
  return values, [np.float32(w) for w in rng.uniform(0.5, 3.0, size=count)]


def _flat(structure):
  return [np.asarray(x) for x in tf.nest.flatten(structure)]


def _assert_same(a, b):
  a, b = _flat(a), _flat(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def _placements(value_type) -> set:
  if isinstance(value_type, tff.FederatedType):
    return {value_type.placement}
  if isinstance(value_type, tff.StructType):
    return set().union(*(_placements(t) for t in value_type)) if len(value_type) else set()
  return set()


# Two modes in the fast tier (the default and secure sums); every mode in the slow one.
_FAST = ('zero-3', 'secure-zero-2')


@pytest.mark.parametrize('mode', [m if m in _FAST else pytest.param(m, marks=pytest.mark.slow) for m in _MODES],
                         ids=list(_MODES))
def test_stages_end_as_the_process(mode):
  factory = aggregators.GeometricMedianFactory(**_MODES[mode])
  process = factory.create(VALUE_TYPE, WEIGHT_TYPE)
  in_stages = factory.create_staged(VALUE_TYPE, WEIGHT_TYPE)
  assert len(in_stages.stages) == factory.num_rounds
  for stage in in_stages.stages:
    assert runtime.check_single_aggregation_stage(stage) == 1
    assert _placements(stage.type_signature.result) == {tff.SERVER}
  assert in_stages.stages[-1].type_signature.result == process.next.type_signature.result
  one, two = process.initialize(), in_stages.initialize()
  _assert_same(one, two)
  for seed in (0, 1):  # Two calls: the second from the state the first returned.
    values, weights = _client_values(seed, 5)
    one_output, two_output = process.next(one, values, weights), in_stages.next(two, values, weights)
    for field in ('state', 'result', 'measurements'):
      _assert_same(getattr(one_output, field), getattr(two_output, field))
    one, two = one_output.state, two_output.state


def test_the_staged_median_is_the_weiszfeld_estimate():
  # Independent of the process: smoothed Weiszfeld in NumPy from the zero start, 3 passes, nu = 1e-6.
  values, weights = _client_values(2, 6)
  points = np.stack([np.concatenate([v.ravel() for v in value]) for value in values]).astype(np.float64)
  a = np.asarray(weights, np.float64)
  estimate = np.zeros(points.shape[1])
  for _ in range(3):
    b = a / np.maximum(1e-6, np.linalg.norm(points - estimate, axis=1))
    estimate = b @ points / b.sum()
  in_stages = aggregators.GeometricMedianFactory().create_staged(VALUE_TYPE, WEIGHT_TYPE)
  result = in_stages.next(in_stages.initialize(), values, weights).result
  np.testing.assert_allclose(np.concatenate([np.asarray(r).ravel() for r in result]), estimate, rtol=1e-5, atol=1e-6)


def test_a_one_stage_process_is_its_own_stage():
  process = tff.aggregators.MeanFactory().create(VALUE_TYPE, WEIGHT_TYPE)
  one_stage = aggregators.create_staged(tff.aggregators.MeanFactory(), VALUE_TYPE, WEIGHT_TYPE)
  assert len(one_stage.stages) == 1
  assert one_stage.stages[0].type_signature == process.next.type_signature
  assert [name for name, _ in one_stage.computations()] == ['initialize', 'stage_1']
  values, weights = _client_values(3, 4)
  _assert_same(one_stage.next(one_stage.initialize(), values, weights).result,
               process.next(process.initialize(), values, weights).result)


def test_from_process_takes_weighted_processes_only():
  with pytest.raises(TypeError, match='weighted tff.templates.AggregationProcess'):
    staged.from_process(tff.aggregators.SumFactory().create(VALUE_TYPE))
  with pytest.raises(TypeError, match='weighted tff.templates.AggregationProcess'):
    staged.from_process('mean')
