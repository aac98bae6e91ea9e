"""The demo: one federated setup on the embedded digits, trained with plain averaging and every aggregator.

    python -m training.demo [--rounds=25] [--output_dir=outputs/demo] [--client_execution=local]

Prints a progress bar per aggregator, then a comparison table, and writes per-round metrics (CSV), a
summary (JSON) and the table (Markdown) into a fresh timestamped folder under --output_dir.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import csv  # pylint: disable=g-import-not-at-top
import datetime
import json
import sys
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

from tff_gma import models
from tff_gma import runtime
from tff_gma.data import digits
from training import client_execution
from training import evaluation
from training import methods
from training import progress
from training import simulation

_ROUNDS = flags.DEFINE_integer('rounds', 25, 'Rounds per aggregator.')
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', 10, 'Clients (all take part in every round).')
_PARTITION = flags.DEFINE_enum('partition', 'label_skew', list(digits.PARTITIONS), 'How the digits are split.')
_MODEL = flags.DEFINE_enum('model', 'cnn', ['cnn', 'logistic', 'lenet'], 'Keras model.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed for the partition, the model init and the client data order.')
_AGGREGATORS = flags.DEFINE_list('aggregators', None, 'Methods to compare (training.methods.resolve names: an '
                                 'aggregator, a composed algorithm, or ALGORITHM/AGGREGATOR; default: the project\'s).')
_CLIENT_EXECUTION = flags.DEFINE_enum(
    'client_execution', client_execution.WORKER, list(client_execution.MODES),
    'Where clients train: worker (the TFF worker) or local (this process\'s TensorFlow, its GPU if any; FedAvg '
    'family only: by default the methods that cannot are left out).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', 'outputs/demo', 'Where a timestamped run folder is written.')

# The project's private aggregators and methods (the non-private robust baselines of the RFA study are left out:
# they are study baselines, run them with --aggregators).
DEFAULT_METHODS = ('mean', 'gma', 'gma_binary', 'rfa', 'rfa_one_step', 'elastic', 'fedgma')
_CONFIG = simulation.AlgorithmConfig(name='fedavg', client_lr=0.05, server_lr=1.0)
_LOCAL_EPOCHS, _BATCH_SIZE = 1, 16


def runs_in(name: str, mode: str) -> bool:
  """Whether method `name` can train with `--client_execution=mode`."""
  try:
    methods.check(*methods.resolve(name), client_execution=mode)
  except ValueError:
    return False
  return True


def run_one(name: str, train_data, evaluator, build_keras, model_fn, rounds: int, seed: int,
            mode: str = client_execution.WORKER):
  method = methods.build(model_fn, *methods.resolve(name), algorithm_config=_CONFIG,
                         num_clients=len(train_data.client_ids), client_execution=mode)
  process = method.process
  state = simulation.seeded_initial_state(process, build_keras, seed)  # Same start for every method.
  bar = progress.RoundProgress(rounds, label=name)
  rows = []
  for round_num in range(1, rounds + 1):
    datasets = [
        simulation.client_dataset(train_data, cid, local_epochs=_LOCAL_EPOCHS, batch_size=_BATCH_SIZE,
                                  seed=seed, round_num=round_num)
        for cid in train_data.client_ids
    ]
    state, metrics = method.run_round(state, train_data.client_ids, datasets, round_num)
    row = {'round': round_num}
    row.update({f'test/{k}': v for k, v in evaluator(process.get_model_weights(state)).items()})
    row.update(simulation.flatten_metrics(metrics))
    rows.append(row)
    bar.update(round_num, acc=row['test/accuracy'])
  return rows, method.client_devices()


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mode = _CLIENT_EXECUTION.value
  names = _AGGREGATORS.value or [m for m in DEFAULT_METHODS if runs_in(m, mode)]
  for name in names:
    try:
      methods.check(*methods.resolve(name), client_execution=mode)
    except ValueError as e:
      raise app.UsageError(f'--aggregators: {e}') from None
  left_out = [] if _AGGREGATORS.value else [m for m in DEFAULT_METHODS if m not in names]
  if left_out:
    print(f'--client_execution={mode}: leaving out {", ".join(left_out)} (their client work runs only in the TFF '
          f'worker)')
  runtime.set_simulation_context()
  data = digits.federated_data(_PARTITION.value, _NUM_CLIENTS.value, _SEED.value)
  train_data = data.train
  build_keras = models.keras_builder(_MODEL.value, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  evaluator = evaluation.CentralEvaluator(build_keras, data.test_x, data.test_y)
  out_dir = os.path.join(_OUTPUT_DIR.value, datetime.datetime.now().strftime('%Y%m%d-%H%M%S'))
  os.makedirs(out_dir, exist_ok=True)

  num_train = sum(train_data.num_examples(c) for c in train_data.client_ids)
  print(f'Digits ({num_train} train / {len(data.test_y)} test), {_PARTITION.value}, '
        f'{_NUM_CLIENTS.value} clients, {_MODEL.value} model, FedAvg (client SGD lr {_CONFIG.client_lr}, '
        f'momentum {_CONFIG.client_momentum}), {_ROUNDS.value} rounds, seed {_SEED.value}.')
  summary = {}
  for name in names:
    start = time.monotonic()
    rows, devices = run_one(name, train_data, evaluator, build_keras, model_fn, _ROUNDS.value, _SEED.value, mode)
    accuracy = [r['test/accuracy'] for r in rows]
    summary[name] = {
        'description': methods.METHOD_DESCRIPTIONS.get(name, name),
        'final_accuracy': float(np.mean(accuracy[-5:])),
        'best_accuracy': float(np.max(accuracy)),
        'final_loss': rows[-1]['test/loss'],
        'seconds': time.monotonic() - start,
        'client_devices': devices,  # Where its clients trained.
    }
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != 'round', k))
    with open(os.path.join(out_dir, f'metrics_{name.replace("/", "-")}.csv'), 'w', newline='') as f:
      writer = csv.DictWriter(f, fieldnames=keys)
      writer.writeheader()
      writer.writerows(rows)

  table = ['| aggregator | final acc. (mean of last 5 rounds) | best acc. | final loss | time (s) |',
           '|---|---|---|---|---|']
  for name, s in summary.items():
    table.append(f"| {name} | {s['final_accuracy']:.4f} | {s['best_accuracy']:.4f} | {s['final_loss']:.4f} | "
                 f"{s['seconds']:.1f} |")
  print('\n' + '\n'.join(table))
  with open(os.path.join(out_dir, 'comparison.md'), 'w') as f:
    f.write('\n'.join(table) + '\n')
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    flag_values = {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    json.dump({'flags': flag_values, 'aggregators': summary}, f, indent=2)
  print(f'\nFull outputs (per-round metrics CSV, summary.json, comparison.md): {os.path.abspath(out_dir)}')


if __name__ == '__main__':
  app.run(main)
