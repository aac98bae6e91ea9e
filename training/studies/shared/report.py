"""A study's results files: results.md (its report), results.json (what the report reads) and its figures."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

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


class Series(NamedTuple):
  """One method's curves in a panel: a line per seed, and their mean over seeds."""
  label: str
  color: str
  rounds: Sequence[Sequence[int]]  # Per seed: the evaluated rounds.
  values: Sequence[Sequence[float]]  # Per seed: accuracies (fractions), drawn in percent.


class Panel(NamedTuple):
  title: str
  ylabel: str
  series: Sequence[Series]


def curves_figure(grid: Sequence[Sequence[Panel]], path: str) -> None:
  """Accuracy over rounds, a row of panels per row of `grid`: each series' seeds thin and their mean over the seeds
  (to the shortest seed's length) bold, so a collapsed seed shows. The same panels give the same file."""
  plt = pyplot()
  columns = max(len(row) for row in grid)
  fig, axes = plt.subplots(len(grid), columns, figsize=(4 * columns, 3.2 * len(grid)), squeeze=False, sharey=True)
  for row, panels in zip(axes, grid):
    for ax, panel in zip(row, panels):
      for series in panel.series:
        for rounds, values in zip(series.rounds, series.values):
          ax.plot(rounds, 100 * np.asarray(values), color=series.color, linewidth=0.5, alpha=0.35)
        length = min(len(v) for v in series.values)
        ax.plot(series.rounds[0][:length], 100 * np.mean([v[:length] for v in series.values], axis=0),
                color=series.color, linewidth=1.8, label=series.label)
      ax.set_title(panel.title, fontsize=9)
      ax.set_xlabel('round')
      ax.set_ylabel(panel.ylabel)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7, loc='lower right')
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
