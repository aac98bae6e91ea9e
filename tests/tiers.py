"""Which cases of a parametrized matrix join the fast tier: the first to show each value, the rest `slow`.

A matrix (every algorithm x every aggregator, every variant of a pass count) checks interactions that the full suite
must run, but a developer's quick run needs each value once. `cover_once` keeps a case in the fast tier when it is the
first, in the listed order, to show the value of some key (so list the cases a quick run most needs first); every
other case is marked `slow`. `scripts/test.sh` (CI) runs both tiers, so no case is dropped: only when it runs moves.
"""

from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import pytest


def cover_once(cases: Iterable[Any], keys: Sequence[Callable[[Any], Hashable]],
               ids: Optional[Callable[[Any], str]] = None) -> list[Any]:
  """`cases` as `pytest.param`s: fast when some key's value is new, else marked slow.

  A case may be a tuple (the arguments of a multi-name parametrize) or one value; each key takes the case as given.
  """
  seen = [set() for _ in keys]
  params = []
  for case in cases:
    values = [key(case) for key in keys]
    new = any(value not in seen_values for value, seen_values in zip(values, seen))
    for value, seen_values in zip(values, seen):
      seen_values.add(value)
    arguments = case if isinstance(case, tuple) else (case,)
    marks = () if new else (pytest.mark.slow,)
    params.append(pytest.param(*arguments, marks=marks, id=ids(case) if ids else None))
  return params


def first_only(cases: Iterable[Any], ids: Optional[Callable[[Any], str]] = None) -> list[Any]:
  """`cases` as `pytest.param`s: the first in the fast tier, the rest marked slow."""
  return cover_once(cases, keys=[lambda case: None], ids=ids)
