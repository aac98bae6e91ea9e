"""The demo: one federated setup on the embedded digits, trained with plain averaging and every aggregator.

    python -m training.demo [--rounds=25] [--output_dir=outputs/demo] [--client_execution=local]

The GMA study's `label10` setup, each method with the study's hyperparameters (`--study_results`); the table adds
each method's privacy audit and its accuracy under the omniscient attack. Setup, table: docs/results.md#the-demo"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import csv  # pylint: disable=g-import-not-at-top
import datetime
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow_federated as tff

from tff_gma import audit
from tff_gma import models
from tff_gma.data import digits
from training import command_line
from training import config as config_lib
from training.engine import client_execution
from training.engine import corruption
from training.engine import evaluation
from training.engine import methods
from training.engine import registry
from training.runner import progress
from training.runner import round_loop

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The demo's flags (defined when run as a program, so that importing the module defines none)."""
  flags.DEFINE_integer('rounds', 25, 'Rounds per aggregator.')
  flags.DEFINE_integer('num_clients', 10, 'Clients (all take part in every round).')
  flags.DEFINE_enum('partition', 'label_skew', list(digits.PARTITIONS), 'How the digits are split.')
  flags.DEFINE_enum('model', 'cnn', ['cnn', 'logistic', 'lenet'], 'Keras model.')
  flags.DEFINE_integer('seed', 0, 'Seed for the partition, the model init and the client data order.')
  flags.DEFINE_list('aggregators', None, 'Methods to compare (training.engine.registry.resolve names: an aggregator, a '
                    'composed algorithm, or ALGORITHM/AGGREGATOR; default: the project\'s).')
  flags.DEFINE_enum(
      'client_execution', client_execution.WORKER, list(client_execution.MODES),
      'Where clients train: worker (the TFF worker) or local (this process\'s TensorFlow, its GPU if any; FedAvg '
      'family only: by default the methods that cannot are left out).')
  flags.DEFINE_string('output_dir', 'outputs/demo', 'Where a timestamped run folder is written.')
  flags.DEFINE_string(
      'study_results', os.path.join(_ROOT, 'docs', 'gma_study.json'),
      'The GMA study\'s results.json: the hyperparameters it chose per setting and method.')
  flags.DEFINE_integer('omniscient_rounds', 10, 'Rounds of the omniscient column (0: leave it out).')


# The project's private aggregators and methods (the non-private robust baselines of the RFA study are left out:
# they are study baselines, run them with --aggregators).
DEFAULT_METHODS = registry.method_names(registry.DEMO)
_ALGORITHM_CONFIG = config_lib.AlgorithmConfig()
_LOCAL_EPOCHS, _BATCH_SIZE = config_lib.ExperimentConfig.local_epochs, config_lib.ExperimentConfig.batch_size
STUDY_SETTING = 'label10'  # The GMA study's setting that the demo's defaults are.
CORRUPT_FRACTION = 0.25


class Hyperparameters(NamedTuple):
  algorithm_config: config_lib.AlgorithmConfig
  params: config_lib.AggregatorParams
  source: str  # Where they come from, for the header.


def _reads_tau(aggregator: str) -> bool:
  """Whether the aggregator reads GMA's tau (its record's `reads`): the study tuned it, the header shows it."""
  return 'tau' in registry.aggregator(aggregator).reads


def choose_hyperparameters(names: Sequence[str], study_results: str, is_study_setting: bool) -> dict[str, Any]:
  """Per method: the study's choice for it in `STUDY_SETTING`, else FedAvg-mean's, else the defaults."""
  chosen = {}
  if is_study_setting and os.path.exists(study_results):
    with open(study_results) as f:
      for record in json.load(f):
        if record['setting'] == STUDY_SETTING:
          chosen[(record['algorithm'], record['aggregator'])] = record
  out = {}
  for name in names:
    algorithm, aggregator = registry.resolve(name)
    record, source = chosen.get((algorithm, aggregator)), f'GMA study ({STUDY_SETTING})'
    if record is None and ('fedavg', 'mean') in chosen:
      record, source = chosen[('fedavg', 'mean')], f'FedAvg-mean\'s in the GMA study ({STUDY_SETTING}); not tuned'
    if record is None:
      out[name] = Hyperparameters(_ALGORITHM_CONFIG, config_lib.AggregatorParams(), 'defaults (no study choice)')
      continue
    algorithm_config = config_lib.AlgorithmConfig(name='fedavg', client_lr=record['client_lr'],
                                                  server_lr=record['server_lr'])
    tau = record.get('tau') if _reads_tau(aggregator) else None
    aggregator_params = config_lib.AggregatorParams() if tau is None else config_lib.AggregatorParams(tau=tau)
    out[name] = Hyperparameters(algorithm_config, aggregator_params, source)
  return out


def runs_in(name: str, mode: str) -> bool:
  """Whether method `name` can train with `--client_execution=mode`."""
  try:
    registry.check(*registry.resolve(name), client_execution=mode)
  except ValueError:
    return False
  return True


def can_be_attacked(name: str) -> bool:
  try:
    registry.check(*registry.resolve(name), corruption='omniscient')
  except ValueError:
    return False
  return True


def run_one(name: str, train_data, evaluator, build_keras, model_fn, num_rounds: int, seed: int,
            mode: str = client_execution.WORKER, hyperparameters: Optional[Hyperparameters] = None,
            attacked: Sequence[str] = ()):
  """`num_rounds` rounds of method `name`; with `attacked` clients, under the omniscient attack.

  Returns (rows, method).
  """
  hyperparameters = hyperparameters or Hyperparameters(_ALGORITHM_CONFIG, config_lib.AggregatorParams(), 'defaults')
  update_corruption = None if not attacked else corruption.UpdateCorruption(
      'omniscient', tuple(attacked), tuple(train_data.client_ids), seed)
  method = methods.build(model_fn, *registry.resolve(name), algorithm_config=hyperparameters.algorithm_config,
                         aggregator_params=hyperparameters.params, num_clients=len(train_data.client_ids),
                         metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize,
                         update_corruption=update_corruption, client_execution=mode)
  process = method.process
  state = round_loop.seeded_initial_state(process, build_keras, seed)  # Same start for every method.
  bar = progress.RoundProgress(num_rounds, label=f'{name} (omniscient)' if attacked else name)
  rows = []

  def evaluate_and_keep(done: round_loop.Round) -> None:
    row = {'round': done.number}
    row.update({f'test/{k}': v for k, v in evaluator(process.get_model_weights(done.state)).items()})
    row.update(done.row)
    rows.append(row)
    bar.update(done.number, acc=row['test/accuracy'])

  # Every client in every round.
  inputs = round_loop.ClientInputs(train_data, len(train_data.client_ids), _LOCAL_EPOCHS, _BATCH_SIZE, seed)
  round_loop.RoundLoop(method, state, inputs, after_round=(evaluate_and_keep,)).run(num_rounds)
  return rows, method


def _print_setup(names: Sequence[str], chosen: dict[str, Any], num_train: int, num_test: int,
                 attacked: Sequence[str], num_clients: int) -> None:
  """The header: the setup, each method's hyperparameters and where they came from, what the columns mean."""
  print(f'Digits ({num_train} train / {num_test} test), {FLAGS.partition}, '
        f'{FLAGS.num_clients} clients (all per round), {FLAGS.model} model, FedAvg (client SGD momentum '
        f'{_ALGORITHM_CONFIG.client_momentum}, {_LOCAL_EPOCHS} local epoch, batch {_BATCH_SIZE}), '
        f'{FLAGS.rounds} rounds, seed {FLAGS.seed}; client metrics through secure sums.')
  print('Hyperparameters per method:')
  for name in names:
    h = chosen[name]
    tau = f', tau {h.params.tau:g}' if _reads_tau(registry.resolve(name)[1]) else ''
    rates = h.algorithm_config
    print(f'  {name}: client lr {rates.client_lr:g}, server lr {rates.server_lr:g}{tau} ({h.source})')
  print(f'audit: the static audit of one round (PASS: client data reaches the server only through means and secure '
        f'sums). omniscient: test accuracy after {FLAGS.omniscient_rounds} rounds with {len(attacked)} of '
        f'{num_clients} clients ({CORRUPT_FRACTION:.0%}) sending the omniscient attack (a simulated '
        f'attacker that knows every honest update and turns the weighted mean into minus the honest mean).')


def _summarize(name: str, rows: list[dict[str, Any]], method: Any, omniscient: Optional[float], chosen: Any,
               start: float) -> dict[str, Any]:
  """One method's entry of summary.json (and row of the table); its seconds count from `start` (monotonic)."""
  accuracy = [r['test/accuracy'] for r in rows]
  report = audit.audit_computation(method.process)
  return {
      'description': registry.METHOD_DESCRIPTIONS.get(name, name),
      'final_accuracy': float(np.mean(accuracy[-5:])),
      'best_accuracy': float(np.max(accuracy)),
      'final_loss': rows[-1]['test/loss'],
      # FAIL names the intrinsics that reach the server otherwise (e.g. TFF's MeanFactory's plain federated_sum).
      'audit': (f"FAIL ({', '.join(sorted({v.intrinsic for v in report.violations}))})"
                if report.verdict == 'FAIL' else report.verdict),
      'audit_violations': [str(v) for v in report.violations],
      'omniscient_accuracy': omniscient,
      'hyperparameters': {'client_lr': chosen.algorithm_config.client_lr,
                          'server_lr': chosen.algorithm_config.server_lr, 'tau': chosen.params.tau,
                          'source': chosen.source},
      'seconds': time.monotonic() - start,
      'client_devices': method.client_devices(),  # Where its clients trained.
  }


def _write_metrics(out_dir: str, name: str, rows: list[dict[str, Any]]) -> None:
  keys = sorted({k for r in rows for k in r}, key=lambda k: (k != 'round', k))
  with open(os.path.join(out_dir, f'metrics_{name.replace("/", "-")}.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)


def _write_table(out_dir: str, summary: dict[str, dict[str, Any]]) -> None:
  """Prints the comparison table and writes it (comparison.md) with summary.json."""
  table = ['| aggregator | final acc. (mean of last 5 rounds) | best acc. | final loss | audit | '
           f'omniscient {CORRUPT_FRACTION:.0%} | time (s) |', '|---|---|---|---|---|---|---|']
  for name, s in summary.items():
    attacked_cell = 'n/a' if s['omniscient_accuracy'] is None else f"{s['omniscient_accuracy']:.4f}"
    table.append(f"| {name} | {s['final_accuracy']:.4f} | {s['best_accuracy']:.4f} | {s['final_loss']:.4f} | "
                 f"{s['audit']} | {attacked_cell} | {s['seconds']:.1f} |")
  print('\n' + '\n'.join(table))
  with open(os.path.join(out_dir, 'comparison.md'), 'w') as f:
    f.write('\n'.join(table) + '\n')
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    json.dump({'flags': flag_values, 'aggregators': summary}, f, indent=2)


def _methods_to_run(mode: str) -> list[str]:
  """--aggregators checked against the registry (one usage line if refused), or the defaults that run in `mode`."""
  names = FLAGS.aggregators or [m for m in DEFAULT_METHODS if runs_in(m, mode)]
  for name in names:
    try:
      registry.check(*registry.resolve(name), client_execution=mode)
    except ValueError as e:
      raise app.UsageError(f'--aggregators: {e}') from None
  left_out = [] if FLAGS.aggregators else [m for m in DEFAULT_METHODS if m not in names]
  if left_out:
    print(f'--client_execution={mode}: leaving out {", ".join(left_out)} (their client work runs only in the TFF '
          f'worker)')
  return names


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  command_line.check_output_dir(FLAGS.output_dir)  # Before the training, not after it.
  mode = FLAGS.client_execution
  names = _methods_to_run(mode)
  command_line.start_simulation()
  try:
    data = digits.federated_data(FLAGS.partition, FLAGS.num_clients, FLAGS.seed)
  except ValueError as e:  # What only the data can tell: more clients than examples.
    raise app.UsageError(f'invalid flags: {e}') from None
  train_data = data.train
  build_keras = models.keras_builder(FLAGS.model, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  evaluator = evaluation.CentralEvaluator(build_keras, data.test_x, data.test_y)
  out_dir = os.path.join(FLAGS.output_dir, datetime.datetime.now().strftime('%Y%m%d-%H%M%S'))
  os.makedirs(out_dir, exist_ok=True)

  num_train = sum(train_data.num_examples(c) for c in train_data.client_ids)
  is_study_setting = (FLAGS.partition, FLAGS.num_clients, FLAGS.model) == ('label_skew', 10, 'cnn')
  chosen = choose_hyperparameters(names, FLAGS.study_results, is_study_setting)
  attacked = corruption.corrupted_clients(train_data.client_ids, CORRUPT_FRACTION, FLAGS.seed)
  _print_setup(names, chosen, num_train, len(data.test_y), attacked, len(train_data.client_ids))
  summary = {}
  for name in names:
    start = time.monotonic()
    rows, method = run_one(name, train_data, evaluator, build_keras, model_fn, FLAGS.rounds, FLAGS.seed, mode,
                           chosen[name])
    omniscient = None
    if FLAGS.omniscient_rounds > 0 and can_be_attacked(name) and mode == client_execution.WORKER:
      attack_rows, _ = run_one(name, train_data, evaluator, build_keras, model_fn, FLAGS.omniscient_rounds,
                               FLAGS.seed, mode, chosen[name], attacked)
      omniscient = attack_rows[-1]['test/accuracy']
    summary[name] = _summarize(name, rows, method, omniscient, chosen[name], start)
    _write_metrics(out_dir, name, rows)
  _write_table(out_dir, summary)
  print(f'\nFull outputs (per-round metrics CSV, summary.json, comparison.md): {os.path.abspath(out_dir)}')

if __name__ == '__main__':
  define_flags()
  command_line.run(main)
