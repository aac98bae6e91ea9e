"""The experiment runner: outputs, resume and determinism, validation, and every algorithm x aggregator."""

import dataclasses
import json
import os

import numpy as np
import pytest

from training import experiment
from training import methods

_TOY = experiment.ExperimentConfig(
    dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3, rounds=3, model='logistic',
    batch_size=32, client_lr=0.05, seed=3)


def _weights(result):
  w = result.model_weights
  return [np.asarray(t) for t in list(w.trainable) + list(w.non_trainable)]


def test_outputs_and_summary(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), eval_every=2)
  summary = experiment.run(config, show_progress=False).summary
  out = tmp_path / 'run'
  assert {'metrics.csv', 'summary.json', 'accuracy.png', 'config.json', 'checkpoints', 'tensorboard'} <= set(
      os.listdir(out))
  assert any(name.startswith('events') for name in os.listdir(out / 'tensorboard'))
  rows = experiment._read_rows(str(out / 'metrics.csv'))
  assert [r['round'] for r in rows] == [1, 2, 3]
  # Evaluated rounds: every 2nd and the last; participating vs non-participating since 3 of 4 clients take part.
  assert [('test/accuracy' in r) for r in rows] == [False, True, True]
  assert 'participating/accuracy' in rows[1] and 'non_participating/accuracy' in rows[1]
  assert 'client_work/train/loss' in rows[0]
  saved = json.loads((out / 'summary.json').read_text())
  assert saved['rounds_completed'] == 3
  assert saved['final_accuracy'] == pytest.approx(np.mean([rows[1]['test/accuracy'], rows[2]['test/accuracy']]))
  assert saved['best_accuracy'] == pytest.approx(max(rows[1]['test/accuracy'], rows[2]['test/accuracy']))
  assert saved['config']['aggregator'] == 'mean' and saved['config']['seed'] == 3
  assert summary['final_accuracy'] == saved['final_accuracy']


class _Interrupt(Exception):
  pass


def test_interrupted_and_resumed_run_equals_uninterrupted_run(tmp_path):
  whole = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'a')), show_progress=False)

  def stop_after_two(round_num, state):
    del state
    if round_num == 2:
      raise _Interrupt()

  config_b = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'b'))
  with pytest.raises(_Interrupt):
    experiment.run(config_b, show_progress=False, on_round=stop_after_two)
  rounds_seen = []
  resumed = experiment.run(config_b, show_progress=False, on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3]  # Only the missing round ran.
  for a, b in zip(_weights(whole), _weights(resumed)):
    np.testing.assert_array_equal(a, b)
  assert resumed.summary['rounds_completed'] == 3

  # A larger --rounds continues from the checkpoint.
  longer = experiment.run(dataclasses.replace(config_b, rounds=4), show_progress=False,
                          on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3, 4] and longer.summary['rounds_completed'] == 4


def test_resume_with_other_settings_is_refused(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'run'), rounds=1)
  experiment.run(config, show_progress=False)
  with pytest.raises(ValueError, match='aggregator'):
    experiment.run(dataclasses.replace(config, aggregator='gma'), show_progress=False)


def test_a_new_nested_output_dir_is_created_after_the_checks(tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'new' / 'run'), rounds=1)
  experiment.check_resumable(config)  # Reads only: nothing there yet, nothing written.
  assert not (tmp_path / 'new').exists()
  experiment.run(config, show_progress=False)
  assert json.loads((tmp_path / 'new' / 'run' / 'config.json').read_text())['seed'] == 3
  experiment.check_resumable(config)  # The same settings again: resumable.
  with pytest.raises(experiment.ConfigError, match='seed'):
    experiment.check_resumable(dataclasses.replace(config, seed=4))


@pytest.mark.parametrize('changes, flag', [
    ({'clients_per_round': 5}, 'clients_per_round'),
    ({'tau': 1.5}, 'tau'),
    ({'aggregator': 'median_of_means'}, 'aggregator'),
    ({'algorithm': 'fedsgd'}, 'algorithm'),
    ({'model': 'transformer'}, 'model'),
    ({'partition': 'by_writer'}, 'partition'),
    ({'dataset': 'imagenet'}, 'dataset'),
    ({'rounds': 0}, 'rounds'),
    ({'smoothing': 0.0}, 'smoothing'),
    ({'client_lr': -1.0}, 'client_lr'),
    ({'model': 'char_lstm'}, 'model'),
    ({'workers': 'localhost'}, 'workers'),
    ({'algorithm': 'fedprox', 'aggregator': 'elastic'}, 'aggregator'),
    ({'algorithm': 'scaffold', 'corruption': 'gaussian', 'corrupt_fraction': 0.25}, 'corruption'),
    ({'secure': True}, 'secure_bound'),
    ({'algorithm': 'personalized', 'aggregator': 'elastic'}, 'aggregator'),
    ({'seed': -1}, 'seed'),
    ({'client_lr': float('inf')}, 'client_lr'),
    ({'server_lr': float('nan')}, 'server_lr'),
])
def test_invalid_settings_fail_before_training(changes, flag, tmp_path):
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'never'), **changes)
  with pytest.raises(experiment.ConfigError, match=flag):
    config.validate()
  with pytest.raises(experiment.ConfigError):
    experiment.run(config, show_progress=False)
  assert not (tmp_path / 'never').exists()


# Every value of --algorithm and of --aggregator runs (each algorithm with the mean, each aggregator with FedAvg,
# and a few crossings), rather than the whole product: each case builds and traces a TFF process.
_MATRIX = sorted(
    {(a, 'mean') for a in methods.ALGORITHMS}
    | {('fedavg', g) for g in methods.AGGREGATORS}
    | {('fedadam', 'gma'), ('fedyogi', 'rfa'), ('fedprox', 'gma_binary'), ('fedadam', 'elastic'),
       ('scaffold', 'gma'), ('fedgma', 'rfa_one_step')})


@pytest.mark.parametrize('algorithm, aggregator', _MATRIX)
def test_algorithm_with_aggregator(algorithm, aggregator, tmp_path):
  config = dataclasses.replace(
      _TOY, algorithm=algorithm, aggregator=aggregator, rounds=2, num_clients=3, clients_per_round=3,
      partition='iid', corrupt_fraction=0.34 if aggregator in ('trimmed_mean', 'krum') else 0.0,
      server_lr=0.1 if algorithm in ('fedadam', 'fedyogi') else 1.0, output_dir=str(tmp_path / 'run'))
  result = experiment.run(config, show_progress=False)
  assert result.summary['rounds_completed'] == 2
  # Two rounds beat chance (0.1) clearly; personalized RFA's shared model alone need not (w + v_k predicts).
  key = 'final_personalized_accuracy' if algorithm == 'personalized' else 'best_accuracy'
  assert result.summary[key] > 0.3, result.summary
  assert all(np.all(np.isfinite(w)) for w in _weights(result))


def test_scaffold_run_resumes_exactly_with_client_control_variates(tmp_path):
  base = dataclasses.replace(_TOY, algorithm='scaffold', aggregator='mean', rounds=3, partition='iid')
  whole = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'a')), show_progress=False)

  def stop_after_two(round_num, state):
    del state
    if round_num == 2:
      raise _Interrupt()

  config_b = dataclasses.replace(base, output_dir=str(tmp_path / 'b'))
  with pytest.raises(_Interrupt):
    experiment.run(config_b, show_progress=False, on_round=stop_after_two)
  resumed = experiment.run(config_b, show_progress=False)
  for a, b in zip(_weights(whole), _weights(resumed)):
    np.testing.assert_array_equal(a, b)


def test_runner_on_two_workers_matches_one(tmp_path):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  workers = runtime.start_local_workers(2)
  try:
    base = dataclasses.replace(_TOY, aggregator='gma', rounds=2)
    one = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'one')), show_progress=False)
    two = experiment.run(dataclasses.replace(base, output_dir=str(tmp_path / 'two'),
                                             workers=','.join(w.target for w in workers)), show_progress=False)
  finally:
    runtime.set_simulation_context()
    for w in workers:
      w.stop()
  for a, b in zip(_weights(one), _weights(two)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  with pytest.raises(ValueError, match='sequential'):
    experiment.run(dataclasses.replace(base, aggregator='rfa', output_dir=str(tmp_path / 'rfa'),
                                       workers='127.0.0.1:1'), show_progress=False)


def test_rfa_weight_audit_is_logged_per_round(tmp_path):
  config = dataclasses.replace(_TOY, aggregator='rfa', rounds=2, rfa_weight_bound=0.9,
                               output_dir=str(tmp_path / 'run'))
  experiment.run(config, show_progress=False)
  rows = experiment._read_rows(str(tmp_path / 'run' / 'metrics.csv'))
  for row in rows:
    # 3 participants per round: the largest normalized weight lies between an equal share and 1.
    assert 1 / 3 - 1e-6 <= row['rfa_audit/max_normalized_weight'] <= 1.0
    assert row['rfa_audit/dominated'] in (0.0, 1.0)
  with pytest.raises(ValueError, match='rfa_weight_bound'):
    dataclasses.replace(config, aggregator='gma').validate()


def test_membership_inference_option_writes_the_attack(tmp_path):
  config = dataclasses.replace(_TOY, rounds=1, membership_inference=True, output_dir=str(tmp_path / 'run'))
  summary = experiment.run(config, show_progress=False).summary
  attack = json.loads((tmp_path / 'run' / 'membership.json').read_text())
  assert 0.0 <= attack['attack_accuracy'] <= 1.0
  assert summary['membership_attack_accuracy'] == pytest.approx(attack['attack_accuracy'])
  saved = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert saved['membership_attack_accuracy'] == pytest.approx(attack['attack_accuracy'])
