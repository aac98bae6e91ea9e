"""Membership inference against FedAvg with mean vs GMA aggregation on the embedded digits (GMA paper, App. F).

    python -m training.studies.membership [--seeds=0,1,2] [--rounds=30] [--model=cnn] [--output_dir=...]

One runner run per aggregator (mean, gma) and seed, then a logistic-regression attacker on the final model's outputs
for members and non-members; writes results.md, results.json. Protocol: docs/research/results.md"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

from typing import Any  # pylint: disable=g-import-not-at-top

from absl import app
from absl import flags
from absl import logging
import numpy as np

from tff_gma import models
from training import command_line
from training import config as config_lib
from training.engine import evaluation
from training.engine import membership_attack
from training.runner import experiment
from training.runner import run_setup
from training.studies.shared import report

_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (one run per aggregator and seed).')
_ROUNDS = flags.DEFINE_integer('rounds', 30, 'Rounds per run.')
_AGGREGATORS = flags.DEFINE_list('aggregators', ['mean', 'gma'], 'Aggregators compared.')
_MODEL = flags.DEFINE_string('model', 'cnn', 'Model.')
_PARTITION = flags.DEFINE_string('partition', 'label_skew', 'Partition of the digits.')
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', 10, 'Clients, all taking part in every round.')
_LOCAL_EPOCHS = flags.DEFINE_integer('local_epochs', 1, 'Local epochs per round (more: more overfitting).')
_CLIENT_LR = flags.DEFINE_float('client_lr', 0.05, 'Client learning rate.')
_TAU = flags.DEFINE_float('tau', config_lib.AggregatorParams.tau, 'GMA threshold (paper: 0.4).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', 'outputs/membership_inference', 'Where runs and results go.')

FEATURE_SETS = ('logits', 'all')  # The paper's attacker input, and the strongest of `membership_attack.FEATURES`.


def run_config(aggregator: str, seed: int) -> config_lib.ExperimentConfig:
  return config_lib.ExperimentConfig(
      dataset='digits', partition=_PARTITION.value, num_clients=_NUM_CLIENTS.value,
      clients_per_round=_NUM_CLIENTS.value, rounds=_ROUNDS.value, local_epochs=_LOCAL_EPOCHS.value,
      batch_size=16, model=_MODEL.value, algorithm='fedavg', client_lr=_CLIENT_LR.value, server_lr=1.0,
      aggregator=aggregator, tau=_TAU.value, seed=seed,
      output_dir=os.path.join(_OUTPUT_DIR.value, f'{_PARTITION.value}-{aggregator}-seed{seed}'))


def attack_run(config: config_lib.ExperimentConfig) -> dict[str, Any]:
  """Trains (or resumes) the run and attacks its final model."""
  weights = experiment.run(config, show_progress=False).model_weights
  data = run_setup.load_data(config)
  build_keras = models.keras_builder(config.model, data.input_shape, data.num_classes)
  evaluator = evaluation.CentralEvaluator(build_keras, data.test_x, data.test_y)
  xs, ys = zip(*(data.train.client_arrays(c) for c in data.train.client_ids))  # All clients trained every round.
  member_x, member_y = np.concatenate(xs), np.concatenate(ys)
  member_logits = evaluator.logits(weights, member_x)
  nonmember_logits = evaluator.logits(weights, data.test_x)
  result = {'aggregator': config.aggregator, 'seed': config.seed,
            'train_accuracy': float(np.mean(np.argmax(member_logits, 1) == member_y)),
            'test_accuracy': float(np.mean(np.argmax(nonmember_logits, 1) == data.test_y)),
            'num_members': len(member_y), 'num_nonmembers': len(data.test_y)}
  for features in FEATURE_SETS:
    attack = membership_attack.membership_attack(member_logits, member_y, nonmember_logits, data.test_y,
                                          seed=config.seed, features=features)
    result[features] = attack
  return result


def _cell(values: list[float], scale: float = 100.0) -> str:
  return f'{scale * np.mean(values):.1f} +- {scale * np.std(values):.1f}'


def summarize(results: list[dict[str, Any]]) -> str:
  """Markdown table: one row per aggregator, mean +- std over seeds (percentages)."""
  lines = ['| aggregator | seeds | attack acc., logits (%) | attack acc., all features (%) | attack AUC, all (%) '
           '| gap attack (%) | train acc. (%) | test acc. (%) |',
           '|---|---|---|---|---|---|---|---|']
  for aggregator in dict.fromkeys(r['aggregator'] for r in results):
    rows = [r for r in results if r['aggregator'] == aggregator]
    lines.append(
        f'| {aggregator} | {len(rows)} | {_cell([r["logits"]["attack_accuracy"] for r in rows])} '
        f'| {_cell([r["all"]["attack_accuracy"] for r in rows])} | {_cell([r["all"]["attack_auc"] for r in rows])} '
        f'| {_cell([r["all"]["gap_attack_accuracy"] for r in rows])} '
        f'| {_cell([r["train_accuracy"] for r in rows])} | {_cell([r["test_accuracy"] for r in rows])} |')
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  try:
    seeds = [int(s) for s in _SEEDS.value]
    cells = [(a, s) for s in seeds for a in _AGGREGATORS.value]
    for aggregator, seed in cells:  # Every run is checked (its output directory too) before anything runs.
      experiment.validate(run_config(aggregator, seed))
  except ValueError as e:
    raise app.UsageError(f'invalid study settings: {e}') from e
  command_line.start_simulation()
  results = []
  for i, (aggregator, seed) in enumerate(cells, 1):
    print(f'[{i}/{len(cells)}] {aggregator} seed {seed}', flush=True)
    results.append(attack_run(run_config(aggregator, seed)))
  table = summarize(results)
  n = results[0]['logits']['num_per_kind']
  header = (
      f'Membership inference (GMA paper, App. F) on the digits, {_PARTITION.value}, {_NUM_CLIENTS.value} clients '
      f'(full participation), FedAvg, {_MODEL.value}, {_ROUNDS.value} rounds x {_LOCAL_EPOCHS.value} local '
      f'epoch(s), seeds {seeds}, tau {_TAU.value}.\n\n'
      f'Attacker: logistic regression on the final model\'s outputs, {n} members (training examples) and {n} '
      f'non-members (test split) per run, trained on one half and tested on the other, both ways (2-fold). '
      f'50% = chance (no leakage). "logits": the paper\'s input; "all": logits, sorted softmax probabilities and '
      f'the example\'s loss. Gap attack: "member" iff correctly classified. Accuracies of the final model. '
      f'Mean +- std over seeds; the binomial standard error of one run\'s attack accuracy is about '
      f'{100 * np.sqrt(0.25 / (2 * n)):.1f} points.\n\n')
  report.write_report(_OUTPUT_DIR.value, header + table + '\n', results, indent=2)
  print(table)
  print(f'Results: {os.path.abspath(_OUTPUT_DIR.value)}/results.md')


if __name__ == '__main__':
  command_line.run(main, command_line.STUDY_RESUMES)
