"""95% t intervals of the GMA studies' differences (paired per seed, or Welch's between cells) and their verdicts.

Student's t quantiles are scipy's, rounded to 3 decimals as the studies' committed results were computed (their
collects reproduce them byte for byte); an interval's width is within 0.03% of the exact one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

# Decimals of t_{0.975, df}: the studies' committed json holds intervals computed with the quantile to 3 places
# (the exact quantile moves their bounds by up to 0.007 points).
T_DECIMALS = 3


def t_quantile_975(df: int) -> float:
  """t_{0.975, df}, Student's two-sided 95% quantile, rounded to `T_DECIMALS` places."""
  if df < 1:
    raise ValueError(f'df must be >= 1, got {df}')
  return round(float(stats.t.ppf(0.975, df)), T_DECIMALS)


def paired_interval(differences: Sequence[float]) -> tuple[float, float, float]:
  """(mean, low, high): the 95% t interval of the mean of paired differences."""
  d = np.asarray(differences, np.float64)
  if d.size < 2:
    raise ValueError(f'a paired interval needs at least 2 differences, got {d.size}')
  half = t_quantile_975(d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
  return float(d.mean()), float(d.mean() - half), float(d.mean() + half)


def welch_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
  """(mean, low, high): the 95% Welch t interval of mean(a) - mean(b) (df rounded down: conservative)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)) if va + vb > 0 else a.size + b.size - 2
  half = t_quantile_975(max(1, int(df))) * float(np.sqrt(va + vb))
  mean = float(a.mean() - b.mean())
  return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
  """What an interval of GMA - AVG says: above 0, below 0, or containing it."""
  if low > 0:
    return 'GMA ahead'
  if high < 0:
    return 'AVG ahead'
  return 'undecided'


def paired_comparison(gma: Sequence[float], avg: Sequence[float]) -> dict[str, Any]:
  """GMA's and AVG's accuracies (fractions, one per seed, paired by seed) as the studies report them: their means in
  percent, the per-seed differences GMA - AVG in points, the 95% t interval of their mean and its verdict."""
  diff = [100 * (g - a) for g, a in zip(gma, avg)]
  mean, low, high = paired_interval(diff)
  return {'avg': 100 * float(np.mean(avg)), 'gma': 100 * float(np.mean(gma)), 'differences': diff,
          'mean': mean, 'low': low, 'high': high, 'verdict': verdict(low, high)}


def verdict_counts(verdicts: Sequence[str]) -> str:
  """'GMA ahead a, AVG ahead b, undecided c of n': how a cell's intervals came out."""
  return (f"GMA ahead {verdicts.count('GMA ahead')}, AVG ahead {verdicts.count('AVG ahead')}, undecided "
          f"{verdicts.count('undecided')} of {len(verdicts)}")


def change(new: Sequence[float], old: Sequence[float], paired: bool) -> dict[str, Any]:
  """How far accuracies (fractions, one per seed) moved from `old` to `new`: their means in percent and new - old in
  points with its 95% interval, paired by seed when `paired` (the same seeds in the same order), else Welch's."""
  if paired:
    diff = [100 * (n - o) for n, o in zip(new, old)]
    mean, low, high = paired_interval(diff)
  else:
    diff = None
    mean, low, high = welch_interval([100 * n for n in new], [100 * o for o in old])
  return {'old': 100 * float(np.mean(old)), 'new': 100 * float(np.mean(new)), 'differences': diff, 'mean': mean,
          'low': low, 'high': high, 'paired': paired}
