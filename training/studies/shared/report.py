"""A study's results files: results.md (its report), results.json (what the report reads) and its figures."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


def mean_pm_std(values: Sequence[float]) -> str:
  """Accuracies (fractions) as 'mean +- std' in percent, two decimals."""
  return f'{100 * np.mean(values):.2f} +- {100 * np.std(values):.2f}'


def write_report(output_dir: str, markdown: str, payload: Any, indent: int = 1) -> None:
  """Writes `markdown` to results.md and `payload` to results.json under `output_dir` (created if missing)."""
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, 'results.md'), 'w') as f:
    f.write(markdown)
  with open(os.path.join(output_dir, 'results.json'), 'w') as f:
    json.dump(payload, f, indent=indent)


def pyplot():
  """matplotlib's pyplot on the Agg backend (files only, no display), imported when a figure is drawn."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt
