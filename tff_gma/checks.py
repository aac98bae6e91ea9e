"""Checks of scalar arguments, one per kind of argument, shared by the library and the experiment harness.

Each returns the value as a plain Python scalar or raises a ValueError naming the argument and showing the value,
so the rules (bools are not numbers, NaN and infinity are not finite, ...) and their wording are the same
everywhere. Only NumPy and the standard library are imported, so NumPy-only modules can use them without TensorFlow.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np


def check_positive_finite(value, name: str) -> float:
  """`float(value)` when it is a positive finite number; ValueError naming `name` otherwise."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f'{name} must be a positive finite number, got {value!r}')
  number = float(value)
  if not math.isfinite(number) or number <= 0:
    raise ValueError(f'{name} must be a positive finite number, got {value!r}')
  return number


def check_positive_int(value, name: str, *, optional: bool = False) -> Optional[int]:
  """`int(value)` when it is a positive integer (a Python int or a NumPy integer, not a bool); ValueError naming
  `name` otherwise. With `optional=True`, None is accepted too and returned as is."""
  if optional and value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
    kind = 'None or a positive integer' if optional else 'a positive integer'
    raise ValueError(f'{name} must be {kind}, got {value!r}')
  return int(value)


def check_fraction(value, name: str, *, low_open: bool = False, high_open: bool = False) -> float:
  """`float(value)` when it is a number in [0, 1] (bounds excluded where asked); ValueError naming `name`."""
  interval = ('(' if low_open else '[') + '0, 1' + (')' if high_open else ']')
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must lie in {interval}, got {value!r} (a bool, not a number)')
  if not isinstance(value, numbers.Real):
    raise ValueError(f'{name} must be a number in {interval}, got {value!r}')
  number = float(value)
  low_ok = number > 0 if low_open else number >= 0
  high_ok = number < 1 if high_open else number <= 1
  if math.isnan(number) or not (low_ok and high_ok):
    raise ValueError(f'{name} must lie in {interval}, got {value!r}')
  return number


def check_bool(value, name: str) -> bool:
  """`bool(value)` when it is a Python or NumPy bool; ValueError naming `name` otherwise."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be a bool, got {value!r}')
  return bool(value)
