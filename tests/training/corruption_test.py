"""Corruption models: which clients, data poisoning, update poisoning (Gaussian, omniscient, the attacks), the flags."""

import collections
import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from absl import flags
from scipy import stats

from tests.training import interrupt
from tff_gma import models
from tff_gma.data import client_data
from tff_gma.data import loaders
from training import config as config_lib
from training.engine import attacks
from training.engine import corruption
from training.engine import registry
from training.runner import experiment
from training.runner import round_loop

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='iid', num_clients=6, clients_per_round=4, rounds=1, model='logistic',
    batch_size=32, client_lr=0.1, client_momentum=0.0, seed=5, checkpoint_every=1)


# ------------------------------------------------------------------------------------------- which clients


@pytest.mark.parametrize('num_clients, rho, expected', [(10, 0.0, 0), (10, 0.1, 1), (10, 0.25, 3), (10, 0.4, 4),
                                                        (20, 0.25, 5), (3, 0.5, 2)])
def test_number_of_corrupted_clients_is_rho_times_n_rounded(num_clients, rho, expected):
  ids = client_data.client_ids(num_clients)
  chosen = corruption.corrupted_clients(ids, rho, seed=0)
  assert len(chosen) == expected == corruption.num_corrupted(num_clients, rho)
  assert set(chosen) <= set(ids) and len(set(chosen)) == len(chosen)


def test_corrupted_set_is_a_function_of_the_seed():
  ids = client_data.client_ids(20)
  assert corruption.corrupted_clients(ids, 0.25, 7) == corruption.corrupted_clients(ids, 0.25, 7)
  draws = {tuple(corruption.corrupted_clients(ids, 0.25, s)) for s in range(6)}
  assert len(draws) > 1


@pytest.mark.parametrize('name, rho, match', [('noise', 0.1, 'corruption'), ('gaussian', 1.0, 'corrupt_fraction'),
                                              ('gaussian', -0.1, 'corrupt_fraction'),
                                              ('gaussian', True, 'corrupt_fraction')])
def test_invalid_corruption_settings_raise(name, rho, match):
  with pytest.raises(ValueError, match=match):
    experiment.validate(dataclasses.replace(_TOY, corruption=name, corrupt_fraction=rho))


def test_the_name_is_checked_by_check_corruption_the_level_where_it_is_built_and_where_it_is_used():
  for name in corruption.CORRUPTIONS:
    corruption.check_corruption(name)
  with pytest.raises(ValueError, match=r"^corruption must be one of .*'noise'"):
    corruption.check_corruption('noise')
  for rho in (1.0, -0.1, True):
    with pytest.raises(ValueError, match='^corrupt_fraction must'):
      config_lib.AggregatorParams(corrupt_fraction=rho)
    with pytest.raises(ValueError, match='^corrupt_fraction must'):
      corruption.num_corrupted(10, rho)


# ---------------------------------------------------------------------------------------------- data poisoning


def _toy_client_data():
  rng = np.random.default_rng(0)
  arrays = collections.OrderedDict(
      (f'c{i}', (rng.uniform(size=(3 + i, 2, 2, 1)).astype(np.float32), rng.integers(0, 10, 3 + i).astype(np.int32)))
      for i in range(4))
  return arrays, client_data.from_client_arrays(arrays)


@pytest.mark.parametrize('kind', ['data_negate', 'data_flip_labels'])
def test_data_poisoning_changes_only_the_corrupted_clients(kind):
  arrays, train = _toy_client_data()
  poisoned = corruption.poison_data(train, ['c1', 'c3'], kind, num_classes=10)
  assert poisoned.client_ids == train.client_ids
  for cid, (x, y) in arrays.items():
    px, py = poisoned.client_arrays(cid)
    if cid in ('c1', 'c3') and kind == 'data_negate':
      np.testing.assert_allclose(px, 1.0 - x)
      np.testing.assert_array_equal(py, y)
    elif cid in ('c1', 'c3'):
      np.testing.assert_array_equal(px, x)
      np.testing.assert_array_equal(py, 9 - y)
    else:
      np.testing.assert_array_equal(px, x)
      np.testing.assert_array_equal(py, y)


def test_data_poisoning_rejects_data_it_does_not_fit():
  with pytest.raises(ValueError, match='data_negate'):
    corruption.negate_images(np.array([0.5, 2.0], np.float32))
  with pytest.raises(ValueError, match='data_flip_labels'):
    corruption.flip_labels(np.zeros([2, 3], np.int32), 10)
  _, train = _toy_client_data()
  with pytest.raises(ValueError, match='corrupted'):
    corruption.poison_data(train, ['nobody'], 'data_negate', 10)
  assert corruption.poison_data(train, ['c1'], 'gaussian', 10) is train


def test_runner_trains_on_poisoned_data_of_the_corrupted_clients_only(tmp_path):
  config = dataclasses.replace(_TOY, corruption='data_negate', corrupt_fraction=0.34, output_dir=str(tmp_path))
  setup = experiment.build_setup(config)
  clean = loaders.load_federated_data('digits', 'iid', 6, 5)
  assert setup.corrupted == tuple(corruption.corrupted_clients(clean.train.client_ids, 0.34, 5))
  assert len(setup.corrupted) == 2
  for cid in clean.train.client_ids:
    x, y = setup.data.train.client_arrays(cid)
    cx, cy = clean.train.client_arrays(cid)
    np.testing.assert_allclose(x, 1.0 - cx if cid in setup.corrupted else cx)
    np.testing.assert_array_equal(y, cy)


# ---------------------------------------------------------------------------------------- Gaussian (plain TF)


def test_gaussian_noise_has_the_variance_of_the_update_components():
  rng = np.random.default_rng(1)
  update = [rng.normal(0.3, 2.0, size=(100, 150)).astype(np.float32), rng.normal(-1, 0.5, 5000).astype(np.float32)]
  flat = np.concatenate([u.ravel() for u in update])
  noise = corruption.gaussian_noise_like([tf.constant(u) for u in update], tf.constant([3, 4], tf.int64))
  noise = [n.numpy() for n in noise]
  assert [n.shape for n in noise] == [u.shape for u in update]
  flat_noise = np.concatenate([n.ravel() for n in noise])
  assert flat_noise.std() == pytest.approx(flat.std(), rel=0.02)  # 20k samples: ~0.5% standard error.
  assert abs(flat_noise.mean()) < 0.05 * flat.std()
  assert abs(np.corrcoef(flat_noise, flat)[0, 1]) < 0.05  # Replaces the update; does not perturb it.
  again = corruption.gaussian_noise_like([tf.constant(u) for u in update], tf.constant([3, 4], tf.int64))
  np.testing.assert_array_equal(noise[0], again[0].numpy())
  other = corruption.gaussian_noise_like([tf.constant(u) for u in update], tf.constant([3, 5], tf.int64))
  assert not np.allclose(noise[0], other[0].numpy())


def test_corrupt_update_selects_by_code():
  update = [tf.constant([1.0, 2.0, 3.0])]
  attack = [tf.constant([-7.0, 0.0, 7.0])]
  seed = tf.constant([1, 2], tf.int64)
  np.testing.assert_array_equal(corruption.corrupt_update(update, corruption.HONEST, seed, attack)[0], [1, 2, 3])
  np.testing.assert_array_equal(corruption.corrupt_update(update, corruption.OMNISCIENT, seed, attack)[0],
                                [-7, 0, 7])
  noise = corruption.corrupt_update(update, corruption.GAUSSIAN, seed, attack)[0].numpy()
  np.testing.assert_array_equal(noise, corruption.gaussian_noise_like(update, seed)[0].numpy())


# --------------------------------------------------------------------------------------- omniscient (NumPy)


@pytest.mark.parametrize('corrupted', [[True, False, False, False, True], [False, True, False, False, False],
                                       [True] * 5])
def test_omniscient_attack_makes_the_weighted_mean_the_negated_honest_mean(corrupted):
  rng = np.random.default_rng(2)
  updates = [[rng.normal(size=(3, 2)), rng.normal(size=4)] for _ in range(5)]
  weights = [3.0, 1.0, 2.0, 5.0, 4.0]
  result = corruption.omniscient_attack(updates, weights, corrupted)
  honest_mean = [sum(w * u[j] for w, u in zip(weights, updates)) / sum(weights) for j in range(2)]
  sent = [result.attack if c else u for u, c in zip(updates, corrupted)]
  sent_mean = [sum(w * u[j] for w, u in zip(weights, sent)) / sum(weights) for j in range(2)]
  for j in range(2):
    np.testing.assert_allclose(result.honest_mean[j], honest_mean[j], rtol=1e-12)
    np.testing.assert_allclose(sent_mean[j], -honest_mean[j], rtol=1e-9, atol=1e-12)


def test_omniscient_attack_needs_corrupted_weight():
  assert corruption.omniscient_attack([[np.ones(2)], [np.ones(2)]], [1.0, 0.0], [False, True]) is None
  with pytest.raises(ValueError, match='one entry per client'):
    corruption.omniscient_attack([[np.ones(2)]], [1.0, 2.0], [False, True])


# -------------------------------------------------------------------------------------------- the client work


@pytest.fixture(scope='module')
def digits_clients():
  data = loaders.load_federated_data('digits', 'iid', 4, 0)
  build_keras = models.keras_builder('logistic', data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  datasets = [round_loop.client_dataset(data.train, c, local_epochs=1, batch_size=32, seed=0, round_num=1)
              for c in data.train.client_ids]
  tf.keras.utils.set_random_seed(0)
  keras_model = build_keras()
  weights = tff.learning.models.ModelWeights(trainable=[v.numpy() for v in keras_model.trainable_weights],
                                             non_trainable=[])
  return model_fn, datasets, weights


def _element(code, seed, vector):
  return tf.data.Dataset.from_tensors(collections.OrderedDict(
      code=np.int32(code), seed=np.array(seed, np.int64), attack=tuple(tf.constant(v) for v in vector)))


def test_client_work_sends_honest_update_noise_or_attack(digits_clients):
  model_fn, datasets, weights = digits_clients
  inner = tff.learning.templates.build_model_delta_client_work(
      model_fn, tff.learning.optimizers.build_sgdm(0.1), tff.learning.ClientWeighting.NUM_EXAMPLES)
  work = corruption.build_corrupted_client_work(inner)
  honest = inner.next(inner.initialize(), [weights] * 3, datasets[:3])
  zeros = [np.zeros_like(np.asarray(u)) for u in honest.result[0].update]
  attack = [np.full_like(np.asarray(u), 0.25) for u in honest.result[0].update]
  data = [
      collections.OrderedDict(data=datasets[0], corruption=_element(corruption.HONEST, [0, 0], zeros)),
      collections.OrderedDict(data=datasets[1], corruption=_element(corruption.GAUSSIAN, [4, 2], zeros)),
      collections.OrderedDict(data=datasets[2], corruption=_element(corruption.OMNISCIENT, [0, 0], attack)),
  ]
  output = work.next(work.initialize(), [weights] * 3, data)
  sent = [[np.asarray(u) for u in r.update] for r in output.result]
  own = [[np.asarray(u) for u in r.update] for r in honest.result]
  assert output.measurements['corrupted_clients'] == 2
  assert output.measurements['train'] == honest.measurements['train']
  for client in range(3):  # Weights are the honest ones (example counts) for every client.
    assert float(output.result[client].update_weight) == float(honest.result[client].update_weight) > 0
  np.testing.assert_allclose(sent[0][0], own[0][0], rtol=1e-6, atol=1e-7)  # Honest client: its own update.
  flat_noise = np.concatenate([u.ravel() for u in sent[1]])
  flat_own = np.concatenate([u.ravel() for u in own[1]])
  assert flat_noise.std() == pytest.approx(flat_own.std(), rel=0.15)  # 650 components.
  assert abs(np.corrcoef(flat_noise, flat_own)[0, 1]) < 0.2
  for got, want in zip(sent[2], attack):
    np.testing.assert_array_equal(got, want)
  # The same seed gives the same noise (resumed runs repeat it).
  again = work.next(work.initialize(), [weights], data[1:2])
  np.testing.assert_array_equal(np.asarray(again.result[0].update[0]), sent[1][0])


def _trainable(result):
  return [np.asarray(t, np.float64) for t in result.model_weights.trainable]


def _initial_trainable(config):
  data = loaders.load_federated_data(config.dataset, config.partition, config.num_clients, config.seed)
  tf.keras.utils.set_random_seed(config.seed)  # As round_loop.seeded_initial_state.
  keras_model = models.keras_builder(config.model, data.input_shape, data.num_classes)()
  return [v.numpy().astype(np.float64) for v in keras_model.trainable_weights]


def test_omniscient_runner_round_moves_the_model_by_the_negated_honest_mean(tmp_path):
  # Server SGD with learning rate 1 applies the aggregate: w1 = w0 - mean(sent). Honest: w1 = w0 - m.
  # Omniscient with the mean: the sent mean is -m, so w1 - w0 is exactly the negation of the honest step.
  config = dataclasses.replace(_TOY, aggregator='mean')
  honest = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'honest')), show_progress=False)
  attacked = experiment.run(dataclasses.replace(config, corruption='omniscient', corrupt_fraction=0.34,
                                                output_dir=str(tmp_path / 'attack')), show_progress=False)
  participants = round_loop.sample_clients(client_data.client_ids(6), 4, config.seed, 1)
  corrupted = corruption.corrupted_clients(client_data.client_ids(6), 0.34, config.seed)
  assert set(participants) & set(corrupted) and set(participants) - set(corrupted)  # A real attack this round.
  w0 = _initial_trainable(config)
  for start, good, bad in zip(w0, _trainable(honest), _trainable(attacked)):
    assert np.abs(good - start).max() > 1e-3
    np.testing.assert_allclose(bad - start, -(good - start), rtol=1e-4, atol=2e-6)


def test_gaussian_corruption_runs_and_resumes_exactly(tmp_path):
  config = dataclasses.replace(_TOY, corruption='gaussian', corrupt_fraction=0.34, rounds=2, eval_every=2)
  whole = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'a')), show_progress=False)
  resumed_config = dataclasses.replace(config, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(resumed_config, 1)
  resumed = experiment.run(resumed_config, show_progress=False)
  for a, b in zip(_trainable(whole), _trainable(resumed)):
    np.testing.assert_array_equal(a, b)
  rows = experiment._read_rows(str(tmp_path / 'a' / 'metrics.csv'))
  assert [r['corrupted_participants'] for r in rows] == [
      float(len(set(round_loop.sample_clients(client_data.client_ids(6), 4, 5, r)) &
                set(corruption.corrupted_clients(client_data.client_ids(6), 0.34, 5)))) for r in (1, 2)]
  assert all(r['client_work/corrupted_clients'] == r['corrupted_participants'] for r in rows)


def test_runner_flags_map_onto_the_config():
  from training import run  # pylint: disable=g-import-not-at-top  # Defines the runner's flags.
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(['run', '--corruption=omniscient', '--corrupt_fraction=0.25', '--aggregator=krum'])
    config = run.config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
  assert (config.corruption, config.corrupt_fraction, config.aggregator) == ('omniscient', 0.25, 'krum')
  experiment.validate(config)
  with pytest.raises(flags.IllegalFlagValueError):
    flags.FLAGS(['run', '--corruption=backdoor'])
  flags.FLAGS.unparse_flags()
  try:
    flags.FLAGS(['run', '--corruption=min_sum', '--minmax_perturbation=sign', '--minmax_gamma_init=4'])
    config = run.config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
  assert config.attack_params() == config_lib.AttackParams(minmax_perturbation='sign', minmax_gamma_init=4.0)
  experiment.validate(config)
  with pytest.raises(flags.IllegalFlagValueError):
    flags.FLAGS(['run', '--minmax_perturbation=random'])
  flags.FLAGS.unparse_flags()


# ------------------------------------------------------------------------- the literature's attacks (harness)


def test_every_attack_is_an_update_corruption_of_the_registry_and_the_runner():
  assert corruption.UPDATE_CORRUPTIONS == registry.UPDATE_CORRUPTIONS
  assert set(attacks.ATTACKS) <= set(corruption.UPDATE_CORRUPTIONS) and set(attacks.ATTACKS) <= set(
      corruption.CORRUPTIONS)
  for name in attacks.ATTACKS:
    experiment.validate(dataclasses.replace(_TOY, corruption=name, corrupt_fraction=0.34))
    with pytest.raises(ValueError, match='client_execution'):  # Inside the TFF client work, as the omniscient.
      registry.check('fedavg', 'mean', name, 'local')


@pytest.mark.parametrize('changes, match', [
    (dict(alie_z=0.0), '^alie_z must be a positive finite'), (dict(ipm_epsilon=-1.0), '^ipm_epsilon must'),
    (dict(large_norm_scale=float('inf')), '^large_norm_scale must'), (dict(minmax_gamma_init=0), '^minmax_gamma_init'),
    (dict(minmax_perturbation='random'), '^minmax_perturbation must be one of')])
def test_attack_settings_are_checked_once_in_one_line_naming_the_flag(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.AttackParams(**changes)
  with pytest.raises(experiment.ConfigError, match=match.lstrip('^')) as raised:
    experiment.validate(dataclasses.replace(_TOY, corruption='alie', corrupt_fraction=0.34, **changes))
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('corruption_name, changes', [
    ('alie', dict(ipm_epsilon=0.5)), ('ipm', dict(alie_z=1.0)), ('omniscient', dict(minmax_gamma_init=5.0)),
    ('none', dict(large_norm_scale=10.0)), ('min_max', dict(alie_z=2.0))])
def test_an_attack_setting_the_corruption_does_not_read_is_refused(corruption_name, changes):
  (name, value), = changes.items()
  config = dataclasses.replace(_TOY, corruption=corruption_name, corrupt_fraction=0.34, **changes)
  with pytest.raises(experiment.ConfigError, match=f'^{name}: corruption={corruption_name} does not read it'):
    experiment.validate(config)
  readers = {'alie_z': 'alie', 'ipm_epsilon': 'ipm', 'large_norm_scale': 'large_norm',
             'minmax_gamma_init': 'min_max'}
  experiment.validate(dataclasses.replace(config, corruption=readers[name]))


def _leaves(seed, n):
  rng = np.random.default_rng(seed)
  return [[rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=4).astype(np.float32)] for _ in range(n)]


def test_harness_attack_sends_one_vector_per_attacker_from_every_participants_update():
  updates = _leaves(0, 6)
  corrupted = [False, True, False, False, True, False]
  rows = np.stack([np.concatenate([leaf.astype(np.float64).ravel() for leaf in u]) for u in updates])
  params = config_lib.AttackParams()
  # sign_flip: each attacker its own update negated.
  sent = corruption.harness_attack('sign_flip', updates, corrupted, params)
  assert [v is None for v in sent] == [not c for c in corrupted]
  np.testing.assert_array_equal(sent[1], -rows[1])
  np.testing.assert_array_equal(sent[4], -rows[4])
  # alie: n = 6 participants, f = 2 corrupted, statistics over all six honest updates.
  z = stats.norm.ppf((6 - (math.floor(6 / 2 + 1) - 2)) / 6)  # Phi^-1(4 / 6).
  alie = corruption.harness_attack('alie', updates, corrupted, params)
  np.testing.assert_allclose(alie[1], rows.mean(axis=0) - z * rows.std(axis=0, ddof=1), rtol=1e-9)
  assert alie[4] is alie[1] and alie[0] is None
  # mimic: a participant that is not corrupted.
  mimic = corruption.harness_attack('mimic', updates, corrupted, params)[1]
  assert any(np.array_equal(mimic, rows[i]) for i in (0, 2, 3, 5))
  np.testing.assert_array_equal(corruption.harness_attack('zero_update', updates, corrupted, params)[4], np.zeros(10))
  ipm = corruption.harness_attack('ipm', updates, corrupted, config_lib.AttackParams(ipm_epsilon=2.0))[1]
  np.testing.assert_allclose(ipm, -2.0 * rows.mean(axis=0), rtol=1e-12)
  with pytest.raises(ValueError, match='one entry per participant'):
    corruption.harness_attack('ipm', updates, corrupted[:3], params)


def test_corrupted_rounds_send_the_alie_vector_to_the_corrupted_participants_only(digits_clients):
  model_fn, datasets, _ = digits_clients
  process = corruption.build_learning_process(model_fn, config_lib.AlgorithmConfig(client_lr=0.1,
                                                                                   client_momentum=0.0))
  ids = client_data.client_ids(4)
  rounds = corruption.CorruptedRounds(process, 'alie', [ids[1], ids[3]], ids, seed=3,
                                      params=config_lib.AttackParams(alie_z=1.5))
  state = process.initialize()
  data = rounds.client_data(state, ids, datasets, round_num=2)
  honest = process.honest_client_results(process.get_model_weights(state), datasets)
  rows = np.stack([np.concatenate([np.asarray(t, np.float64).ravel() for t in r.update]) for r in honest])
  expected = rows.mean(axis=0) - 1.5 * rows.std(axis=0, ddof=1)
  for i, cid in enumerate(ids):
    element = next(iter(data[i][corruption.CORRUPTION]))
    assert int(element['code']) == (corruption.ATTACK if i in (1, 3) else corruption.HONEST)
    sent = np.concatenate([np.asarray(t).ravel() for t in element['attack']])
    assert sent.dtype == np.float32
    if i in (1, 3):
      np.testing.assert_allclose(sent, expected, rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(element['seed'], corruption._client_seed(3, 2, i))
    else:
      assert not sent.any()
  output = rounds.run_round(state, ids, datasets, 2)
  assert output.metrics['client_work']['corrupted_clients'] == 2
