"""A run's evaluations of finished rounds, run beside the next round's training where that is safe.

An evaluation scores a finished round's model (NumPy weights: a snapshot no later round changes) in this process's
TensorFlow, while the next round trains in the TFF worker: on two cores the two overlap instead of taking turns.
Its results join the round's metrics row before the row is written (`wait`), so the rows, and everything read
from them, are those of evaluating in turn. In turn it stays (`background=False`) where the evaluation reads what
the next round changes (the clients' own values: personalized RFA) or where the next round trains in this process
too (`--client_execution=local`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable


class Evaluations:
  """Runs `submit`ted evaluations (in a thread with `background`, else at once); `wait` adds their results to
  their rows. `seconds`: the evaluations' own wall time; `waited`: how long the round loop waited for them."""

  def __init__(self, background: bool):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, 'evaluation') if background else None
    self._pending: list[tuple[dict[str, float], concurrent.futures.Future]] = []
    self.seconds = 0.0
    self.waited = 0.0

  def submit(self, row: dict[str, float], evaluate: Callable[[], dict[str, float]]) -> None:
    """Evaluates, adding the result to `row` (at once, or by the next `wait`)."""
    if self._pool is None:
      result, seconds = _timed(evaluate)
      row.update(result)
      self.seconds += seconds
      self.waited += seconds
      return
    self._pending.append((row, self._pool.submit(_timed, evaluate)))

  def wait(self) -> None:
    """Adds every submitted evaluation's result to its row (re-raising an evaluation's error)."""
    if not self._pending:
      return
    began = time.monotonic()
    try:
      for row, future in self._pending:
        result, seconds = future.result()
        row.update(result)
        self.seconds += seconds
    finally:
      self._pending.clear()
      self.waited += time.monotonic() - began

  def close(self) -> None:
    """Ends the thread, dropping evaluations not yet started (a run that failed does not write their rows)."""
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
    self._pending.clear()


def _timed(evaluate: Callable[[], dict[str, float]]) -> tuple[dict[str, float], float]:
  began = time.monotonic()
  result = evaluate()
  return result, time.monotonic() - began
