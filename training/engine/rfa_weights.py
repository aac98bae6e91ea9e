"""RFA's effective weights, replayed by the simulation harness (RFA paper, Proposition 3).

RFA's privacy argument needs each Weiszfeld pass's normalized weights b_i / sum_j b_j bounded away from 1; the
deployed computation must not compute that max over clients, so the harness recomputes the round's client updates
(`build_client_updates`), replays the aggregation in float64 NumPy (`replay_rfa`) and reports the largest weight
(`rfa_weight_report`, `RfaWeightMonitor`). Detail: docs/experiments.md#rfas-effective-weights-replayed"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks
from tff_gma.aggregators import geometric_median
from tff_gma.aggregators import weiszfeld
from training import config as config_lib
from training.engine import fedavg_family

METRIC_PREFIX = 'rfa_audit'
DEFAULT_WEIGHT_BOUND = geometric_median.DEFAULT_WEIGHT_BOUND
DEFAULT_MAX_WEIGHT_RATIO = geometric_median.DEFAULT_MAX_WEIGHT_RATIO


class DominatedAggregateWarning(UserWarning):
  """A single client's normalized weight in one of RFA's secure averages exceeded the configured bound."""


# ----------------------------------------------------------------------------------------------------------------
# Validation.


def check_bound(bound) -> float:
  """The dominance bound must lie in (0, 1]: it is compared with a normalized weight."""
  return checks.check_fraction(bound, 'bound', low_open=True)


@dataclasses.dataclass(frozen=True)
class RfaSettings:
  """The `GeometricMedianFactory` arguments the replay needs (same names, same defaults).

  Checks its values itself: `rfa_weight_report` builds it from its own arguments, which no `config.AggregatorParams`
  has checked; the cross-checks (`one_step` with `num_passes` and `init`, `secure` with `value_bound`) and
  `weight_bound`, `max_weight_ratio` are checked nowhere else in the harness.
  """
  num_passes: int = geometric_median.DEFAULT_NUM_PASSES
  smoothing: float = geometric_median.DEFAULT_SMOOTHING
  one_step: bool = False
  secure: bool = False
  value_bound: Optional[float] = None
  weight_bound: float = DEFAULT_WEIGHT_BOUND
  max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO
  init: Optional[str] = None  # 'mean' or 'zero'; None: 'zero' with one_step, else the factory's default.

  def __post_init__(self):
    checks.check_positive_int(self.num_passes, 'num_passes')
    if self.one_step and self.num_passes != 1:
      raise ValueError(f'num_passes must be 1 with one_step=True, got {self.num_passes!r}')
    if self.init is not None and self.init not in ('mean', 'zero') or self.one_step and self.init == 'mean':
      raise ValueError(f"init must be 'mean' or 'zero' ('zero' with one_step=True), got {self.init!r}")
    checks.check_positive_finite(self.smoothing, 'smoothing')
    if self.secure:
      if self.value_bound is None:
        raise ValueError('value_bound is required when secure=True, got None')
      checks.check_positive_finite(self.value_bound, 'value_bound')
    checks.check_positive_finite(self.weight_bound, 'weight_bound')
    if checks.check_positive_finite(self.max_weight_ratio, 'max_weight_ratio') <= 1:
      raise ValueError(f'max_weight_ratio must be greater than 1, got {self.max_weight_ratio!r}')


# ----------------------------------------------------------------------------------------------------------------
# The replay (plain NumPy).


@dataclasses.dataclass(frozen=True)
class RfaReplay:
  """The smoothed Weiszfeld algorithm as the factory runs it, with every pass's weights.

  estimate: the flat result v_R (float64, the client updates' leaves concatenated).
  normalized_weights: [num_passes, num_clients], entry (k, i) = b_i / sum_j b_j in pass k + 1 (0 for dropped
    clients; all 0 in a pass whose total weight is 0).
  objectives: D(v_0), ..., D(v_{R-1}), as the factory's `objective` measurement.
  smoothings: the c of each reweighting pass, as the factory's `smoothing` measurement.
  kept: which clients took part (finite update, finite non-negative weight).
  """
  estimate: np.ndarray
  normalized_weights: np.ndarray
  objectives: np.ndarray
  smoothings: np.ndarray
  kept: np.ndarray


def flatten_update(update) -> np.ndarray:
  """All leaves of one client's update structure as one float64 vector."""
  leaves = [np.ravel(np.asarray(x, np.float64)) for x in tf.nest.flatten(update)]
  return np.concatenate(leaves) if leaves else np.zeros([0])


def _normalize(weights: np.ndarray) -> np.ndarray:
  total = weights.sum()
  return weights / total if total > 0 else np.zeros_like(weights)


def _objective(estimate: np.ndarray, points: np.ndarray, weights: np.ndarray) -> float:
  """D(v) = sum_i a_i ||v - w_i|| / sum_i a_i (0 for zero total weight, as the factory's mean)."""
  return float(_normalize(weights) @ np.linalg.norm(points - estimate, axis=1))


def _median_distance(distances: np.ndarray, weights: np.ndarray) -> float:
  """weiszfeld.median_distance: the smallest grid threshold holding half the weight at or below it."""
  grid = weiszfeld.DISTANCE_GRID.astype(np.float64)
  total = weights.sum()
  shares = np.array([weights[distances <= t].sum() for t in grid]) / total if total > 0 else np.zeros(len(grid))
  return float(grid[min(int(np.sum(shares < 0.5)), len(grid) - 1)])


def _vardi_zhang_pass(points, a, iterate, distances, smoothing):
  """(normalized pass weights, next estimate): weiszfeld.reweight and vardi_zhang_step."""
  near = distances <= smoothing
  b = np.where(near, 0.0, a * smoothing / np.maximum(smoothing, distances))
  normalized = _normalize(b)
  if b.sum() <= 0:
    return normalized, iterate
  far_mean = normalized @ points
  eta = a[near].sum()
  pull = b.sum() / smoothing * np.linalg.norm(far_mean - iterate)
  g = 0.0 if eta == 0 else (min(1.0, eta / pull) if pull > 0 else 1.0)
  return normalized, (1 - g) * far_mean + g * iterate


def replay_rfa(client_updates: Sequence[Any], client_weights: Sequence[float], settings: RfaSettings,
               scale: float = 0.0) -> RfaReplay:
  """`GeometricMedianFactory`'s aggregation of these updates, replayed in float64 NumPy.

  `scale` is the median norm the previous round measured (the factory's state; 0 in the first round). Its exact
  weights, dropping rule and smoothing: docs/experiments.md#rfas-effective-weights-replayed.
  """
  if len(client_updates) != len(client_weights):
    raise ValueError(f'client_updates and client_weights differ in length: {len(client_updates)} vs '
                     f'{len(client_weights)}')
  if not client_updates:
    raise ValueError('client_updates must hold at least one client')
  points = np.stack([flatten_update(u) for u in client_updates])
  a = np.asarray(client_weights, np.float64).reshape(-1)
  kept = np.all(np.isfinite(points), axis=1) & np.isfinite(a) & (a >= 0)
  points = np.where(kept[:, None], points, 0.0)
  a = np.where(kept, a, 0.0)
  if settings.secure:
    points = np.clip(points, -settings.value_bound, settings.value_bound)
    a = np.minimum(a, settings.weight_bound)
  nu, ratio, near = settings.smoothing, settings.max_weight_ratio, weiszfeld.DEFAULT_NEAR_FRACTION

  passes, objectives, smoothings = [], [], []
  estimate = np.zeros(points.shape[1])
  norms = np.linalg.norm(points, axis=1)  # Distances to v_0 = 0.
  objectives.append(_objective(estimate, points, a))
  zero_start = settings.init == 'zero' or settings.one_step or (
      settings.init is None and geometric_median.DEFAULT_INIT == 'zero')
  if zero_start:
    smoothing = nu
    if settings.secure:  # weiszfeld.one_step_secure_smoothing
      smoothing = max(nu, settings.value_bound * np.sqrt(points.shape[1]) / ratio)
    smoothings.append(max(smoothing, near * scale))
    weights, estimate = _vardi_zhang_pass(points, a, estimate, norms, smoothings[-1])
    passes.append(weights)
  else:
    passes.append(_normalize(a))
    estimate = passes[-1] @ points
  scale = _median_distance(norms, a)
  for _ in range(settings.num_passes - 1):
    previous_objective = objectives[-1]  # D(v_{k-2}) for pass k.
    distances = np.linalg.norm(points - estimate, axis=1)
    objectives.append(_objective(estimate, points, a))
    smoothing = max(nu, previous_objective / ratio) if settings.secure else nu  # weiszfeld.secure_smoothing
    smoothings.append(max(smoothing, near * scale))  # weiszfeld.near_smoothing
    weights, estimate = _vardi_zhang_pass(points, a, estimate, distances, smoothings[-1])
    passes.append(weights)
    scale = _median_distance(distances, a)
  return RfaReplay(estimate, np.stack(passes), np.asarray(objectives), np.asarray(smoothings), kept)


def rfa_weight_report(
    client_updates: Sequence[Any],
    client_weights: Sequence[float],
    num_passes: int,
    smoothing: float,
    bound: float,
    *,
    one_step: bool = False,
    secure: bool = False,
    value_bound: Optional[float] = None,
    weight_bound: float = DEFAULT_WEIGHT_BOUND,
    max_weight_ratio: float = DEFAULT_MAX_WEIGHT_RATIO,
    init: Optional[str] = None,
    client_ids: Optional[Sequence[str]] = None,
    warn: bool = True,
) -> dict[str, Any]:
  """The largest normalized weight b_i / sum_j b_j of each RFA pass over these client updates.

  Args:
    client_updates: one update structure per client (e.g. a list of arrays).
    client_weights: a_i per client (example counts in FedAvg).
    num_passes, smoothing, one_step, secure, value_bound, weight_bound, max_weight_ratio, init: as
      `GeometricMedianFactory`.
    bound: in (0, 1]; a pass in which one client's normalized weight exceeds it is reported as dominated.
    client_ids: names for the clients (default: their indices), used in the report and the warning.
    warn: emit a `DominatedAggregateWarning` when dominated.

  Returns:
    dict(max_normalized_weight (over all passes), per_pass (list, one max per pass), dominant_client (the
    client with the overall max), per_pass_dominant_client, dominated (bool), bound, num_clients (clients
    with a positive weight), uniform_weight (1 / num_clients: the smallest possible max), replay (`RfaReplay`)).

  Raises:
    ValueError: for invalid arguments (naming them).
  """
  bound = check_bound(bound)
  settings = RfaSettings(num_passes, smoothing, one_step, secure, value_bound, weight_bound, max_weight_ratio, init)
  if client_ids is not None and len(client_ids) != len(client_updates):
    raise ValueError(f'client_ids must name every client: {len(client_ids)} ids for {len(client_updates)} updates')
  names = [str(c) for c in client_ids] if client_ids is not None else [str(i) for i in range(len(client_updates))]
  replay = replay_rfa(client_updates, client_weights, settings)
  per_pass_index = np.argmax(replay.normalized_weights, axis=1)
  per_pass = replay.normalized_weights[np.arange(len(per_pass_index)), per_pass_index]
  worst_pass = int(np.argmax(per_pass))
  max_weight = float(per_pass[worst_pass])
  participating = int(np.sum(replay.kept & (np.asarray(client_weights, np.float64).reshape(-1) > 0)))
  report = dict(
      max_normalized_weight=max_weight,
      per_pass=[float(w) for w in per_pass],
      dominant_client=names[per_pass_index[worst_pass]],
      per_pass_dominant_client=[names[i] for i in per_pass_index],
      dominated=max_weight > bound,
      bound=bound,
      num_clients=participating,
      uniform_weight=1.0 / participating if participating else float('nan'),
      replay=replay,
  )
  if report['dominated'] and warn:
    warnings.warn(
        f'RFA pass {worst_pass + 1} of {len(per_pass)}: client {report["dominant_client"]} has normalized weight '
        f'{max_weight:.3f} > bound {bound} (uniform weight 1/{participating}); that secure average is dominated '
        f'by a single client', DominatedAggregateWarning, stacklevel=2)
  return report


def report_metrics(report: dict[str, Any]) -> dict[str, float]:
  """The report as flat metrics for metrics.csv: `rfa_audit/max_normalized_weight`, per pass, `dominated`."""
  out = {f'{METRIC_PREFIX}/max_normalized_weight': report['max_normalized_weight'],
         f'{METRIC_PREFIX}/dominated': float(report['dominated'])}
  for k, value in enumerate(report['per_pass'], 1):
    out[f'{METRIC_PREFIX}/pass_{k}/max_normalized_weight'] = value
  return out


# ----------------------------------------------------------------------------------------------------------------
# The round's client updates, in simulation.


@dataclasses.dataclass(frozen=True)
class ClientUpdates:
  """Runs the learning process's client work on a round's datasets from given global model weights.

  `computation(model_weights@SERVER, datasets@CLIENTS) -> ClientResult@CLIENTS` broadcasts the weights and runs
  the client work; `__call__` returns (updates: one list of arrays per client, weights: float64 array).
  """
  computation: tff.Computation

  def __call__(self, model_weights: tff.learning.models.ModelWeights,
               datasets: Sequence[tf.data.Dataset]) -> tuple[list[list[np.ndarray]], np.ndarray]:
    results = self.computation(model_weights, list(datasets))
    updates = [[np.asarray(x) for x in tf.nest.flatten(r.update)] for r in results]
    weights = np.asarray([float(r.update_weight) for r in results], np.float64)
    return updates, weights


def build_client_updates(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm: config_lib.AlgorithmConfig,
) -> ClientUpdates:
  """The client work of `fedavg_family.build_learning_process(model_fn, algorithm, ...)`, runnable on its own.

  `fedavg_family.build_client_work` is the one client work the learning process runs; FedAdam/FedYogi differ only at
  the server. Each call starts from the client work's initial state, as every round does.
  """
  if not isinstance(algorithm, config_lib.AlgorithmConfig):
    raise ValueError(f'algorithm must be a config_lib.AlgorithmConfig, got {algorithm!r}')
  return ClientUpdates(fedavg_family.build_client_results(fedavg_family.build_client_work(model_fn, algorithm)))


class RfaWeightMonitor:
  """Per-round RFA weight report for a simulated training loop.

  Call `monitor(model_weights, datasets, client_ids)` with the global model weights the round starts from
  (`process.get_model_weights(state)` *before* `process.next`) and the round's datasets; it returns
  `rfa_weight_report`'s dict (and warns when a pass is dominated). `report_metrics` flattens it for logging.
  """

  def __init__(self, model_fn: Callable[[], tff.learning.models.VariableModel],
               algorithm: config_lib.AlgorithmConfig, bound: float, settings: RfaSettings = RfaSettings()):
    self._bound = check_bound(bound)
    if not isinstance(settings, RfaSettings):
      raise ValueError(f'settings must be an RfaSettings, got {settings!r}')
    self._settings = settings
    self._client_updates = build_client_updates(model_fn, algorithm)

  @property
  def settings(self) -> RfaSettings:
    return self._settings

  def __call__(self, model_weights: tff.learning.models.ModelWeights, datasets: Sequence[tf.data.Dataset],
               client_ids: Optional[Sequence[str]] = None) -> dict[str, Any]:
    updates, weights = self._client_updates(model_weights, datasets)
    return rfa_weight_report(updates, weights, bound=self._bound, client_ids=client_ids,
                             **dataclasses.asdict(self._settings))
