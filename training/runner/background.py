"""A run's work after a round (evaluation, the metrics rows, the checkpoint), beside the next round's training.

One thread, in submission order (the order crash safety rests on), so on two cores the work overlaps the next round
in the TFF worker; in turn where it reads what the next round changes. A failed task raises in the round loop. The
round loop bounds how far the work falls behind (`wait_for_last`): a kill then loses at most one checkpoint interval.
Detail: docs/experiments.md#after-round-work-beside-the-next-round"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any


class AfterRoundWork:
  """Runs `submit`ted tasks in one thread, in order (with `background`; else at once). `seconds`: each part's own
  wall time; `waited`: how long the round loop waited for the thread."""

  def __init__(self, background: bool):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, 'after_round') if background else None
    self._pending: list[concurrent.futures.Future] = []
    self._last: dict[str, concurrent.futures.Future] = {}  # Each part's latest task, for `wait_for_last`.
    self.seconds: dict[str, float] = collections.defaultdict(float)
    self.waited = 0.0
    self._failed = False  # After a failed task none runs: a checkpoint never follows rows that lack their work.

  def submit(self, part: str, task: Callable[[], Any]) -> None:
    """Runs `task` after the tasks submitted before it; its time counts to `seconds[part]`."""
    if self._pool is None:
      self._timed(part, task)
      return
    future = self._pool.submit(self._timed, part, task)
    self._pending.append(future)
    self._last[part] = future

  def _timed(self, part: str, task: Callable[[], Any]) -> None:
    if self._failed:
      return
    began = time.monotonic()
    try:
      task()
    except BaseException:
      self._failed = True
      raise
    finally:
      self.seconds[part] += time.monotonic() - began

  def check(self) -> None:
    """Raises the error of a task that has failed (without waiting for the others)."""
    while self._pending and self._pending[0].done():
      self._pending.pop(0).result()

  def wait(self) -> None:
    """Waits for every submitted task, raising the first error."""
    self._wait_while(lambda: bool(self._pending))

  def wait_for_last(self, part: str) -> None:
    """Waits for the latest task submitted to `part` and for those before it (not for later ones), raising the
    first error: what bounds the backlog, since a queue that only grows would leave every save ever later."""
    last = self._last.pop(part, None)
    self._wait_while(lambda: last is not None and any(f is last for f in self._pending))

  def _wait_while(self, pending: Callable[[], bool]) -> None:
    began = time.monotonic()
    try:
      while pending():
        self._pending.pop(0).result()
    finally:
      self.waited += time.monotonic() - began

  def close(self) -> None:
    """Finishes the task in progress (a checkpoint is never left half written by us), drops those not started."""
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
    self._pending.clear()
    self._last.clear()
