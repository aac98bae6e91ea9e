"""A one-line progress bar for rounds (redrawn in place on a terminal, a line per 10% otherwise)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class RoundProgress:

  def __init__(self, total: int, label: str = '', stream: Optional[TextIO] = None, width: int = 30):
    self.total, self.label, self.width = total, label, width
    self.stream = stream or sys.stdout
    self._tty = hasattr(self.stream, 'isatty') and self.stream.isatty()
    self._start = time.monotonic()
    self._last_decile = -1

  def update(self, done: int, **metrics: float) -> None:
    frac = done / self.total if self.total else 1.0
    filled = int(round(frac * self.width))
    bar = '#' * filled + '.' * (self.width - filled)
    extra = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items())
    line = (f'{self.label:<14} [{bar}] round {done:>4}/{self.total} {extra} '
            f'({time.monotonic() - self._start:5.1f}s)')
    if self._tty:
      self.stream.write('\r' + line + ('\n' if done >= self.total else ''))
    else:
      decile = int(frac * 10)
      if decile == self._last_decile and done < self.total:
        return
      self._last_decile = decile
      self.stream.write(line + '\n')
    self.stream.flush()
