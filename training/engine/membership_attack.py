"""Membership inference against a trained model's outputs (GMA paper, App. F; Tople et al. 2020).

A logistic-regression attacker, trained on balanced member / non-member examples (2-fold), guesses membership from
the model's outputs; 50% is chance. Also the "gap attack" (member iff classified correctly). Protocol, features,
reading the numbers: docs/experiments.md#the-membership-inference-attacker"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

FEATURES = ('logits', 'sorted_probs', 'loss', 'all')
DEFAULT_FEATURES = 'all'
_MAX_ITER = 5000  # The attacker's L-BFGS iterations (the paper trains it for 5000 steps).


def log_softmax(logits: np.ndarray) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def attack_features(logits: np.ndarray, labels: np.ndarray, features: str = DEFAULT_FEATURES) -> np.ndarray:
  """The attacker's input for each example: [N, F] float64 (docs/experiments.md#the-membership-inference-attacker)."""
  if features not in FEATURES:
    raise ValueError(f'features must be one of {FEATURES}, got {features!r}')
  logits = np.asarray(logits, np.float64)
  log_probs = log_softmax(logits)
  parts = []
  if features in ('logits', 'all'):
    parts.append(logits)
  if features in ('sorted_probs', 'all'):
    parts.append(-np.sort(-np.exp(log_probs), axis=1))
  if features in ('loss', 'all'):
    parts.append(-np.take_along_axis(log_probs, np.asarray(labels, np.int64)[:, None], axis=1))
  return np.concatenate(parts, axis=1)


def _check_examples(logits, labels, name: str) -> tuple[np.ndarray, np.ndarray]:
  logits = np.asarray(logits)
  labels = np.asarray(labels)
  if logits.ndim != 2 or logits.shape[1] < 2:
    raise ValueError(f'logits_{name} must have shape [examples, classes >= 2], got {logits.shape}')
  if not np.all(np.isfinite(logits)):
    raise ValueError(f'logits_{name} must be finite')
  if labels.shape != (logits.shape[0],) or labels.dtype.kind not in 'iu':
    raise ValueError(f'labels_{name} must be integer labels of shape [{logits.shape[0]}], got {labels.dtype} '
                     f'{labels.shape}')
  if labels.size and (labels.min() < 0 or labels.max() >= logits.shape[1]):
    raise ValueError(f'labels_{name} must lie in [0, {logits.shape[1]}), got [{labels.min()}, {labels.max()}]')
  if logits.shape[0] < 2:
    raise ValueError(f'logits_{name} must hold at least 2 examples (one per half), got {logits.shape[0]}')
  return logits, labels


def _fit_and_score(x_train, y_train, x_test, y_test, seed: int) -> tuple[float, float, float]:
  """(test accuracy, test ROC AUC, train accuracy) of a standardized logistic regression."""
  from sklearn import linear_model  # pylint: disable=g-import-not-at-top
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  from sklearn import pipeline  # pylint: disable=g-import-not-at-top
  from sklearn import preprocessing  # pylint: disable=g-import-not-at-top
  attacker = pipeline.make_pipeline(
      preprocessing.StandardScaler(),
      linear_model.LogisticRegression(max_iter=_MAX_ITER, random_state=seed))
  attacker.fit(x_train, y_train)
  scores = attacker.decision_function(x_test)
  return (float(attacker.score(x_test, y_test)), float(metrics.roc_auc_score(y_test, scores)),
          float(attacker.score(x_train, y_train)))


def membership_attack(
    logits_members: np.ndarray,
    labels_members: np.ndarray,
    logits_nonmembers: np.ndarray,
    labels_nonmembers: np.ndarray,
    seed: int = 0,
    features: str = DEFAULT_FEATURES,
) -> dict[str, Any]:
  """Logistic-regression membership inference on a model's logits (balanced, 2-fold; docs/experiments.md).

  Args:
    logits_members, labels_members: the model's logits [N, C] and true labels [N] on training examples.
    logits_nonmembers, labels_nonmembers: the same on held-out examples [M, C], [M].
    seed: draws the balanced sample and the halves.
    features: one of `FEATURES`.

  Returns:
    dict(attack_accuracy (mean test accuracy of the two folds), fold_accuracies, attack_auc (mean test ROC AUC),
    attack_train_accuracy, attack_advantage (2 * accuracy - 1), standard_error (binomial, of attack_accuracy),
    gap_attack_accuracy, target_member_accuracy, target_nonmember_accuracy (the model's accuracy on the drawn
    members and non-members), num_per_kind (n), features).

  Raises:
    ValueError: for malformed inputs or an unknown `features`, naming the argument.
  """
  logits_members, labels_members = _check_examples(logits_members, labels_members, 'members')
  logits_nonmembers, labels_nonmembers = _check_examples(logits_nonmembers, labels_nonmembers, 'nonmembers')
  if logits_members.shape[1] != logits_nonmembers.shape[1]:
    raise ValueError(f'logits_members and logits_nonmembers must have the same number of classes, got '
                     f'{logits_members.shape[1]} and {logits_nonmembers.shape[1]}')
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
    raise ValueError(f'seed must be a non-negative integer, got {seed!r}')
  if features not in FEATURES:
    raise ValueError(f'features must be one of {FEATURES}, got {features!r}')

  rng = np.random.default_rng(seed)
  n = min(len(labels_members), len(labels_nonmembers))
  members = rng.choice(len(labels_members), size=n, replace=False)
  nonmembers = rng.choice(len(labels_nonmembers), size=n, replace=False)
  x = np.concatenate([attack_features(logits_members[members], labels_members[members], features),
                      attack_features(logits_nonmembers[nonmembers], labels_nonmembers[nonmembers], features)])
  is_member = np.concatenate([np.ones(n, np.int64), np.zeros(n, np.int64)])
  # Halves drawn within each kind, so that both folds stay balanced (up to one example when n is odd).
  half = np.zeros(2 * n, bool)
  half[rng.permutation(n)[:n // 2]] = True
  half[n + rng.permutation(n)[:n // 2]] = True

  accuracies, aucs, train_accuracies = [], [], []
  for train in (half, ~half):
    accuracy, auc, train_accuracy = _fit_and_score(x[train], is_member[train], x[~train], is_member[~train], seed)
    accuracies.append(accuracy)
    aucs.append(auc)
    train_accuracies.append(train_accuracy)

  correct_members = np.argmax(logits_members[members], axis=1) == labels_members[members]
  correct_nonmembers = np.argmax(logits_nonmembers[nonmembers], axis=1) == labels_nonmembers[nonmembers]
  attack_accuracy = float(np.mean(accuracies))
  return dict(
      attack_accuracy=attack_accuracy,
      fold_accuracies=accuracies,
      attack_auc=float(np.mean(aucs)),
      attack_train_accuracy=float(np.mean(train_accuracies)),
      attack_advantage=2 * attack_accuracy - 1,
      standard_error=float(np.sqrt(attack_accuracy * (1 - attack_accuracy) / (2 * n))),
      gap_attack_accuracy=float((correct_members.sum() + (~correct_nonmembers).sum()) / (2 * n)),
      target_member_accuracy=float(correct_members.mean()),
      target_nonmember_accuracy=float(correct_nonmembers.mean()),
      num_per_kind=n,
      features=features,
  )
