"""The runner end to end, against run-level targets: `python -m training.run` started as a user starts it.

`defaults`: start-up to the first round and saving against training at the runner's defaults; `study`: a
label500-shaped study run against its in-graph floor. Needs Fashion-MNIST's files (skips without them).
What each measures: docs/research/benchmark.md#sections-keys-and-method
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tff_gma import models
from tff_gma.data import idx
from training import config as config_lib
from training.bench import floor as floor_lib
from training.bench import presets

SHAPE = (28, 28, 1)
EXAMPLES_PER_CLIENT = 120  # Fashion-MNIST's 60,000 over 500 clients.
_RUN = ('--dataset=fashion_mnist', '--model=lenet', '--partition=label_skew', '--classes_per_client=2',
        '--num_clients=500', '--clients_per_round=10', '--client_lr=0.01')
_STUDY = ('--local_epochs=1', '--batch_size=16', '--eval_every=5', '--eval_last_rounds=10',
          '--participation_eval=false')
# The limits: seconds from process start to the first round, saving's share of training, the study run / its floor.
START_UP_TARGET, SAVING_TARGET, STUDY_TARGET = 8.0, 0.10, 1.3


def _runner(flags: tuple[str, ...], rounds: int, directory: str) -> tuple[float, dict[str, Any]]:
  """(wall seconds of the whole command, its summary.json)."""
  began = time.monotonic()
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', *flags, f'--rounds={rounds}', f'--output_dir={directory}'],
      cwd=presets.ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'), check=False)
  wall = time.monotonic() - began
  if process.returncode != 0:
    raise RuntimeError(f'training.run failed (exit {process.returncode}): {process.stderr[-2000:]}')
  with open(os.path.join(directory, 'summary.json')) as f:
    return wall, json.load(f)


def _floor_rounds(rounds: int, seed: int):
  """A callable running `rounds` rounds of the label500-shaped floor; returns their seconds."""
  rng = np.random.default_rng(seed)
  arrays = [(rng.random((EXAMPLES_PER_CLIENT, *SHAPE), dtype=np.float32),
             rng.integers(0, 10, EXAMPLES_PER_CLIENT).astype(np.int32)) for _ in range(10)]
  input_spec = collections.OrderedDict(x=tf.TensorSpec([None, *SHAPE], tf.float32), y=tf.TensorSpec([None], tf.int32))
  build_keras = models.keras_builder('lenet', SHAPE, 10)
  initial = [w.numpy() for w in build_keras().trainable_weights]
  config = config_lib.AlgorithmConfig()
  round_fn = floor_lib.build_floor(build_keras, input_spec, arrays, batch_size=16, client_lr=0.01,
                                   momentum=config.client_momentum, initial_weights=initial)
  round_fn()  # Compiled before it is timed.

  def run() -> float:
    began = time.monotonic()
    for _ in range(rounds):
      round_fn()
    return time.monotonic() - began

  return run


def bench_runner(settings: presets.Settings) -> dict[str, Any]:
  """`settings.runner_repetitions` of each run (defaults, then study, then the study's floor), medians."""
  if not settings.runner_smoke and not idx.has_fashion_mnist(idx.DEBIAN_DIR):
    presets.log('runner: Fashion-MNIST is not installed; skipped (scripts/setup.sh --data=fashion_mnist)')
    return collections.OrderedDict(skipped='Fashion-MNIST is not installed')
  run_flags = ('--dataset=digits', '--model=logistic') if settings.runner_smoke else _RUN
  floor = _floor_rounds(settings.runner_study_rounds, settings.seed)
  samples = collections.defaultdict(list)
  with tempfile.TemporaryDirectory(prefix='tff_gma_bench_runner_') as directory:
    for repetition in range(settings.runner_repetitions):
      presets.log(f'runner: repetition {repetition + 1} of {settings.runner_repetitions}')
      wall, summary = _runner(run_flags, settings.runner_default_rounds, os.path.join(directory, f'd{repetition}'))
      parts = summary['seconds_by_part']
      samples['start_up'].append(summary['process_seconds_before_rounds'])
      samples['saving_share'].append(parts['release_and_checkpoint'] / parts['train'])
      samples['saving_waited_share'].append(parts['waited'] / parts['train'])
      samples['defaults_wall'].append(wall)
      wall, summary = _runner(run_flags + _STUDY, settings.runner_study_rounds,
                              os.path.join(directory, f's{repetition}'))
      samples['study_run'].append(summary['seconds_this_run'])
      samples['study_train'].append(summary['seconds_by_part']['train'])
      samples['study_wall'].append(wall)
      samples['study_floor'].append(floor())
  medians = {k: float(np.median(v)) for k, v in samples.items()}
  ratios = collections.OrderedDict(
      start_up_seconds=medians['start_up'], saving_share=medians['saving_share'],
      saving_waited_share=medians['saving_waited_share'],
      study_to_floor=medians['study_run'] / medians['study_floor'],
      study_training_to_floor=medians['study_train'] / medians['study_floor'])
  return collections.OrderedDict(
      runner_ratios=ratios, medians=medians, samples=dict(samples),
      setup=dict(defaults=list(run_flags) + [f'--rounds={settings.runner_default_rounds}'],
                 study=list(run_flags + _STUDY) + [f'--rounds={settings.runner_study_rounds}'],
                 floor=f'10 clients x {EXAMPLES_PER_CLIENT} generated, LeNet, batch 16',
                 repetitions=settings.runner_repetitions))


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
  """The run-level targets, met or not (never asserted)."""
  ratios = result.get('runner_ratios')
  if not ratios:
    return []
  rows = [('process start to first round <= 8 s (defaults run)', ratios['start_up_seconds'], START_UP_TARGET),
          ('saving <= 10% of training (defaults run; own time)', ratios['saving_share'], SAVING_TARGET),
          ('label500-shaped study run <= 1.3x its training floor', ratios['study_to_floor'], STUDY_TARGET)]
  return [dict(target=name, value=value, met=value <= limit) for name, value, limit in rows]


def markdown(result: dict[str, Any]) -> list[str]:
  section = result.get('details', {}).get('runner')
  if not section or 'skipped' in section:
    return []
  m, r, rounds = section['medians'], section['runner_ratios'], section['setup']['study'][-1].partition('=')[2]
  return [
      '## The runner end to end (`training.bench.runner_runs`)', '',
      f'`python -m training.run` as a user starts it, {section["setup"]["repetitions"]} repetition(s), medians.', '',
      '| measure | value |', '|---|---|',
      f'| defaults run: process start to its first round | {m["start_up"]:.2f} s |',
      f'| defaults run: saving (rows and checkpoints, own time) / training | {r["saving_share"]:.1%} |',
      f'| defaults run: rounds\' wait for evaluations and saving / training | {r["saving_waited_share"]:.1%} |',
      f'| study-shaped run ({rounds} rounds) | {m["study_run"]:.2f} s (training {m["study_train"]:.2f} s) |',
      f'| its training floor ({rounds} floor rounds) | {m["study_floor"]:.2f} s |',
      f'| study run / floor | {r["study_to_floor"]:.2f}x (training alone {r["study_training_to_floor"]:.2f}x) |', '']
