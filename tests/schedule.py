"""The order the suite's modules run in under pytest-xdist: the longest first, so that the processes end together.

`scripts/test.sh` runs `--dist loadfile` (a module's tests in one process, its module-scoped fixtures built once)
with xdist's own reordering off: xdist would hand out the modules with the most tests first, which leaves the
few-test end-to-end modules (a crash matrix, the worker deadlines) for last, one process running them alone while
the other waits with nothing left. Here each module is ranked by its seconds in a measured run
(`module_seconds.json`), so that the short modules come last and fill the gaps; a module the file does not know
yet runs first, as if long, so it never lands in the tail. Refresh the file from a whole run with
`TFF_GMA_RECORD_MODULE_SECONDS=tests/module_seconds.json scripts/test.sh`: a stale file only costs time.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence

SECONDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'module_seconds.json')
RECORD_ENV = 'TFF_GMA_RECORD_MODULE_SECONDS'


def module_of(nodeid: str) -> str:
  return nodeid.split('::', 1)[0]


def load_seconds(path: str = SECONDS_FILE) -> dict[str, float]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}  # No ranking: the modules keep the collection's order.


def longest_first(items: Sequence, seconds: dict[str, float]) -> list:
  """`items` (pytest items, or anything with a `nodeid`) grouped by module, the modules by their recorded seconds,
  longest first and unknown ones before all; each module's items, and modules of equal rank, in their own order."""
  modules = list(dict.fromkeys(module_of(item.nodeid) for item in items))
  rank = {m: (m in seconds, -seconds.get(m, 0.0), i) for i, m in enumerate(modules)}
  by_module = collections.defaultdict(list)
  for item in items:
    by_module[module_of(item.nodeid)].append(item)
  return [item for module in sorted(modules, key=rank.__getitem__) for item in by_module[module]]


class SecondsRecorder:
  """Adds up each module's test seconds (setup, call and teardown) as reports arrive, and writes them sorted."""

  def __init__(self, path: str):
    self.path = path
    self.seconds = collections.Counter()

  def add(self, nodeid: str, duration: float) -> None:
    self.seconds[module_of(nodeid)] += duration

  def write(self) -> None:
    with open(self.path, 'w') as f:
      json.dump({m: round(s, 1) for m, s in sorted(self.seconds.items())}, f, indent=0)
      f.write('\n')
