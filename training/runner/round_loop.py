"""The one round loop: the runner, the demo and the benchmark all train through `RoundLoop`.

A round: its clients and datasets (a function of (seed, round) only, so a resumed run repeats them), the method's
round, its metrics as one row, then the caller's callbacks in order; the drivers differ only in the callbacks they
pass. Detail: docs/experiments.md#the-round-loop-and-the-steps-around-each-round"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from training.engine import client_pipeline
from training.engine import methods as methods_lib


def _round_seed(seed: int, round_num: int, index: int = 0) -> int:
  return int(np.random.SeedSequence([seed, round_num, index]).generate_state(1)[0] & 0x7FFFFFFF)


def sample_clients(client_ids: Sequence[str], num: int, seed: int, round_num: int) -> list[str]:
  """`num` distinct clients for the round; a function of (seed, round) only, so resumed runs repeat it."""
  if not 1 <= num <= len(client_ids):
    raise ValueError(f'clients_per_round must lie in [1, {len(client_ids)}], got {num}')
  if num == len(client_ids):
    return list(client_ids)
  rng = np.random.default_rng(_round_seed(seed, round_num))
  return [client_ids[i] for i in sorted(rng.choice(len(client_ids), size=num, replace=False))]


def client_seed(seed: int, round_num: int, index: int) -> int:
  """The shuffle seed of the client at `index` (in the client data's order) in round `round_num`."""
  return _round_seed(seed, round_num, index + 1)


def shuffle_seeds(op_seed: int) -> tuple[int, int]:
  """The (seed, seed2) pair `Dataset.shuffle(seed=op_seed)` takes in this process: TF's global seed (set by
  `seeded_initial_state`) with the op seed."""
  return tf.compat.v1.random.get_seed(op_seed)


def client_dataset(
    client_data: tff.simulation.datasets.ClientData, client_id: str, *, local_epochs: int, batch_size: int,
    seed: int, round_num: int,
) -> tf.data.Dataset:
  """The client's data for one round: shuffled (seeded by seed, round and client), repeated, batched."""
  index = client_data.client_ids.index(client_id)
  return client_pipeline.round_pipeline(client_data.create_tf_dataset_for_client(client_id),
                        *shuffle_seeds(client_seed(seed, round_num, index)), local_epochs=local_epochs,
                        batch_size=batch_size)


class RoundDatasets(Sequence):
  """The round's client datasets, each built the first time it is read: a method whose clients build their
  datasets in the worker (`Method.place_datasets_in_worker`) never reads them, and building ten `tf.data`
  pipelines in Python cost a small round about a twentieth of its time. TFF takes a round's client values as a
  `list`: pass `list(datasets)`."""

  def __init__(self, build: Callable[[str], tf.data.Dataset], client_ids: Sequence[str]):
    self._build = build
    self._client_ids = list(client_ids)
    self._built: dict[int, tf.data.Dataset] = {}

  def __len__(self) -> int:
    return len(self._client_ids)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    index = range(len(self))[index]  # Negative indices; IndexError past the end (which ends iteration).
    if index not in self._built:
      self._built[index] = self._build(self._client_ids[index])
    return self._built[index]


@dataclasses.dataclass(frozen=True)
class ClientInputs:
  """The round's participants and their datasets: `sample_clients`, then `client_dataset` for each (built when
  first read: `RoundDatasets`)."""
  train: tff.simulation.datasets.ClientData
  clients_per_round: int
  local_epochs: int
  batch_size: int
  seed: int

  def __call__(self, round_num: int) -> tuple[list[str], RoundDatasets]:
    participants = sample_clients(self.train.client_ids, self.clients_per_round, self.seed, round_num)
    return participants, RoundDatasets(
        lambda c: client_dataset(self.train, c, local_epochs=self.local_epochs, batch_size=self.batch_size,
                                 seed=self.seed, round_num=round_num),
        participants)

  def seeds(self, client_ids: Sequence[str], round_num: int) -> list[tuple[int, int]]:
    """The shuffle seed pairs of `client_ids`' datasets in round `round_num` (as `__call__` builds them)."""
    ids = self.train.client_ids
    return [shuffle_seeds(client_seed(self.seed, round_num, ids.index(c))) for c in client_ids]

  def pipeline(self, examples: tf.data.Dataset, seed, seed2) -> tf.data.Dataset:
    """`client_pipeline.round_pipeline` with this run's epochs and batch size (the seeds may be tensors)."""
    return client_pipeline.round_pipeline(examples, seed, seed2, local_epochs=self.local_epochs,
                                          batch_size=self.batch_size)


def flatten_metrics(metrics, prefix: str = '') -> dict[str, float]:
  """Nested metrics/measurements -> {'a/b/c': float} for logging; non-scalars are skipped."""
  out = {}
  if isinstance(metrics, dict) or hasattr(metrics, 'items'):
    for k, v in metrics.items():
      out.update(flatten_metrics(v, f'{prefix}{k}/'))
    return out
  try:
    value = np.asarray(metrics)
  except Exception:  # pylint: disable=broad-except
    return out
  if value.ndim == 0 and value.dtype.kind in 'biuf':
    out[prefix.rstrip('/')] = float(value)
  return out


def seeded_initial_state(process: tff.learning.templates.LearningProcess,
                         build_keras: Callable[[], tf.keras.Model], seed: int):
  """`process.initialize()` with the model weights replaced by a Keras initialisation seeded by `seed`.

  TFF's `initialize` draws the initial weights inside the worker, unseeded; replacing them makes runs with the
  same seed start from the same model (and every aggregator in a comparison from the same model).
  """
  state = process.initialize()
  tf.keras.utils.set_random_seed(seed)  # Seeds Keras' initializers (and Python's and NumPy's global RNGs).
  keras_model = build_keras()
  weights = tff.learning.models.ModelWeights(
      trainable=[v.numpy() for v in keras_model.trainable_weights],
      non_trainable=[v.numpy() for v in keras_model.non_trainable_weights])
  return process.set_model_weights(state, weights)


@dataclasses.dataclass
class Round:
  """A finished round, as the callbacks see it (`row` is theirs to extend, in callback order)."""
  number: int
  participants: list[str]
  datasets: list[tf.data.Dataset]
  state: Any  # The state after the round.
  row: dict[str, float]
  seconds: float = 0.0  # Wall time of the method's round (client training and aggregation).


# Called before the method's round with (round_num, state, participants, datasets); returns extra row entries.
BeforeRound = Callable[[int, Any, list, list], dict[str, float]]
AfterRound = Callable[[Round], None]
# The method's round, (state, participants, datasets, round_num) -> (state, metrics): `Method.run_round`, or a
# caller's wrapper of it (the runner's worker deadline).
RunRound = Callable[[Any, list, list, int], tuple[Any, Any]]


class RoundLoop:
  """A method's rounds from `state`: `step()` runs the next one, `run(last_round)` up to `last_round`."""

  def __init__(self, method: methods_lib.Method, state: Any,
               inputs: Callable[[int], tuple[list[str], list[tf.data.Dataset]]], *, round_num: int = 0,
               before_round: Optional[BeforeRound] = None, after_round: Sequence[AfterRound] = (),
               run_round: Optional[RunRound] = None):
    self.method = method
    self._run_round = run_round or method.run_round
    self.state = state
    self.inputs = inputs
    self.round_num = round_num  # The last finished round.
    self._before_round = before_round
    self._after_round = tuple(after_round)

  def step(self) -> Round:
    round_num = self.round_num + 1
    participants, datasets = self.inputs(round_num)
    extra = self._before_round(round_num, self.state, participants, datasets) if self._before_round else {}
    began = time.monotonic()
    self.state, metrics = self._run_round(self.state, participants, datasets, round_num)
    seconds = time.monotonic() - began
    self.round_num = round_num
    row = flatten_metrics(metrics)
    row.update(extra)
    done = Round(round_num, participants, datasets, self.state, row, seconds)
    for callback in self._after_round:
      callback(done)
    return done

  def run(self, last_round: int) -> Any:
    """Runs the rounds after `round_num` up to `last_round`; returns the state."""
    while self.round_num < last_round:
      self.step()
    return self.state


def evaluation_due(round_num: int, every: int, last_round: int, last_rounds: int = 0) -> bool:
  """Whether round `round_num` is evaluated: every `every`-th round, each of the last `last_rounds` and the last."""
  return round_num % every == 0 or round_num > last_round - last_rounds or round_num == last_round


def evaluate_every(every: int, last_round: int, evaluate: Callable[[Round], dict[str, float]], *,
                   last_rounds: int = 0) -> AfterRound:
  """A callback adding `evaluate(round)` to the row of the rounds `evaluation_due` names."""

  def callback(done: Round) -> None:
    if evaluation_due(done.number, every, last_round, last_rounds):
      done.row.update(evaluate(done))

  return callback
