"""Evaluation of the global model (and of personalized models) on held-out data, outside TFF.

* `CentralEvaluator`: a `ModelWeights` on arrays, with a local Keras copy of the model (no TFF round-trip).
* `hold_out`: each client's held-out examples, for personalized evaluation.
* `evaluate_personalized`: w + v_k and w alone on each client's held-out examples.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.data import client_data as client_data_lib

_HOLD_OUT_STREAM = 0x5046_5241


@dataclasses.dataclass
class CentralEvaluator:
  """Evaluates a `ModelWeights` on held-out arrays with a local Keras copy of the model (no TFF round-trip).

  With `pad_id` (sequence targets), positions whose target is `pad_id` count in neither loss nor accuracy.
  """
  build_keras: Callable[[], tf.keras.Model]
  x: np.ndarray
  y: np.ndarray
  batch_size: int = 512
  pad_id: Optional[int] = None
  _model: Optional[tf.keras.Model] = dataclasses.field(default=None, init=False, repr=False, compare=False)
  _model_classes: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)
  _predict: Optional[Callable[[np.ndarray], tf.Tensor]] = dataclasses.field(
      default=None, init=False, repr=False, compare=False)

  def __call__(self, model_weights: tff.learning.models.ModelWeights) -> dict[str, float]:
    return self.evaluate_arrays(model_weights, self.x, self.y)

  def evaluate_arrays(self, model_weights: tff.learning.models.ModelWeights, x: np.ndarray,
                      y: np.ndarray) -> dict[str, float]:
    logits = self.logits(model_weights, x).astype(np.float64)
    # A diverged model (e.g. plain averaging under the omniscient attack) has non-finite logits: its loss is
    # reported as NaN and its accuracy is what argmax picks (index 0 for a NaN row), without numpy warnings.
    with np.errstate(invalid='ignore', over='ignore'):
      shifted = logits - logits.max(axis=-1, keepdims=True)
      log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, np.asarray(y)[..., None].astype(np.int64), axis=-1)[..., 0]
    correct = np.argmax(logits, axis=-1) == y
    mask = np.ones_like(correct) if self.pad_id is None else (np.asarray(y) != self.pad_id)
    count = max(int(mask.sum()), 1)
    return {'accuracy': float((correct * mask).sum() / count), 'loss': float((nll * mask).sum() / count)}

  def logits(self, model_weights: tff.learning.models.ModelWeights, x: np.ndarray) -> np.ndarray:
    model = self._keras_model(x)
    model_weights.assign_weights_to(model)
    # One compiled forward pass (traced once per model, then for any batch length): the same logits as calling the
    # model eagerly, and faster on a test split of thousands of images.
    return np.concatenate([
        self._predict(x[i:i + self.batch_size]).numpy()
        for i in range(0, len(x), self.batch_size)
    ])

  def _keras_model(self, x: np.ndarray) -> tf.keras.Model:
    # One Keras copy, reused while it is valid: building one per call can cost more than a small round's training,
    # and the GMA study settings evaluate three times a round. It is valid until a
    # Keras model is made inside a graph (TFF traces its models in graphs): Keras then swaps the layer classes to
    # their TF1 bases, and every model made before fails ("Your Layer or Model is in an invalid state"). The
    # classes' MROs as of the build tell; a fresh build made eagerly swaps them back.
    if self._model is None or self._classes_of(self._model) != self._model_classes:
      self._model = self.build_keras()
      self._model(x[:1], training=False)
      self._model_classes = self._classes_of(self._model)
      model = self._model
      self._predict = tf.function(lambda batch: model(batch, training=False), reduce_retracing=True)
    return self._model

  @staticmethod
  def _classes_of(model: tf.keras.Model) -> tuple[tuple[type, ...], ...]:
    return tuple(type(m).__mro__ for m in (model, *model.submodules) if isinstance(m, tf.keras.layers.Layer))


def hold_out(train: client_data_lib.ArrayClientData, fraction: float, seed: int
             ) -> tuple[client_data_lib.ArrayClientData, dict[str, tuple[np.ndarray, np.ndarray]]]:
  """Splits each client's examples: (training clients, {client id: held-out (x, y)}).

  floor(fraction * n) examples per client, drawn from the seed, are held out (none for a client of one example);
  every client keeps at least one training example.
  """
  fraction = checks.check_fraction(fraction, 'fraction', high_open=True)
  rng = np.random.default_rng(np.random.SeedSequence([seed, _HOLD_OUT_STREAM]))
  kept, held = collections.OrderedDict(), {}
  for cid in train.client_ids:
    x, y = train.client_arrays(cid)
    count = min(int(np.floor(fraction * len(y))), len(y) - 1)
    order = rng.permutation(len(y))
    test_idx, train_idx = np.sort(order[:count]), np.sort(order[count:])
    kept[cid] = (x[train_idx], y[train_idx])
    if count:
      held[cid] = (x[test_idx], y[test_idx])
  return client_data_lib.from_client_arrays(kept), held


def personalized_weights(model_weights: tff.learning.models.ModelWeights,
                         personal) -> tff.learning.models.ModelWeights:
  """w + v_k (non-trainable weights shared)."""
  trainable = [np.asarray(w) + v for w, v in zip(model_weights.trainable, personal)]
  return tff.learning.models.ModelWeights(trainable=trainable, non_trainable=list(model_weights.non_trainable))


def evaluate_personalized(evaluator: CentralEvaluator, model_weights: tff.learning.models.ModelWeights,
                          personal: Callable[[str], tuple[np.ndarray, ...]],
                          held_out: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
  """On every client's held-out examples: `personalized/*` (w + v_k) and `personalized/shared_*` (w alone).

  `personal(client_id)` gives v_k. Example-weighted over clients; empty without held-out examples.
  """
  if not held_out:
    return {}
  totals = collections.defaultdict(float)
  count = 0
  for cid, (x, y) in sorted(held_out.items()):
    mine = evaluator.evaluate_arrays(personalized_weights(model_weights, personal(cid)), x, y)
    shared = evaluator.evaluate_arrays(model_weights, x, y)
    for name, value in mine.items():
      totals[f'personalized/{name}'] += value * len(y)
    for name, value in shared.items():
      totals[f'personalized/shared_{name}'] += value * len(y)
    count += len(y)
  return {k: v / count for k, v in totals.items()}
