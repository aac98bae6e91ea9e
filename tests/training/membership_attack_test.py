"""Membership inference attack: separable vs indistinguishable logits, NumPy references, the script end to end."""

import tests
import json
import os
import subprocess

import numpy as np
import pytest

from tff_gma.data import digits
from tff_gma.data import loaders
from training.engine import membership_attack

_ROOT = tests.ROOT
NUM_CLASSES = 10


def overfit_logits(rng, num, margin):
  """Logits whose true class is ahead by about `margin` (a confident model), with their labels."""
  labels = rng.integers(0, NUM_CLASSES, size=num)
  logits = rng.normal(size=(num, NUM_CLASSES))
  logits[np.arange(num), labels] += margin
  return logits, labels


def numpy_features(logits, labels):
  """Reference features: logits, sorted softmax, cross-entropy, computed the textbook way."""
  probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
  loss = np.array([-np.log(p[y]) for p, y in zip(probs, labels)])
  return logits, np.array([sorted(p, reverse=True) for p in probs]), loss[:, None]


@pytest.mark.parametrize('features', membership_attack.FEATURES)
def test_separable_members_are_found(features):
  rng = np.random.default_rng(0)
  members = overfit_logits(rng, 1500, margin=12.0)  # Memorized: confident and right.
  nonmembers = overfit_logits(rng, 600, margin=0.0)  # Unseen: no better than a guess.
  report = membership_attack.membership_attack(*members, *nonmembers, seed=0, features=features)
  assert report['attack_accuracy'] > 0.9
  assert report['attack_auc'] > 0.95
  assert report['num_per_kind'] == 600
  assert all(a > 0.85 for a in report['fold_accuracies'])
  assert report['attack_advantage'] == pytest.approx(2 * report['attack_accuracy'] - 1)


@pytest.mark.parametrize('features', membership_attack.FEATURES)
def test_identical_distributions_give_chance(features):
  rng = np.random.default_rng(1)
  members = overfit_logits(rng, 2500, margin=2.0)
  nonmembers = overfit_logits(rng, 2500, margin=2.0)
  report = membership_attack.membership_attack(*members, *nonmembers, seed=3, features=features)
  # 5000 scored examples: the standard error is 0.007, so +-0.04 is more than 5 standard errors (and the seeds
  # are fixed, so the test is deterministic).
  assert abs(report['attack_accuracy'] - 0.5) < 0.04
  assert abs(report['attack_auc'] - 0.5) < 0.04
  assert report['standard_error'] == pytest.approx(np.sqrt(0.25 / 5000), rel=0.01)
  assert abs(report['gap_attack_accuracy'] - 0.5) < 0.04


def test_features_match_numpy_reference():
  rng = np.random.default_rng(2)
  logits, labels = overfit_logits(rng, 50, margin=3.0)
  ref_logits, ref_sorted, ref_loss = numpy_features(logits, labels)
  np.testing.assert_allclose(membership_attack.attack_features(logits, labels, 'logits'), ref_logits)
  np.testing.assert_allclose(membership_attack.attack_features(logits, labels, 'sorted_probs'), ref_sorted, rtol=1e-12)
  np.testing.assert_allclose(membership_attack.attack_features(logits, labels, 'loss'), ref_loss, rtol=1e-10)
  np.testing.assert_allclose(membership_attack.attack_features(logits, labels, 'all'),
                             np.concatenate([ref_logits, ref_sorted, ref_loss], axis=1), rtol=1e-10)
  # Large logits must not overflow (the model's logits are not bounded).
  assert np.all(np.isfinite(membership_attack.attack_features(1e4 * logits, labels, 'all')))


def test_loss_attack_is_close_to_the_best_threshold():
  # With the loss as the only feature the attacker is a threshold on the loss: it cannot beat the best threshold
  # chosen on the scored examples themselves, and with 1000 examples per kind it should come close to it.
  rng = np.random.default_rng(4)
  members = overfit_logits(rng, 1000, margin=4.0)
  nonmembers = overfit_logits(rng, 1000, margin=2.5)
  report = membership_attack.membership_attack(*members, *nonmembers, seed=0, features='loss')
  loss_m = numpy_features(*members)[2][:, 0]
  loss_n = numpy_features(*nonmembers)[2][:, 0]
  thresholds = np.concatenate([loss_m, loss_n])
  best = max(((loss_m <= t).sum() + (loss_n > t).sum()) / 2000 for t in thresholds)
  assert best - 0.03 < report['attack_accuracy'] <= best + 1e-9
  assert report['attack_accuracy'] > 0.6


def test_gap_attack_and_target_accuracies():
  rng = np.random.default_rng(5)
  members = overfit_logits(rng, 400, margin=3.0)
  nonmembers = overfit_logits(rng, 400, margin=1.0)
  report = membership_attack.membership_attack(*members, *nonmembers, seed=0, features='logits')
  # Equal sizes: every example is drawn, so the accuracies are those of the full sets.
  acc_m = np.mean(np.argmax(members[0], 1) == members[1])
  acc_n = np.mean(np.argmax(nonmembers[0], 1) == nonmembers[1])
  assert report['target_member_accuracy'] == pytest.approx(acc_m)
  assert report['target_nonmember_accuracy'] == pytest.approx(acc_n)
  assert report['gap_attack_accuracy'] == pytest.approx(0.5 + (acc_m - acc_n) / 2)


def test_balancing_and_determinism():
  rng = np.random.default_rng(6)
  members = overfit_logits(rng, 300, margin=3.0)
  nonmembers = overfit_logits(rng, 41, margin=2.0)
  first = membership_attack.membership_attack(*members, *nonmembers, seed=7)
  again = membership_attack.membership_attack(*members, *nonmembers, seed=7)
  assert first['num_per_kind'] == 41
  assert first == again
  other = membership_attack.membership_attack(*members, *nonmembers, seed=8)
  assert other['fold_accuracies'] != first['fold_accuracies']


@pytest.mark.parametrize('change, name', [
    (dict(logits_members=np.zeros((5,))), 'logits_members'),
    (dict(logits_nonmembers=np.zeros((5, 3))), 'logits_members and logits_nonmembers'),
    (dict(labels_members=np.full(5, 10)), 'labels_members'),
    (dict(labels_nonmembers=np.zeros(4, np.int64)), 'labels_nonmembers'),
    (dict(labels_nonmembers=np.zeros(5, np.float32)), 'labels_nonmembers'),
    (dict(logits_members=np.full((5, 10), np.nan)), 'logits_members'),
    (dict(logits_members=np.zeros((1, 10)), labels_members=np.zeros(1, np.int64)), 'logits_members'),
    (dict(seed=-1), 'seed'),
    (dict(features='probs'), 'features'),
])
def test_invalid_arguments_raise(change, name):
  args = dict(logits_members=np.zeros((5, 10)), labels_members=np.zeros(5, np.int64),
              logits_nonmembers=np.zeros((5, 10)), labels_nonmembers=np.zeros(5, np.int64))
  args.update(change)
  with pytest.raises(ValueError, match=name):
    membership_attack.membership_attack(**args)


def test_script_runs_end_to_end(tmp_path):
  out = tmp_path / 'mia'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run(
      ['bash', os.path.join(_ROOT, 'scripts', 'membership_inference.sh'), '--seeds=0', '--rounds=2',
       '--model=logistic', '--num_clients=3', f'--output_dir={out}'],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads((out / 'results.json').read_text())
  assert [r['aggregator'] for r in results] == ['mean', 'gma']
  split = digits.load_split()
  train = loaders.load_federated_data('digits', 'label_skew', 3, 0).train
  for r in results:  # Members: every example some client holds (3 clients x 2 classes hold only part of them).
    assert r['num_members'] == sum(train.num_examples(c) for c in train.client_ids)
    assert r['num_nonmembers'] == len(split.y_test)
    for features in ('logits', 'all'):
      assert r[features]['num_per_kind'] == len(split.y_test) and 0.0 <= r[features]['attack_accuracy'] <= 1.0
    assert r['test_accuracy'] > 0.3  # Two rounds of a logistic model on the digits already learn something.
  table = (out / 'results.md').read_text()
  assert '| mean | 1 |' in table and '| gma | 1 |' in table
  for run in ('label_skew-mean-seed0', 'label_skew-gma-seed0'):
    assert (out / run / 'summary.json').exists()
