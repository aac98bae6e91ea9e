"""A one-line progress bar for rounds: tqdm's, redrawn in place, on a terminal; a plain line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

import tqdm


class _Bar(tqdm.tqdm):
  """tqdm without its monitor thread (a thread per process that outlives the bar): every process exits promptly."""
  monitor_interval = 0


class RoundProgress:
  """Rounds done of `total`, with the latest metrics, on `stream` (stdout by default)."""

  def __init__(self, total: int, label: str = '', stream: Optional[TextIO] = None, width: int = 30):
    self.total, self.label, self.width = total, label, width
    self.stream = stream or sys.stdout
    self._tty = hasattr(self.stream, 'isatty') and self.stream.isatty()
    self._start = time.monotonic()
    self._last_decile = -1
    self._bar = _Bar(total=total, desc=label, unit='round', file=self.stream, leave=True) if self._tty else None

  def update(self, done: int, **metrics: float) -> None:
    extra = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items())
    if self._bar is not None:
      self._tty_update(done, extra)
      return
    frac = done / self.total if self.total else 1.0
    decile = int(frac * 10)
    if decile == self._last_decile and done < self.total:
      return
    self._last_decile = decile
    filled = int(round(frac * self.width))
    bar = '#' * filled + '.' * (self.width - filled)
    self.stream.write(f'{self.label:<14} [{bar}] round {done:>4}/{self.total} {extra} '
                      f'({time.monotonic() - self._start:5.1f}s)\n')
    self.stream.flush()

  def close(self) -> None:
    """Ends tqdm's bar where it stands (a run stopped before its last round); a no-op off a terminal."""
    if self._bar is not None:
      self._bar.close()

  def _tty_update(self, done: int, extra: str) -> None:
    self._bar.set_postfix_str(extra, refresh=False)
    self._bar.update(done - self._bar.n)
    if done >= self.total:
      self._bar.close()
