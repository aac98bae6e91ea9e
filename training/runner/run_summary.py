"""What a finished run reports, read back from its metrics.csv: summary.json, membership.json, accuracy.png.

summary.json: the final accuracy (mean over the last `LAST_EVALS_FOR_FINAL` evaluated rounds; of the validation
split instead in a validation run), the best, the rounds completed, where the time went and where the clients
trained, the full configuration; membership.json: the membership-inference attack on the final model, when asked;
accuracy.png: accuracy and loss against rounds.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import time
from typing import Any, Optional

import numpy as np

from training import config as config_lib
from training import safe_files
from training.engine import membership_attack
from training.runner import round_steps
from training.runner import run_files
from training.runner import run_setup

LAST_EVALS_FOR_FINAL = 10  # "Final" figure: mean over the last 10 evaluated rounds (GMA paper).
# The final means reported for these columns where the evaluations have them (`final_<column with _ for />`).
_FINAL_MEANS = ('participating/accuracy', 'non_participating/accuracy', 'personalized/accuracy',
                'personalized/shared_accuracy')


def write_summary(config: config_lib.ExperimentConfig, setup: run_setup.Setup, trained: round_steps.Trained
                  ) -> dict[str, Any]:
  """Writes summary.json (returned), membership.json with `membership_inference`, and accuracy.png when rounds
  were evaluated; from metrics.csv's rows up to `config.rounds`."""
  rows = [r for r in read_rows(os.path.join(config.output_dir, run_files.METRICS_FILE))
          if r.get('round', 0) <= config.rounds]
  evaluated = [r for r in rows if setup.accuracy_key in r]
  summary = _summary(config, setup, trained, rows, evaluated)
  if config.membership_inference:
    summary['membership_attack_accuracy'] = attack_membership(config, setup, trained.state)
  summary['non_finite_update_rounds'] = trained.non_finite_in_a_row  # In a row, at the end.
  if trained.stopped is not None:
    summary['stopped'] = str(trained.stopped)
  safe_files.write_atomic(os.path.join(config.output_dir, 'summary.json'), json.dumps(summary, indent=2))
  if evaluated:
    write_plot(rows, os.path.join(config.output_dir, 'accuracy.png'),
               f'{config.dataset}/{config.partition}: {config.algorithm} + {config.aggregator}')
  return summary


def _mean_of_last(values: list[float]) -> Optional[float]:
  """The final figure of `values` (the evaluated rounds', in order): the mean of the last `LAST_EVALS_FOR_FINAL`."""
  return float(np.mean(values[-LAST_EVALS_FOR_FINAL:])) if values else None


def _summary(config: config_lib.ExperimentConfig, setup: run_setup.Setup, trained: round_steps.Trained,
             rows: list[dict[str, float]], evaluated: list[dict[str, float]]) -> dict[str, Any]:
  """summary.json's entries up to the membership attack (`write_summary` adds the rest)."""
  accuracy = [r['test/accuracy'] for r in evaluated if 'test/accuracy' in r]
  summary = {
      'final_accuracy': _mean_of_last(accuracy),
      'best_accuracy': float(np.max(accuracy)) if accuracy else None,
      'rounds_completed': int(max((r['round'] for r in rows), default=0)),
      'seconds_this_run': time.monotonic() - trained.started,
      # How long the process had run when this run's rounds began: `python -m training.run`'s start-up (imports,
      # data, building the method, the worker). In a process that runs several runs (a study) it counts them all.
      'process_seconds_before_rounds': None if trained.process_age is None else round(trained.process_age, 2),
      # Where this run's time went, in seconds summed over its rounds: the method's round (client training and
      # aggregation), evaluations, metrics releases with checkpoints (their own time, which overlaps training where
      # they ran beside it: `training.runner.background`), `waited`: the rounds' wait for them; the rest: setup,
      # the summary.
      'seconds_by_part': {**{k: round(v, 3) for k, v in trained.seconds.items()}, 'rounds': trained.rounds_run},
      # Where this run's client training ran: TensorFlow devices of this process (local), or the TFF worker's CPU.
      'client_execution': setup.method.client_execution,
      'dataset_placement': trained.dataset_placement,
      'client_loop': run_setup.client_loop_used(config, setup.model_fn),
      'client_devices': setup.method.client_devices(),
      'config': dataclasses.asdict(config),
  }
  if setup.validation is not None:  # A tuning run: no test accuracy (final/best_accuracy stay None).
    validation = [r['validation/accuracy'] for r in evaluated]
    summary['final_validation_accuracy'] = _mean_of_last(validation)
    summary['best_validation_accuracy'] = float(np.max(validation)) if validation else None
  if evaluated and 'ood_test/accuracy' in evaluated[-1]:
    summary['final_ood_accuracy'] = _mean_of_last([r['ood_test/accuracy'] for r in evaluated
                                                   if 'ood_test/accuracy' in r])
  for key in _FINAL_MEANS:
    values = [r[key] for r in evaluated if key in r]
    if values:
      summary[f'final_{key.replace("/", "_")}'] = _mean_of_last(values)
  return summary


def attack_membership(config: config_lib.ExperimentConfig, setup: run_setup.Setup, state: Any) -> float:
  """The membership-inference attack on the model of `state`, written to membership.json; its accuracy.

  Members: every example the training clients hold; non-members: the central test split (balanced inside)."""
  weights = setup.process.get_model_weights(state)
  xs, ys = zip(*(setup.data.train.client_arrays(c) for c in setup.data.train.client_ids))
  attack = membership_attack.membership_attack(
      setup.evaluator.logits(weights, np.concatenate(xs)), np.concatenate(ys),
      setup.evaluator.logits(weights, setup.data.test_x), setup.data.test_y, seed=config.seed)
  safe_files.write_atomic(os.path.join(config.output_dir, 'membership.json'),
                          json.dumps(attack, indent=2, default=float))
  return float(attack['attack_accuracy'])


# The plot's series: (metrics.csv column prefix, legend label). Training metrics are the round's clients' own
# (TFF's `client_work/train`, every round); the others come from the evaluated rounds only.
_PLOT_SERIES = (('client_work/train', 'train (round\'s clients)'), ('test', 'test'), ('ood_test', 'OOD test'),
                ('validation', 'validation'))


def plot_figure(rows: list[dict[str, float]], title: str):
  """Accuracy and loss against rounds (two panels), train and held-out alike; rounds on integer ticks."""
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  fig = figure.Figure(figsize=(10, 4))
  axes = fig.subplots(1, 2)
  for ax, metric in zip(axes, ('accuracy', 'loss')):
    for prefix, label in _PLOT_SERIES:
      key = f'{prefix}/{metric}'
      points = [(r['round'], r[key]) for r in rows if key in r and 'round' in r and math.isfinite(r[key])]
      if points:
        ax.plot(*zip(*points), label=label, marker='.' if len(points) < 30 else None)
    ax.set_xlabel('round')
    ax.set_ylabel(metric)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_lines():
      ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def write_plot(rows: list[dict[str, float]], path: str, title: str) -> None:
  """Writes `plot_figure` of the run's metrics rows (every round's) as a PNG at `path`."""
  image = io.BytesIO()
  plot_figure(rows, title).savefig(image, format='png', dpi=100)
  safe_files.write_atomic(path, image.getvalue())


def read_rows(csv_path: str) -> list[dict[str, float]]:
  """metrics.csv's rows, each {column: value} of its numeric values ([] when there is no file).

  Read with `safe_files.read_csv` (a regular file, bounded, UTF-8, no row longer than the header): a file that is
  not, or a row whose `round` is not a number, raises `safe_files.DamagedFileError` (a ValueError) naming the line.
  """
  if not os.path.exists(csv_path):
    return []
  rows = []
  for line, raw in safe_files.read_csv(csv_path)[1]:
    row = {}
    for k, v in raw.items():
      if v not in (None, ''):
        try:
          row[k] = float(v)
        except ValueError:
          pass
    if raw.get('round') not in (None, '') and 'round' not in row:
      raise safe_files.DamagedFileError(csv_path, f'line {line}: round {raw["round"]!r} is not a number')
    rows.append(row)
  return rows
