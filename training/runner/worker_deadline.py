"""Deadlines on the runner's calls into TFF workers: a worker that stops answering ends the run in one line.

TFF sets no deadline on its gRPC calls and retries an unreachable worker without end, so a stopped (SIGSTOP) or
wedged worker, or a listener that accepts and never answers, would leave a run waiting forever. Each call runs in a
daemon thread, under the caller's TFF context, that the run waits on for at most the deadline (`DeadlineSettings`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import grpc
import tensorflow_federated as tff

from tff_gma.runtime import worker_process

PROBE_S = 5.0  # How long each worker gets to answer a fresh connection once a deadline has passed.


class WorkerUnresponsive(RuntimeError):
  """A call into the TFF workers passed its deadline; the message names the round and the silent workers."""


@dataclasses.dataclass(frozen=True)
class DeadlineSettings:
  """The bound on each call: `first_s` for the first one of this process (TFF compiles the computation there),
  then `factor` times the slowest call so far, at least `floor_s`. `first_s=0`: no deadline."""
  first_s: float
  factor: float
  floor_s: float

  def seconds(self, slowest: Optional[float]) -> Optional[float]:
    if self.first_s == 0:
      return None
    return self.first_s if slowest is None else max(self.factor * slowest, self.floor_s)


def settings_of(config) -> DeadlineSettings:
  """The deadlines an `ExperimentConfig` sets."""
  return DeadlineSettings(config.first_round_deadline_s, config.round_deadline_factor, config.min_round_deadline_s)


def silent_targets(targets: Sequence[str], timeout: float) -> list[str]:
  """Those of `targets` where no TFF worker completes a fresh gRPC handshake within `timeout` seconds, all tried at
  once (a stopped process still accepts connections in its kernel backlog, but never completes the handshake)."""
  # Connections of their own: gRPC shares connections between channels to a target by default, and the run's own,
  # opened before the worker stopped, would say ready.
  options = [*worker_process.GRPC_OPTIONS, ('grpc.use_local_subchannel_pool', 1)]
  channels = [grpc.insecure_channel(t, options) for t in targets]
  readies = [grpc.channel_ready_future(c) for c in channels]
  end = time.monotonic() + timeout
  try:
    silent = []
    for target, ready in zip(targets, readies):
      try:
        ready.result(timeout=max(0.0, end - time.monotonic()))
      except grpc.FutureTimeoutError:
        silent.append(target)
    return silent
  finally:
    for channel in channels:
      channel.close()


def _run_in_context(context, call: Callable[[], Any], outcome: dict, done: threading.Event) -> None:
  # TFF's context stack is thread-local: a new thread would see TFF's import-time default, not the run's context.
  try:
    with tff.framework.get_context_stack().install(context):
      outcome['value'] = call()
  except BaseException as e:  # pylint: disable=broad-except
    outcome['error'] = e  # Raised again in the waiting thread, with its traceback.
  finally:
    done.set()


class WorkerDeadline:
  """Runs calls into the workers at `targets()` (read when a deadline passes) within `settings`' bound."""

  def __init__(self, settings: DeadlineSettings, targets: Callable[[], Sequence[str]]):
    self.settings = settings
    self._targets = targets
    self.slowest: Optional[float] = None

  def call(self, what: str, call: Callable[[], Any], *, round_time: bool = True) -> Any:
    """`call()`, or `WorkerUnresponsive` naming `what` (e.g. 'round 7') once the deadline has passed. A call with
    `round_time=False` (the initial state) leaves the first round its own bound."""
    seconds = self.settings.seconds(self.slowest)
    if seconds is None:
      return call()
    outcome, done = {}, threading.Event()
    began = time.monotonic()
    threading.Thread(target=_run_in_context, args=(tff.framework.get_context_stack().current, call, outcome, done),
                     name='tff-worker-call', daemon=True).start()
    if not done.wait(seconds):
      raise WorkerUnresponsive(self._message(what, seconds))
    if 'error' in outcome:
      raise outcome['error']
    if round_time:
      elapsed = time.monotonic() - began
      self.slowest = elapsed if self.slowest is None else max(self.slowest, elapsed)
    return outcome['value']

  def _message(self, what: str, seconds: float) -> str:
    targets = list(self._targets())
    silent = silent_targets(targets, PROBE_S)
    bound = (f'within {seconds:g}s (--first_round_deadline_s, --round_deadline_factor and --min_round_deadline_s set '
             'this bound); nothing after the last checkpoint was written')
    if silent:
      who = ('the TFF worker at ' if len(silent) == 1 else 'the TFF workers at ') + ', '.join(silent)
      return f'{what}: {who} {"does" if len(silent) == 1 else "do"} not answer {bound}'
    if not targets:  # A context the caller installed: its workers are not known here.
      return f"{what}: not finished by the TFF context's workers {bound}"
    return (f'{what}: not finished by {", ".join(targets)} (they answer a connection: overloaded, or stuck in the '
            f'call) {bound}')
