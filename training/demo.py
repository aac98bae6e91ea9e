"""The demo: plain averaging and every aggregator on the embedded digits, clean and under the omniscient attack.

    python -m training.demo [--rounds=6] [--corrupt_fraction=0.4] [--client_execution=local]

Its defaults are a setting where the RFA paper's guarantee applies: 10 IID clients, all in every round, 3 local
epochs, and 4 of them (40%, fewer than half) sending the omniscient attack. Each method trains twice from the same
start, clean and attacked; the table puts both accuracies after the same round beside the method's privacy audit,
and one line under it says which methods hold and, where RFA does not, why. Setup: docs/research/results.md#the-demo
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import csv  # pylint: disable=g-import-not-at-top
import datetime
import functools
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
  flags.DEFINE_integer('rounds', 6, 'Rounds per run: the clean and the attacked accuracy are both after the last.',
                       lower_bound=1)
  flags.DEFINE_integer('num_clients', 10, 'Clients (all take part in every round).', lower_bound=1)
  flags.DEFINE_enum('partition', 'iid', list(digits.PARTITIONS), 'How the digits are split.')
  flags.DEFINE_integer('local_epochs', 3, 'Client epochs per round.', lower_bound=1)
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
      'study_results', os.path.join(_ROOT, 'docs', 'research', 'gma_study.json'),
      'The GMA study\'s results.json: the hyperparameters it chose per setting and method, used in its label10 '
      'setting (--partition=label_skew --local_epochs=1, 10 clients, cnn).')
  flags.DEFINE_float('corrupt_fraction', 0.4, 'Share of the clients that send the omniscient attack in each method\'s '
                     'attacked run, in [0, 1) (0: no attacked runs).')


# The project's private aggregators and methods (the non-private robust baselines of the RFA study are left out:
# they are study baselines, run them with --aggregators).
DEFAULT_METHODS = registry.method_names(registry.DEMO)
_ALGORITHM_CONFIG = config_lib.AlgorithmConfig()
_BATCH_SIZE = config_lib.ExperimentConfig.batch_size
STUDY_SETTING = 'label10'  # The GMA study's setting whose hyperparameters the demo takes there.
STUDY_SETUP = ('label_skew', 10, 'cnn', 1)  # label10 as the demo's (partition, num_clients, model, local_epochs).
ATTACK = 'omniscient'
# A method holds when its attacked accuracy is at most this far below its clean one (same round).
HOLDS_WITHIN = 0.10
RFA_AGGREGATORS = ('rfa', 'rfa_one_step')  # Whose guarantee the summary line explains when they fall.


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


def can_be_attacked(name: str, mode: str = client_execution.WORKER) -> bool:
  """Whether method `name` can run under the omniscient attack with `--client_execution=mode`."""
  try:
    registry.check(*registry.resolve(name), corruption=ATTACK, client_execution=mode)
  except ValueError:
    return False
  return True


def run_one(name: str, train_data, evaluator, build_keras, model_fn, num_rounds: int, seed: int,
            mode: str = client_execution.WORKER, hyperparameters: Optional[Hyperparameters] = None,
            attacked: Sequence[str] = (), local_epochs: int = 1):
  """`num_rounds` rounds of method `name`; with `attacked` clients, under the omniscient attack.

  Returns (rows, method).
  """
  hyperparameters = hyperparameters or Hyperparameters(_ALGORITHM_CONFIG, config_lib.AggregatorParams(), 'defaults')
  update_corruption = None if not attacked else corruption.UpdateCorruption(
      ATTACK, tuple(attacked), tuple(train_data.client_ids), seed)
  method = methods.build(model_fn, *registry.resolve(name), algorithm_config=hyperparameters.algorithm_config,
                         aggregator_params=hyperparameters.params, num_clients=len(train_data.client_ids),
                         metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize,
                         update_corruption=update_corruption, client_execution=mode)
  process = method.process
  state = round_loop.seeded_initial_state(process, build_keras, seed)  # Same start for every method.
  bar = progress.RoundProgress(num_rounds, label=f'{name} (attacked)' if attacked else name)
  rows = []

  def evaluate_and_keep(done: round_loop.Round) -> None:
    row = {'round': done.number}
    row.update({f'test/{k}': v for k, v in evaluator(process.get_model_weights(done.state)).items()})
    row.update(done.row)
    rows.append(row)
    bar.update(done.number, acc=row['test/accuracy'])

  # Every client in every round.
  inputs = round_loop.ClientInputs(train_data, len(train_data.client_ids), local_epochs, _BATCH_SIZE, seed)
  round_loop.RoundLoop(method, state, inputs, after_round=(evaluate_and_keep,)).run(num_rounds)
  return rows, method


def _print_setup(names: Sequence[str], chosen: dict[str, Any], num_train: int, num_test: int,
                 attacked: Sequence[str], num_clients: int) -> None:
  """The header: the setup, the methods' hyperparameters and where they came from, what the columns mean."""
  epochs = FLAGS.local_epochs
  print(f'Digits ({num_train} train / {num_test} test), {FLAGS.partition}, {num_clients} clients (all per round), '
        f'{FLAGS.model} model, FedAvg (client SGD momentum {_ALGORITHM_CONFIG.client_momentum}, {epochs} local '
        f'epoch{"s" if epochs != 1 else ""}, batch {_BATCH_SIZE}), {FLAGS.rounds} rounds, seed {FLAGS.seed}; client '
        f'metrics through secure sums.')
  groups: dict[str, list[str]] = {}  # Methods with the same hyperparameters share a line.
  for name in names:
    h = chosen[name]
    tau = f', tau {h.params.tau:g}' if _reads_tau(registry.resolve(name)[1]) else ''
    rates = h.algorithm_config
    groups.setdefault(f'client lr {rates.client_lr:g}, server lr {rates.server_lr:g}{tau} ({h.source})',
                      []).append(name)
  print('Hyperparameters:')
  for line, group in groups.items():
    print(f'  {", ".join(group)}: {line}')
  attack = (f', then again with {len(attacked)} of {num_clients} clients ({len(attacked) / num_clients:.0%}) '
            f'sending the omniscient attack (a simulated attacker that knows every honest update and turns the '
            f'weighted mean into minus the honest mean)') if attacked else ''
  print(f'Each method trains from the same start, clean{attack}. audit: the static audit of one round (PASS: client '
        f'data reaches the server only through means and secure sums).')


def _summarize(name: str, rows: list[dict[str, Any]], attack_rows: Optional[list[dict[str, Any]]], method: Any,
               chosen: Any, start: float) -> dict[str, Any]:
  """One method's entry of summary.json (and row of the table); its seconds count from `start` (monotonic)."""
  accuracy = [float(r['test/accuracy']) for r in rows]
  report = audit.audit_computation(method.process)
  return {
      'description': registry.METHOD_DESCRIPTIONS.get(name, name),
      'round': rows[-1]['round'],  # The round of both accuracies.
      'clean_accuracy': accuracy[-1],
      'attacked_round': None if attack_rows is None else attack_rows[-1]['round'],
      'attacked_accuracy': None if attack_rows is None else float(attack_rows[-1]['test/accuracy']),
      'best_accuracy': float(np.max(accuracy)),
      'final_loss': float(rows[-1]['test/loss']),
      # FAIL names the intrinsics that reach the server otherwise (e.g. TFF's MeanFactory's plain federated_sum).
      'audit': (f"FAIL ({', '.join(sorted({v.intrinsic for v in report.violations}))})"
                if report.verdict == 'FAIL' else report.verdict),
      'audit_violations': [str(v) for v in report.violations],
      'hyperparameters': {'client_lr': chosen.algorithm_config.client_lr,
                          'server_lr': chosen.algorithm_config.server_lr, 'tau': chosen.params.tau,
                          'source': chosen.source},
      'seconds': time.monotonic() - start,  # Both runs.
      'client_devices': method.client_devices(),  # Where its clients trained.
  }


def _write_metrics(out_dir: str, name: str, rows: list[dict[str, Any]]) -> None:
  keys = sorted({k for r in rows for k in r}, key=lambda k: (k != 'round', k))
  with open(os.path.join(out_dir, f'metrics_{name.replace("/", "-")}.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)


def table_lines(summary: dict[str, dict[str, Any]], rounds: int) -> list[str]:
  """The comparison table: per method, its clean and its attacked accuracy after round `rounds`, and its audit."""
  lines = [f'| method | clean acc. (round {rounds}) | attacked acc. (round {rounds}) | audit |', '|---|---|---|---|']
  for name, s in summary.items():
    if s['round'] != rounds or s['attacked_round'] not in (None, rounds):
      raise ValueError(f'{name}: accuracies after rounds {s["round"]} and {s["attacked_round"]}, not {rounds}')
    attacked = 'n/a' if s['attacked_accuracy'] is None else f"{s['attacked_accuracy']:.4f}"
    lines.append(f"| {name} | {s['clean_accuracy']:.4f} | {attacked} | {s['audit']} |")
  return lines


def no_attack_reason(names: Sequence[str], mode: str, corrupt_fraction: float, num_attacked: int,
                     num_clients: int) -> Optional[str]:
  """Why there are no attacked runs (the summary line), or None when there are."""
  if corrupt_fraction == 0:
    return '--corrupt_fraction=0: no attacked runs.'
  if num_attacked == 0:
    return f'--corrupt_fraction={corrupt_fraction:g} of {num_clients} clients is none of them: no attacked runs.'
  if not any(can_be_attacked(name, mode) for name in names):
    if any(can_be_attacked(name) for name in names):
      return (f'--client_execution={mode}: the omniscient attack corrupts the updates inside the TFF worker\'s '
              f'client work, which this mode does not run: no attacked runs.')
    return ('None of these methods can run under the omniscient attack (their client work is their own): no '
            'attacked runs.')
  return None


def _why_rfa_falls(num_attacked: int, num_clients: int, partition: str) -> str:
  if 2 * num_attacked >= num_clients:
    return f"its guarantee needs fewer than half of the clients corrupt, and here {num_attacked} of {num_clients} are"
  if partition != 'iid':
    return (f"on {partition} clients the honest updates differ widely, and the geometric median's error grows with "
            f'their spread')
  return ("the honest updates spread too widely here for the geometric median (its error grows with their spread; "
          'more local epochs narrow it)')


def summary_line(summary: dict[str, dict[str, Any]], rounds: int, num_attacked: int, num_clients: int,
                 partition: str, chance: float) -> str:
  """One line on what the table shows: which attacked methods hold, which fall, and why RFA falls where it does.

  A method whose clean accuracy is within `HOLDS_WITHIN` of `chance` has learned nothing to hold: said apart.
  """
  attacked = {name: s for name, s in summary.items() if s['attacked_accuracy'] is not None}
  untrained = [name for name, s in attacked.items() if s['clean_accuracy'] - chance <= HOLDS_WITHIN]
  drops = {name: s['clean_accuracy'] - s['attacked_accuracy'] for name, s in attacked.items() if name not in untrained}
  hold = [name for name, drop in drops.items() if drop <= HOLDS_WITHIN]
  fall = [name for name in drops if name not in hold]
  share = f'{num_attacked / num_clients:.0%}' + (', under half' if 2 * num_attacked < num_clients else '')
  parts = []
  if hold:
    parts.append(f'{", ".join(hold)} hold{"s" if len(hold) == 1 else ""} (within {HOLDS_WITHIN * 100:.0f} points '
                 f'of clean)')
  if fall:
    points = sorted(round(drops[name] * 100) for name in fall)
    span = f'{points[0]}' if points[0] == points[-1] else f'{points[0]}-{points[-1]}'
    parts.append(f'{", ".join(fall)} fall{"s" if len(fall) == 1 else ""} by {span} points')
  if untrained:
    parts.append(f'{", ".join(untrained)} {"is" if len(untrained) == 1 else "are"} within '
                 f'{HOLDS_WITHIN * 100:.0f} points of chance even clean')
  line = f'Round {rounds}, {num_attacked} of {num_clients} clients ({share}) attacking: {"; ".join(parts)}.'
  if any(registry.resolve(name)[1] in RFA_AGGREGATORS for name in fall):
    line += f' RFA falls because {_why_rfa_falls(num_attacked, num_clients, partition)}.'
  return line


def _write_outputs(out_dir: str, summary: dict[str, dict[str, Any]], line: str, attacked: Sequence[str],
                   num_clients: int) -> None:
  """Prints the comparison table and its summary line, and writes them (comparison.md) with summary.json."""
  table = table_lines(summary, FLAGS.rounds)
  print('\n' + '\n'.join(table) + '\n' + line)
  with open(os.path.join(out_dir, 'comparison.md'), 'w') as f:
    f.write('\n'.join(table) + '\n\n' + line + '\n')
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
    json.dump({'flags': flag_values, 'attack': {'kind': ATTACK, 'corrupted': list(attacked),
                                                'fraction': len(attacked) / num_clients},
               'summary_line': line, 'aggregators': summary}, f, indent=2)


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
  try:
    corruption.num_corrupted(FLAGS.num_clients, FLAGS.corrupt_fraction)
  except ValueError as e:
    raise app.UsageError(f'invalid flags: {e}') from None
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
  num_clients = len(train_data.client_ids)
  build_keras = models.keras_builder(FLAGS.model, data.input_shape, data.num_classes)
  model_fn = models.model_fn(build_keras, data.input_spec)
  evaluator = evaluation.CentralEvaluator(build_keras, data.test_x, data.test_y)
  out_dir = os.path.join(FLAGS.output_dir, datetime.datetime.now().strftime('%Y%m%d-%H%M%S'))
  os.makedirs(out_dir, exist_ok=True)

  num_train = sum(train_data.num_examples(c) for c in train_data.client_ids)
  is_study_setting = (FLAGS.partition, FLAGS.num_clients, FLAGS.model, FLAGS.local_epochs) == STUDY_SETUP
  chosen = choose_hyperparameters(names, FLAGS.study_results, is_study_setting)
  attacked = corruption.corrupted_clients(train_data.client_ids, FLAGS.corrupt_fraction, FLAGS.seed)
  no_attack = no_attack_reason(names, mode, FLAGS.corrupt_fraction, len(attacked), num_clients)
  if no_attack:
    attacked = []
  _print_setup(names, chosen, num_train, len(data.test_y), attacked, num_clients)
  summary = {}
  for name in names:
    start = time.monotonic()
    run = functools.partial(run_one, name, train_data, evaluator, build_keras, model_fn, FLAGS.rounds, FLAGS.seed,
                            mode, chosen[name], local_epochs=FLAGS.local_epochs)
    rows, method = run()
    _write_metrics(out_dir, name, rows)
    attack_rows = None
    if attacked and can_be_attacked(name, mode):  # The same rounds from the same start, under the attack.
      attack_rows, _ = run(attacked=attacked)
      _write_metrics(out_dir, f'{name}_attacked', attack_rows)
    summary[name] = _summarize(name, rows, attack_rows, method, chosen[name], start)
  line = no_attack or summary_line(summary, FLAGS.rounds, len(attacked), num_clients, FLAGS.partition,
                                   1 / data.num_classes)
  _write_outputs(out_dir, summary, line, attacked, num_clients)
  print(f'\nFull outputs (per-round metrics CSV, summary.json, comparison.md): {os.path.abspath(out_dir)}')


if __name__ == '__main__':
  define_flags()
  command_line.run(main)
