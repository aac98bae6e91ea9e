"""Corruption models of the RFA paper (Sec. 5.1) and the literature's attacks for simulation: data and update poisoning.

A fixed, seeded set of clients (`corrupted_clients`) is corrupted for the whole run (`CORRUPTIONS`): data poisoned
before training (`poison_data`), or updates replaced inside the client work (`build_corrupted_client_work`). The
omniscient attack and the literature's attacks (`training.engine.attacks`) are computed by the harness from the
round's honest updates (`CorruptedRounds`), a simulated attacker no real client could be, and sent through each
corrupted client's corruption element. Each corruption: docs/experiments.md#corruption-models"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import secure_mean
from tff_gma.data import client_data as client_data_lib
from training import config as config_lib
from training.engine import attacks
from training.engine import fedavg_family

NONE = 'none'
DATA_CORRUPTIONS = ('data_negate', 'data_flip_labels')
# The attacks the harness computes from the round's honest updates, each sent as the element's `attack` vector.
HARNESS_ATTACKS = ('omniscient',) + attacks.ATTACKS
UPDATE_CORRUPTIONS = ('gaussian',) + HARNESS_ATTACKS
CORRUPTIONS = (NONE,) + DATA_CORRUPTIONS + UPDATE_CORRUPTIONS

# The code in a client's corruption element.
HONEST = 0
GAUSSIAN = 1
ATTACK = 2  # Send the element's `attack` vector: every harness-computed attack.
OMNISCIENT = ATTACK
_CODES = {'gaussian': GAUSSIAN, **{name: ATTACK for name in HARNESS_ATTACKS}}

DATA = 'data'
CORRUPTION = 'corruption'
# Separate streams of the run's seed: the choice of corrupted clients and the Gaussian noise.
_SELECTION_STREAM = 0x5246_4101
_NOISE_STREAM = 0x5246_4102


# ----------------------------------------------------------------------------------------------------------------
# Which clients.


def check_corruption(corruption: str) -> None:
  """ValueError naming `corruption` unless it is one of `CORRUPTIONS`.

  The level `corrupt_fraction` is not checked here: `config.AggregatorParams` checks it where a run's settings are
  built, and `num_corrupted` where it is used.
  """
  if corruption not in CORRUPTIONS:
    raise ValueError(f'corruption must be one of {CORRUPTIONS}, got {corruption!r}')


def num_corrupted(num_clients: int, corrupt_fraction: float) -> int:
  """round(rho * num_clients), halves rounded up (Python's `round` would send 2.5 to 2).

  Checks `corrupt_fraction` in [0, 1) itself: callers such as the RFA spread study pass levels of their own, not
  from `config.AggregatorParams`.
  """
  rho = checks.check_fraction(corrupt_fraction, 'corrupt_fraction', high_open=True)
  return int(math.floor(rho * num_clients + 0.5))


def corrupted_clients(client_ids: Sequence[str], corrupt_fraction: float, seed: int) -> list[str]:
  """The run's corrupted clients: `num_corrupted` of `client_ids`, drawn from `seed` only, in client order."""
  count = num_corrupted(len(client_ids), corrupt_fraction)
  rng = np.random.default_rng(np.random.SeedSequence([seed, _SELECTION_STREAM]))
  chosen = set(rng.choice(len(client_ids), size=count, replace=False).tolist())
  return [c for i, c in enumerate(client_ids) if i in chosen]


# ----------------------------------------------------------------------------------------------------------------
# Data poisoning.


def negate_images(x: np.ndarray) -> np.ndarray:
  """The RFA paper's negative image for pixels in [0, 1]: x -> 1 - x."""
  x = np.asarray(x)
  if not np.issubdtype(x.dtype, np.floating) or x.size and (x.min() < 0 or x.max() > 1):
    raise ValueError('corruption: data_negate needs float images with values in [0, 1]')
  return (1 - x).astype(x.dtype)


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
  """y -> num_classes - 1 - y (class labels in [0, num_classes))."""
  y = np.asarray(y)
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f'corruption: data_flip_labels needs integer class labels of shape [N], got {y.dtype} '
                     f'{y.shape}')
  if y.size and (y.min() < 0 or y.max() >= num_classes):
    raise ValueError(f'corruption: labels must lie in [0, {num_classes}) to be flipped')
  return (num_classes - 1 - y).astype(y.dtype)


def poison_data(train: client_data_lib.ArrayClientData, corrupted: Sequence[str], corruption: str,
                num_classes: int) -> client_data_lib.ArrayClientData:
  """`train` with the data of the `corrupted` clients poisoned (`data_negate` or `data_flip_labels`).

  Other corruptions return `train` itself. Client ids, order and sizes are unchanged.
  """
  if corruption not in DATA_CORRUPTIONS:
    check_corruption(corruption)
    return train
  corrupted = set(corrupted)
  unknown = corrupted - set(train.client_ids)
  if unknown:
    raise ValueError(f'corrupted: unknown client ids {sorted(unknown)}')
  arrays = collections.OrderedDict()
  for cid in train.client_ids:
    x, y = train.client_arrays(cid)
    if cid in corrupted:
      x, y = (negate_images(x), y) if corruption == 'data_negate' else (x, flip_labels(y, num_classes))
    arrays[cid] = (x, y)
  return client_data_lib.from_client_arrays(arrays)


# ----------------------------------------------------------------------------------------------------------------
# Update poisoning: plain TF (client side) and NumPy (the simulated omniscient attacker).


def gaussian_noise_like(update, seed: tf.Tensor):
  """Noise of `update`'s structure: N(0, s^2) per component, s^2 the variance of all of `update`'s components.

  `seed` is a stateless seed (int64/int32 shape [2]); the same seed gives the same noise.
  """
  leaves = tf.nest.flatten(update)
  flat = tf.concat([tf.reshape(tf.cast(x, tf.float32), [-1]) for x in leaves], axis=0)
  std = tf.math.reduce_std(flat)  # Population variance of the components, as the paper's sigma^2.
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), num=len(leaves))
  noise = [tf.cast(std, x.dtype) * tf.random.stateless_normal(tf.shape(x), seed=seeds[i], dtype=x.dtype)
           for i, x in enumerate(leaves)]
  return tf.nest.pack_sequence_as(update, noise)


def corrupt_update(update, code: tf.Tensor, seed: tf.Tensor, attack):
  """The update a client sends: its own (`HONEST`), Gaussian noise (`GAUSSIAN`) or `attack` (`ATTACK`)."""
  noise = gaussian_noise_like(update, seed)
  return tf.nest.map_structure(
      lambda u, n, a: tf.where(tf.equal(code, GAUSSIAN), n, tf.where(tf.equal(code, ATTACK), a, u)),
      update, noise, attack)


@dataclasses.dataclass(frozen=True)
class OmniscientAttack:
  """The omniscient attacker's solution for one round (NumPy; float64 internally).

  Attributes:
    attack: the vector every corrupted participant sends, as a list of arrays of the update's shapes/dtypes.
    honest_mean: the weighted mean of the honest updates (float64 arrays), the mean the attack negates.
  """
  attack: list[np.ndarray]
  honest_mean: list[np.ndarray]


def omniscient_attack(updates: Sequence[Sequence[np.ndarray]], weights: Sequence[float],
                      corrupted: Sequence[bool]) -> Optional[OmniscientAttack]:
  """The z that corrupted clients send so that the weighted mean of the round is minus the honest mean.

  With weights a_i, honest updates u_i, A the total weight, A_C the corrupted clients' weight and
  m = sum_i a_i u_i / A (all selected clients, honestly): every corrupted client sends
  z = -(A m + sum_{i honest} a_i u_i) / A_C, so that (sum_{i honest} a_i u_i + A_C z) / A = -m.
  Returns None when the corrupted participants have no weight (nothing to attack with).
  """
  weights = np.asarray(weights, np.float64)
  corrupted = np.asarray(corrupted, bool)
  if len(updates) != len(weights) or len(weights) != len(corrupted):
    raise ValueError(f'updates, weights and corrupted must have one entry per client, got {len(updates)}, '
                     f'{len(weights)} and {len(corrupted)}')
  corrupt_weight = weights[corrupted].sum()
  if not corrupt_weight > 0:
    return None
  total = weights.sum()
  leaves = [[np.asarray(t, np.float64) for t in u] for u in updates]
  weighted_sum = [sum(w * u[j] for w, u in zip(weights, leaves)) for j in range(len(leaves[0]))]
  honest_sum = [sum(w * u[j] for w, u, c in zip(weights, leaves, corrupted) if not c)
                for j in range(len(leaves[0]))]
  honest_mean = [s / total for s in weighted_sum]
  attack = [-(total * m + h) / corrupt_weight for m, h in zip(honest_mean, honest_sum)]
  dtypes = [np.asarray(t).dtype for t in updates[0]]
  return OmniscientAttack([a.astype(d) for a, d in zip(attack, dtypes)], honest_mean)


# ----------------------------------------------------------------------------------------------------------------
# TFF: the client work and the learning process.


def _corruption_element_type(update_type) -> tff.StructWithPythonType:
  # The attack is a tuple of the update's tensors: tf.data would read a Python list as one tensor to stack.
  attack_type = tff.StructWithPythonType(list(tff.structure.flatten(update_type)), tuple)
  return tff.StructWithPythonType(
      [('code', tff.TensorType(np.int32)), ('seed', tff.TensorType(np.int64, [2])), ('attack', attack_type)],
      collections.OrderedDict)


def build_corrupted_client_work(
    inner: tff.learning.templates.ClientWorkProcess) -> tff.learning.templates.ClientWorkProcess:
  """`inner` whose clients may send a corrupted update instead of their own (docs/experiments.md#corruption-models).

  The client data become `OrderedDict(data=<inner's client data>, corruption=<dataset of at most one
  OrderedDict(code=int32, seed=int64[2], attack=<update>)>)`; an empty corruption dataset means honest. The state
  is `inner`'s; the measurements are `inner`'s plus `corrupted_clients` (a secure count).
  """
  state_type, weights_type, inner_data_type = inner.next.type_signature.parameter
  result_type = inner.next.type_signature.result.result.member
  update_type = result_type.update
  element_type = _corruption_element_type(update_type)
  data_type = tff.StructWithPythonType(
      [(DATA, inner_data_type.member), (CORRUPTION, tff.SequenceType(element_type))], collections.OrderedDict)
  inner_measurement_names = [name for name, _ in tff.structure.iter_elements(
      inner.next.type_signature.result.measurements.member)]

  @tff.tensorflow.computation(result_type, tff.SequenceType(element_type))
  def corrupt(result, corruption):
    honest = collections.OrderedDict(
        code=tf.constant(HONEST, tf.int32), seed=tf.zeros([2], tf.int64),
        attack=tuple(tf.zeros_like(u) for u in tf.nest.flatten(result.update)))
    element = corruption.reduce(honest, lambda _, e: e)
    attack = tf.nest.pack_sequence_as(result.update, list(element['attack']))
    update = corrupt_update(result.update, element['code'], element['seed'], attack)
    corrupted = tf.cast(tf.not_equal(element['code'], HONEST), tf.int32)
    return tff.learning.templates.ClientResult(update=update, update_weight=result.update_weight), corrupted

  @tff.federated_computation(state_type, weights_type, tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, client_data):
    output = inner.next(state, weights, client_data[DATA])
    result, corrupted = tff.federated_map(corrupt, (output.result, client_data[CORRUPTION]))
    measurements = collections.OrderedDict(
        [(name, output.measurements[name]) for name in inner_measurement_names])
    measurements['corrupted_clients'] = secure_mean.secure_count(corrupted)
    return tff.templates.MeasuredProcessOutput(output.state, result, tff.federated_zip(measurements))

  return tff.learning.templates.ClientWorkProcess(
      inner.initialize, next_fn, get_hparams_fn=inner.get_hparams, set_hparams_fn=inner.set_hparams)


class CorruptedLearningProcess(tff.learning.templates.LearningProcess):
  """A `LearningProcess` whose client work can corrupt updates, plus the omniscient attacker's view.

  Attributes:
    honest_client_results: `(model_weights, data) -> ClientResult at CLIENTS`: the round's honest client updates
      and weights for the plain client data `data` (no corruption element), without aggregation. SIMULATION ONLY:
      this is the attacker's knowledge, not part of any deployed computation.
    update_type: the TFF type of a model update.
  """

  def __init__(self, composed: tff.learning.templates.LearningProcess, honest_client_results: tff.Computation,
               update_type):
    super().__init__(composed.initialize, composed.next, composed.get_model_weights, composed.set_model_weights,
                     get_hparams_fn=composed.get_hparams, set_hparams_fn=composed.set_hparams)
    self.honest_client_results = honest_client_results
    self.update_type = update_type


def build_learning_process(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm_config: config_lib.AlgorithmConfig,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    *,
    mask_on_step: bool = False,
) -> CorruptedLearningProcess:
  """The round of `fedavg_family.build_learning_process` (FedAvg/FedProx/FedAdam/FedYogi) with corruptible clients.

  The same composition (`mask_on_step` included: GMA's Algorithm 2, see `fedavg_family.build_server_processes`) and
  the same client work (`fedavg_family.build_client_work`), wrapped by `build_corrupted_client_work`.
  """
  inner = fedavg_family.build_client_work(model_fn, algorithm_config, metrics_aggregator)
  composed = fedavg_family.build_learning_process(
      model_fn, algorithm_config, model_aggregator, client_work=build_corrupted_client_work(inner),
      mask_on_step=mask_on_step)
  update_type = composed.next.type_signature.parameter[0].member.global_model_weights.trainable
  return CorruptedLearningProcess(composed, fedavg_family.build_client_results(inner), update_type)


# ----------------------------------------------------------------------------------------------------------------
# Simulation harness.


def _client_seed(seed: int, round_num: int, index: int) -> np.ndarray:
  return np.random.SeedSequence([seed, round_num, index, _NOISE_STREAM]).generate_state(2).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class UpdateCorruption:
  """A run's update corruption: which clients send `kind` (`UPDATE_CORRUPTIONS`) instead of their update.

  `params`: the attacks' parameters (`config.AttackParams`), read where the attack is computed.
  """
  kind: str
  corrupted: tuple[str, ...]
  client_ids: tuple[str, ...]
  seed: int
  params: config_lib.AttackParams = dataclasses.field(default_factory=config_lib.AttackParams)


def harness_attack(kind: str, updates: Sequence[Sequence[np.ndarray]], corrupted: Sequence[bool],
                   params: config_lib.AttackParams) -> list[Optional[np.ndarray]]:
  """What each participant sends under the literature's attack `kind` (`attacks.ATTACKS`): a float64 vector [d]
  for each corrupted participant, None for the others.

  `updates`: every participant's honest update of the round (lists of leaves), the simulated attacker's knowledge
  (`training.engine.attacks` says which updates each attack reads). `sign_flip` sends each attacker's own update
  negated; every other attack sends one vector from all the participants' honest updates.
  """
  if kind not in attacks.ATTACKS:
    raise ValueError(f'corruption must be one of {attacks.ATTACKS} for harness_attack, got {kind!r}')
  corrupted = np.asarray(corrupted, bool)
  if len(updates) != len(corrupted):
    raise ValueError(f'updates and corrupted must have one entry per participant, got {len(updates)} and '
                     f'{len(corrupted)}')
  honest = attacks.flatten(updates)
  if kind == attacks.SIGN_FLIP:
    return [attacks.sign_flip(row) if c else None for row, c in zip(honest, corrupted)]
  if kind == attacks.ALIE:
    vector = attacks.alie(honest, int(corrupted.sum()), params.alie_z)
  elif kind == attacks.IPM:
    vector = attacks.ipm(honest, params.ipm_epsilon)
  elif kind == attacks.MIMIC:
    vector = attacks.mimic(honest, ~corrupted)
  elif kind == attacks.LARGE_NORM:
    vector = attacks.large_norm(honest, params.large_norm_scale)
  elif kind == attacks.ZERO_UPDATE:
    vector = attacks.zero_update(honest.shape[1])
  elif kind == attacks.MIN_MAX:
    vector = attacks.min_max(honest, params.minmax_perturbation, params.minmax_gamma_init)
  else:
    vector = attacks.min_sum(honest, params.minmax_perturbation, params.minmax_gamma_init)
  return [vector if c else None for c in corrupted]


class CorruptedRounds:
  """Runs rounds of a `CorruptedLearningProcess` with a fixed set of corrupted clients (`UPDATE_CORRUPTIONS`).

  `run_round(state, participants, datasets, round_num)` builds each participant's client data (its batches and
  its corruption element), for a harness-computed attack (`HARNESS_ATTACKS`) first computing the round's honest
  updates and the attack (`omniscient_attack`, `harness_attack`; the simulated attacker), and runs
  `process.next`. Everything is a function of (seed, round, client), so a resumed run repeats a round exactly.
  """

  def __init__(self, process: CorruptedLearningProcess, corruption: str, corrupted: Sequence[str],
               client_ids: Sequence[str], seed: int, params: Optional[config_lib.AttackParams] = None):
    if corruption not in UPDATE_CORRUPTIONS:
      raise ValueError(f'corruption must be one of {UPDATE_CORRUPTIONS} for CorruptedRounds, got {corruption!r}')
    if not isinstance(process, CorruptedLearningProcess):
      raise ValueError(f'process must be a CorruptedLearningProcess (corruption.build_learning_process), got '
                       f'{type(process).__name__}')
    self._process = process
    self._kind = corruption
    self._code = _CODES[corruption]
    self._params = params if params is not None else config_lib.AttackParams()
    self._corrupted = frozenset(corrupted)
    self._index = {c: i for i, c in enumerate(client_ids)}
    unknown = self._corrupted - set(self._index)
    if unknown:
      raise ValueError(f'corrupted: unknown client ids {sorted(unknown)}')
    self._seed = seed
    self._zeros = [np.zeros(t.shape, t.dtype) for t in tff.structure.flatten(process.update_type)]
    self.last_attack: Optional[OmniscientAttack] = None  # The latest omniscient round's attack (for inspection).
    # The latest round's attack vectors, one per participant (None: sends its own update), for inspection.
    self.last_vectors: Optional[list[Optional[list[np.ndarray]]]] = None

  @property
  def corrupted(self) -> frozenset[str]:
    return self._corrupted

  def _element(self, code: int, seed: np.ndarray, attack: Sequence[np.ndarray]) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensors(collections.OrderedDict(
        code=np.int32(code), seed=seed, attack=tuple(tf.constant(a) for a in attack)))

  def _attack_vectors(self, state, datasets: Sequence[tf.data.Dataset], is_corrupted: Sequence[bool]
                      ) -> Optional[list[Optional[list[np.ndarray]]]]:
    """Each participant's attack vector (leaves of the update's dtypes; None: honest); None: no attack."""
    if self._kind == attacks.ZERO_UPDATE:  # Needs no honest update.
      return [list(self._zeros) if c else None for c in is_corrupted]
    honest = self._process.honest_client_results(self._process.get_model_weights(state), list(datasets))
    updates = [list(r.update) for r in honest]
    if self._kind == 'omniscient':
      self.last_attack = omniscient_attack(updates, [float(r.update_weight) for r in honest], is_corrupted)
      if self.last_attack is None:
        return None
      return [self.last_attack.attack if c else None for c in is_corrupted]
    vectors = harness_attack(self._kind, updates, is_corrupted, self._params)
    return [None if v is None else attacks.unflatten(v, self._zeros) for v in vectors]

  def client_data(self, state, participants: Sequence[str], datasets: Sequence[tf.data.Dataset],
                  round_num: int) -> list[collections.OrderedDict]:
    """The process's client data for the round (computes the harness's attack where there is one)."""
    if len(participants) != len(datasets):
      raise ValueError(f'participants and datasets differ in length: {len(participants)} vs {len(datasets)}')
    is_corrupted = [c in self._corrupted for c in participants]
    self.last_attack = None
    self.last_vectors = None
    if self._code == ATTACK and any(is_corrupted):
      self.last_vectors = self._attack_vectors(state, datasets, is_corrupted)
    out = []
    for i, (cid, ds, corrupted) in enumerate(zip(participants, datasets, is_corrupted)):
      seed = _client_seed(self._seed, round_num, self._index[cid])
      if corrupted and self._code == GAUSSIAN:
        element = self._element(GAUSSIAN, seed, self._zeros)
      elif corrupted and self.last_vectors is not None and self.last_vectors[i] is not None:
        element = self._element(ATTACK, seed, self.last_vectors[i])
      else:
        element = self._element(HONEST, np.zeros([2], np.int64), self._zeros)
      out.append(collections.OrderedDict([(DATA, ds), (CORRUPTION, element)]))
    return out

  def run_round(self, state, participants: Sequence[str], datasets: Sequence[tf.data.Dataset], round_num: int):
    """One round of the process with this corruption; the `LearningProcessOutput`."""
    return self._process.next(state, self.client_data(state, participants, datasets, round_num))
