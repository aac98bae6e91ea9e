"""RFA effective-weight audit: NumPy reference, dominance warning, agreement with the factory and a real round."""

import warnings

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import models
from tff_gma.aggregators import geometric_median
from tff_gma.data import loaders
from training import config as config_lib
from training.engine import fedavg_family
from training.engine import rfa_weights
from training.runner import round_loop

VALUE_TYPE = tff.to_type([tff.TensorType(np.float32, [2, 3]), tff.TensorType(np.float32, [4])])
WEIGHT_TYPE = tff.TensorType(np.float32)
NU = 1e-6


def random_updates(rng, num_clients, center=0.0, scale=1.0):
  return [[np.asarray(center + scale * rng.normal(size=(2, 3)), np.float32),
           np.asarray(center + scale * rng.normal(size=(4,)), np.float32)] for _ in range(num_clients)]


def flat(update):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in update])


def weiszfeld_reference(updates, weights, num_passes, nu, one_step=False, init=geometric_median.DEFAULT_INIT):
  """The RFA paper's Algorithms 2/3 with the unscaled weights beta_i = a_i / max(nu, ||v - w_i||), normalized.

  Pass 1: the weighted mean (init 'mean', Algorithm 2) or the reweighting from v_0 = 0 (init 'zero', and one-step
  RFA, Algorithm 3).
  """
  points = np.stack([flat(u) for u in updates])
  a = np.asarray(weights, np.float64)
  if one_step or init == 'zero':
    b = a / np.maximum(nu, np.linalg.norm(points, axis=1))
    betas = [b / b.sum()]
  else:
    betas = [a / a.sum()]
  v = betas[0] @ points
  for _ in range(num_passes - 1):
    b = a / np.maximum(nu, np.linalg.norm(points - v, axis=1))
    betas.append(b / b.sum())
    v = betas[-1] @ points
  return v, betas


def run_factory(factory, updates, weights):
  process = factory.create(VALUE_TYPE, WEIGHT_TYPE)
  output = process.next(process.initialize(), updates, [np.float32(w) for w in weights])
  return flat(output.result), output.measurements


# ----------------------------------------------------------------------------------------------------------------
# The replay and the report against NumPy.


@pytest.mark.parametrize('init', ['mean', 'zero', None])
@pytest.mark.parametrize('num_passes, one_step', [(1, False), (3, False), (5, False), (1, True)])
def test_report_matches_numpy_reference(num_passes, one_step, init):
  if one_step and init == 'mean':
    pytest.skip('one-step RFA starts from the zero update')
  rng = np.random.default_rng(0)
  updates = random_updates(rng, 7, center=0.3)
  weights = rng.uniform(1, 50, size=7)
  estimate, betas = weiszfeld_reference(updates, weights, num_passes, NU, one_step,
                                        init or geometric_median.DEFAULT_INIT)
  report = rfa_weights.rfa_weight_report(updates, weights, num_passes, NU, bound=0.9, one_step=one_step, init=init)
  np.testing.assert_allclose(report['replay'].estimate, estimate, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(report['replay'].normalized_weights, np.stack(betas), rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(report['per_pass'], [b.max() for b in betas], rtol=1e-12)
  assert report['max_normalized_weight'] == pytest.approx(max(b.max() for b in betas), rel=1e-12)
  assert report['dominant_client'] == str(int(np.argmax(betas[int(np.argmax([b.max() for b in betas]))])))
  assert not report['dominated'] and report['num_clients'] == 7
  assert report['uniform_weight'] == pytest.approx(1 / 7)
  for b in report['replay'].normalized_weights:
    assert b.sum() == pytest.approx(1.0)


def test_client_at_the_median_gets_no_weight_in_the_reweighted_passes():
  # Four clients on the corners of a square around c and one client exactly at c: after the first pass from the
  # mean the estimate is c. Plain Weiszfeld gave the centre client a / nu, swamping the others (normalized weight
  # 10 / (10 + 4e-5)); Vardi and Zhang's step counts it as at the estimate: weight 0 in the mean, the corners 1/4
  # each, and the estimate stays at c (the corners' pulls cancel).
  c = np.array([1.0, -2.0, 0.5, 0.0, 3.0, 1.0, 0.0, 2.0, -1.0, 0.5])
  offsets = [np.eye(10)[0], -np.eye(10)[0], np.eye(10)[1], -np.eye(10)[1]]
  points = [c + o for o in offsets] + [c]
  updates = [[p[:6].reshape(2, 3), p[6:]] for p in points]
  weights = [10.0] * 5
  replay = rfa_weights.replay_rfa(updates, weights, rfa_weights.RfaSettings(3, NU, init='mean'))
  np.testing.assert_allclose(replay.normalized_weights[1:], [[0.25] * 4 + [0.0]] * 2)
  np.testing.assert_allclose(replay.estimate, c, atol=1e-12)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    report = rfa_weights.rfa_weight_report(updates, weights, 3, NU, bound=0.5, init='mean',
                                           client_ids=[f'c{i}' for i in range(5)])
  assert not report['dominated'] and report['per_pass'] == [pytest.approx(0.2), 0.25, 0.25]


def test_client_with_most_examples_dominates_the_first_pass():
  rng = np.random.default_rng(1)
  updates = random_updates(rng, 4)
  with pytest.warns(rfa_weights.DominatedAggregateWarning, match='pass 1 of 1'):
    report = rfa_weights.rfa_weight_report(updates, [1000, 10, 10, 10], 1, NU, bound=0.9, init='mean')
  assert report['per_pass'] == [pytest.approx(1000 / 1030)]
  assert report['dominant_client'] == '0'
  # The mean then lies within the smoothing of that client (1/30 of the median norm, its own): the reweighted pass
  # counts it as at the estimate and averages the three others, each a / d_i.
  replay = rfa_weights.replay_rfa(updates, [1000, 10, 10, 10], rfa_weights.RfaSettings(2, NU, init='mean'))
  points = np.stack([rfa_weights.flatten_update(u) for u in updates])
  mean = np.array([1000, 10, 10, 10]) @ points / 1030
  inverse = 1 / np.linalg.norm(points[1:] - mean, axis=1)
  np.testing.assert_allclose(replay.normalized_weights[1], np.concatenate([[0.0], inverse / inverse.sum()]))


def test_spread_clients_do_not_warn():
  rng = np.random.default_rng(2)
  updates = random_updates(rng, 10)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    report = rfa_weights.rfa_weight_report(updates, [5.0] * 10, 3, NU, bound=0.3)
  assert not report['dominated']
  assert 0.1 <= report['max_normalized_weight'] < 0.3
  metrics = rfa_weights.report_metrics(report)
  assert metrics['rfa_audit/max_normalized_weight'] == report['max_normalized_weight']
  assert [metrics[f'rfa_audit/pass_{k}/max_normalized_weight'] for k in (1, 2, 3)] == report['per_pass']


def test_dropped_clients_get_no_weight():
  rng = np.random.default_rng(3)
  updates = random_updates(rng, 4)
  updates[1][0][0, 0] = np.nan
  report = rfa_weights.rfa_weight_report(updates, [1.0, 1.0, -1.0, 2.0], 2, NU, bound=0.9, warn=False)
  replay = report['replay']
  np.testing.assert_array_equal(replay.kept, [True, False, False, True])
  np.testing.assert_array_equal(replay.normalized_weights[:, 1:3], 0.0)
  assert report['num_clients'] == 2
  estimate, _ = weiszfeld_reference([updates[0], updates[3]], [1.0, 2.0], 2, NU)
  np.testing.assert_allclose(replay.estimate, estimate, rtol=1e-12)


@pytest.mark.parametrize('kwargs, name', [
    (dict(bound=0.0), 'bound'), (dict(bound=1.5), 'bound'), (dict(num_passes=0), 'num_passes'),
    (dict(smoothing=0.0), 'smoothing'), (dict(secure=True), 'value_bound'),
    (dict(one_step=True, num_passes=2), 'num_passes'), (dict(max_weight_ratio=1.0), 'max_weight_ratio'),
    (dict(client_ids=['a']), 'client_ids'),
])
def test_invalid_arguments_raise(kwargs, name):
  rng = np.random.default_rng(4)
  args = dict(client_updates=random_updates(rng, 3), client_weights=[1.0] * 3, num_passes=2, smoothing=NU,
              bound=0.5)
  args.update(kwargs)
  with pytest.raises(ValueError, match=name):
    rfa_weights.rfa_weight_report(**args)


# ----------------------------------------------------------------------------------------------------------------
# The replay against GeometricMedianFactory on the same client values.


@pytest.mark.parametrize('num_passes, one_step', [(3, False), (1, True)])
def test_replay_matches_factory(num_passes, one_step):
  rng = np.random.default_rng(5)
  updates = random_updates(rng, 6, center=0.5) + random_updates(rng, 2, center=-4.0, scale=3.0)  # Two outliers.
  weights = rng.uniform(1, 20, size=8)
  factory = aggregators.GeometricMedianFactory(num_passes=num_passes if not one_step else None, smoothing=NU,
                                               one_step=one_step)
  result, measurements = run_factory(factory, updates, weights)
  replay = rfa_weights.replay_rfa(updates, weights, rfa_weights.RfaSettings(num_passes, NU, one_step))
  np.testing.assert_allclose(replay.estimate, result, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(replay.objectives, measurements['objective'], rtol=1e-5)
  np.testing.assert_allclose(replay.smoothings, measurements['smoothing'], rtol=1e-6)


def test_secure_replay_matches_secure_factory():
  rng = np.random.default_rng(6)
  updates = random_updates(rng, 6, center=0.2) + random_updates(rng, 1, center=3.0)  # Clipped by the bound 2.
  weights = rng.uniform(1, 20, size=7)
  settings = rfa_weights.RfaSettings(3, NU, secure=True, value_bound=2.0, weight_bound=50.0)
  factory = aggregators.GeometricMedianFactory(num_passes=3, smoothing=NU, secure=True, value_bound=2.0,
                                               weight_bound=50.0)
  result, measurements = run_factory(factory, updates, weights)
  replay = rfa_weights.replay_rfa(updates, weights, settings)
  assert replay.smoothings[0] > NU  # The secure rule c = max(nu, D(v_0) / K) is in effect.
  np.testing.assert_allclose(replay.smoothings, measurements['smoothing'], rtol=1e-4)
  np.testing.assert_allclose(replay.objectives, measurements['objective'], rtol=1e-4)
  np.testing.assert_allclose(replay.estimate, result, atol=1e-4)  # Quantization is not replayed.


# ----------------------------------------------------------------------------------------------------------------
# The round's client updates and the monitor, against a real learning round.


def _setup():
  data = loaders.load_federated_data('digits', 'label_skew', 3, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  algorithm = config_lib.AlgorithmConfig(client_lr=0.1, server_lr=1.0)
  datasets = [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=64, seed=0, round_num=1)
              for c in data.train.client_ids]
  return data, build_keras, model_fn, algorithm, datasets


def _delta(before, after):
  return np.concatenate([np.ravel(b - a) for b, a in zip(before.trainable, after.trainable)])


def test_monitor_replays_the_rounds_rfa_aggregate():
  data, build_keras, model_fn, algorithm, datasets = _setup()
  factory = aggregators.GeometricMedianFactory(num_passes=2, smoothing=NU)
  process = fedavg_family.build_learning_process(model_fn, algorithm, factory)
  state = round_loop.seeded_initial_state(process, build_keras, 0)
  start = process.get_model_weights(state)

  monitor = rfa_weights.RfaWeightMonitor(model_fn, algorithm, bound=0.99, settings=rfa_weights.RfaSettings(2, NU))
  report = monitor(start, datasets, data.train.client_ids)
  updates, weights = rfa_weights.build_client_updates(model_fn, algorithm)(start, datasets)
  np.testing.assert_array_equal(weights, [data.train.num_examples(c) for c in data.train.client_ids])

  state, _ = process.next(state, datasets)
  # Server SGD with learning rate 1 applies the aggregate of the updates (initial - trained) as a gradient.
  applied = _delta(start, process.get_model_weights(state))
  np.testing.assert_allclose(report['replay'].estimate, applied, rtol=1e-4, atol=1e-6)
  assert len(report['per_pass']) == 2 and report['num_clients'] == 3
  # Pass 1 from the default zero start reweights a_i / ||w_i||: the replay of those very updates.
  first = weights / np.maximum(NU, [np.linalg.norm(flat(u)) for u in updates])
  np.testing.assert_allclose(report['per_pass'][0], first.max() / first.sum(), rtol=1e-9)
  assert report['max_normalized_weight'] >= 1 / 3


def test_build_client_updates_rejects_bad_algorithm():
  with pytest.raises(ValueError, match='algorithm'):
    rfa_weights.build_client_updates(lambda: None, 'fedavg')
