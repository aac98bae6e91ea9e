"""Measuring the cost of aggregators in TFF's runtime: interleaved timing, process memory and CPU, probes.

Built for ratios measured in one process: `interleaved_times` (rotating order, medians), `PeakMemory` and
`process_cpu_seconds` (memory and CPU of this process and the TFF worker, by psutil) and `aggregation_probe` (client
values generated in the worker). Why each: docs/research/benchmark.md
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import checks

_KIB = 1024
_UNREADABLE = (psutil.NoSuchProcess, psutil.AccessDenied)  # A process gone (a zombie too), or another user's.


# ----------------------------------------------------------------------------------------------------------------
# Timing.


@dataclasses.dataclass
class Sample:
  """One timed call: wall seconds, and CPU seconds of this process and of the watched worker processes."""
  wall: float
  python_cpu: float
  worker_cpu: float


def median(values: Sequence[float]) -> float:
  if not values:
    raise ValueError('median of no values')
  return float(statistics.median(values))


def interleaved_times(
    calls: Mapping[str, Callable[[], Any]],
    repetitions: int,
    *,
    worker_pids: Sequence[int] = (),
) -> dict[str, list[Sample]]:
  """Times each callable `repetitions` times, one of each per sweep, the order rotated every sweep.

  Warm-up (compilation) is the caller's business: call each callable once before, and time that separately.

  Args:
    calls: name -> no-argument callable (its result is discarded).
    repetitions: sweeps; each callable runs once per sweep.
    worker_pids: processes whose CPU time is charged to `Sample.worker_cpu` (the TFF worker(s)).

  Returns:
    name -> the samples, in sweep order.
  """
  repetitions = checks.check_positive_int(repetitions, 'repetitions')
  if not calls:
    raise ValueError('calls must name at least one callable')
  names = list(calls)
  samples: dict[str, list[Sample]] = {name: [] for name in names}
  for sweep in range(repetitions):
    shift = sweep % len(names)
    for name in names[shift:] + names[:shift]:
      samples[name].append(timed_call(calls[name], worker_pids)[1])
  return samples


def timed_call(fn: Callable[[], Any], worker_pids: Sequence[int] = ()) -> tuple[Any, Sample]:
  """Runs `fn` once; returns its result and the wall / Python CPU / worker CPU seconds it took."""
  worker_before = sum(process_cpu_seconds(pid) for pid in worker_pids)
  cpu_before = time.process_time()
  start = time.perf_counter()
  result = fn()
  wall = time.perf_counter() - start
  python_cpu = time.process_time() - cpu_before
  worker_cpu = sum(process_cpu_seconds(pid) for pid in worker_pids) - worker_before
  return result, Sample(wall=wall, python_cpu=python_cpu, worker_cpu=worker_cpu)


def summarize(samples: Sequence[Sample]) -> dict[str, float]:
  """Medians of a list of samples (wall, Python CPU, worker CPU, their sum) and the repetition count.

  On a machine shared with other work, CPU seconds are steadier than wall seconds: waiting for a core that
  another process holds adds wall time, not CPU time.
  """
  return collections.OrderedDict(
      seconds=median([s.wall for s in samples]),
      python_cpu_seconds=median([s.python_cpu for s in samples]),
      worker_cpu_seconds=median([s.worker_cpu for s in samples]),
      cpu_seconds=median([s.python_cpu + s.worker_cpu for s in samples]),
      repetitions=len(samples),
  )


def ratios_to(baseline: str, medians: Mapping[str, float]) -> dict[str, float]:
  """medians[name] / medians[baseline] for every name (the baseline's own ratio is 1)."""
  if baseline not in medians:
    raise ValueError(f'baseline {baseline!r} is not among {sorted(medians)}')
  if not medians[baseline] > 0:
    raise ValueError(f'baseline {baseline!r} has a non-positive median {medians[baseline]!r}')
  return collections.OrderedDict((name, value / medians[baseline]) for name, value in medians.items())


# ----------------------------------------------------------------------------------------------------------------
# Process readings: psutil, and Linux's /proc for the resident high-water mark, which psutil does not read.


def resident_bytes(pid: int) -> Optional[int]:
  """Current resident set size of `pid`; None if it cannot be read."""
  try:
    return psutil.Process(pid).memory_info().rss
  except _UNREADABLE:
    return None


def peak_resident_bytes(pid: int) -> Optional[int]:
  """High-water mark of the resident set (VmHWM) of `pid` since it started or since `reset_peak_resident`."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * _KIB
  except (FileNotFoundError, ProcessLookupError, PermissionError):
    return None
  return None


def reset_peak_resident(pid: int) -> bool:
  """Resets VmHWM of `pid` to its current RSS (Linux >= 4.0, own processes); False if not possible."""
  try:
    with open(f'/proc/{pid}/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def process_cpu_seconds(pid: int) -> float:
  """User + system CPU seconds `pid` has used (all its threads, not its children); 0 if it cannot be read."""
  try:
    times = psutil.Process(pid).cpu_times()
  except _UNREADABLE:
    return 0.0
  return times.user + times.system


class PeakMemory:
  """Peak resident memory of some processes over a `with` block.

  Two readings, because each alone can miss something: the kernel's high-water mark VmHWM (reset on entry
  where the kernel allows it, so it covers this block only; exact, but per process, so the peaks of two
  processes need not coincide), and the peak of the *sum* of the resident sets sampled every `interval` seconds by
  a background thread (what the machine had to hold at once; a peak shorter than the interval can be missed).
  """

  def __init__(self, pids: Mapping[str, int], interval: float = 0.02):
    if not pids:
      raise ValueError('pids must name at least one process')
    if not interval > 0:
      raise ValueError(f'interval must be positive, got {interval!r}')
    self._pids = dict(pids)
    self._interval = interval
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._peak_sum = 0
    self._hwm_reset: dict[str, bool] = {}
    self.result: Optional[dict[str, Any]] = None

  def _sample(self) -> None:
    while True:
      total = sum(resident_bytes(pid) or 0 for pid in self._pids.values())
      self._peak_sum = max(self._peak_sum, total)
      if self._stop.wait(self._interval):
        return

  def __enter__(self) -> 'PeakMemory':
    self._hwm_reset = {name: reset_peak_resident(pid) for name, pid in self._pids.items()}
    self._peak_sum = 0
    self._stop.clear()
    self._thread = threading.Thread(target=self._sample, name='PeakMemory', daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    hwm = {name: peak_resident_bytes(pid) for name, pid in self._pids.items()}
    self.result = collections.OrderedDict(
        peak_rss_bytes={name: value for name, value in hwm.items()},
        peak_rss_since_start={name: not reset for name, reset in self._hwm_reset.items()},
        sampled_peak_total_bytes=self._peak_sum,
        peak_total_bytes=max(self._peak_sum, sum(v or 0 for v in hwm.values())),
    )


# ----------------------------------------------------------------------------------------------------------------
# The aggregation probe: client values made in the worker, scalars back.


def random_client_value(value_type, seed: tf.Tensor, nonnegative: bool = False):
  """A standard-normal value of `value_type`'s structure, a function of (seed, leaf index) only (stateless)."""
  counter = iter(range(1 << 30))

  def leaf(spec: tff.TensorType) -> tf.Tensor:
    index = tf.constant(next(counter), tf.int32)
    value = tf.random.stateless_normal(spec.shape, seed=tf.stack([seed, index]), dtype=spec.dtype)
    return tf.abs(value) if nonnegative else value

  return tff.types.structure_from_tensor_type_tree(leaf, tff.to_type(value_type))


def client_weight(seed: tf.Tensor) -> tf.Tensor:
  """Client weights 1..5 (seed mod 5, plus 1): unequal, as examples per client are."""
  return tf.cast(tf.math.floormod(seed, 5) + 1, tf.float32)


def flat_norm(value) -> tf.Tensor:
  """Euclidean norm of all of a structure's tensors together."""
  return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tf.nest.flatten(value)]))


def aggregation_probe(
    factory: tff.aggregators.WeightedAggregationFactory,
    value_type,
    *,
    make_value: Optional[Callable[[tf.Tensor], Any]] = None,
) -> tff.Computation:
  """`seeds@CLIENTS -> (||aggregate||@SERVER, measurements@SERVER)`: one `next` of `factory`'s process.

  Each client generates its value (`make_value(seed)`, default `random_client_value(value_type, seed)`) and its
  weight (`client_weight(seed)`) in the worker; the process is initialized and run once inside the same
  computation. Only scalars return, so a call times the aggregation (plus the generation, which is the same for
  every factory of the same `value_type`), not gRPC transfers of client values. The number of seeds passed is
  the number of clients.
  """
  value_type = tff.to_type(value_type)
  weight_type = tff.TensorType(np.float32)
  process = factory.create(value_type, weight_type)
  if make_value is None:
    make_value = lambda seed: random_client_value(value_type, seed)

  @tff.tensorflow.computation(np.int32)
  def client_inputs(seed):
    return make_value(seed), client_weight(seed)

  result_type = process.next.type_signature.result.result.member

  @tff.tensorflow.computation(result_type)
  def norm(value):
    return flat_norm(value)

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def probe(seeds):
    values, weights = tff.federated_map(client_inputs, seeds)
    output = process.next(process.initialize(), values, weights)
    return tff.federated_map(norm, output.result), output.measurements

  return probe


def generation_probe(value_type, *, make_value: Optional[Callable[[tf.Tensor], Any]] = None) -> tff.Computation:
  """The probe's client-side generation alone: `seeds@CLIENTS -> sum of the values' norms@SERVER`.

  Its time is the part of an `aggregation_probe` call that is not aggregation (generation, dispatch).
  """
  value_type = tff.to_type(value_type)
  if make_value is None:
    make_value = lambda seed: random_client_value(value_type, seed)

  @tff.tensorflow.computation(np.int32)
  def client_norm(seed):
    return flat_norm(make_value(seed)) * client_weight(seed)

  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def probe(seeds):
    return tff.federated_sum(tff.federated_map(client_norm, seeds))

  return probe
