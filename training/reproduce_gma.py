"""AVG vs GMA for FedAvg, FedProx, FedAdam and FedYogi on the embedded digits (GMA paper, Tables 2-3).

    python -m training.reproduce_gma [--seeds=0,1,2] [--rounds=30] [--output_dir=outputs/reproduce_gma]

For each partition (label skew and feature skew by default), algorithm, aggregator (mean, gma) and seed, one run
of the experiment runner (`training.experiment`, so every run has its own metrics, checkpoints and summary under
--output_dir, and an interrupted study resumes). Writes `results.md` (mean +- std over seeds of the final
accuracy, i.e. the mean over the last 10 evaluated rounds; OOD accuracy for feature skew), `results.json` and
`results.png`.
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import dataclasses  # pylint: disable=g-import-not-at-top
import itertools
import json

from absl import app
from absl import flags
from absl import logging
import numpy as np

from tff_gma import runtime
from training import experiment
from training import registry

_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (runs per cell).')
_ROUNDS = flags.DEFINE_integer('rounds', 30, 'Rounds per run.')
_PARTITIONS = flags.DEFINE_list('partitions', ['label_skew', 'feature_skew'], 'Partitions of the digits.')
_ALGORITHMS = flags.DEFINE_list('algorithms', ['fedavg', 'fedprox', 'fedadam', 'fedyogi'], 'Algorithms.')
_AGGREGATORS = flags.DEFINE_list('aggregators', ['mean', 'gma'], 'Aggregators compared.')
_MODEL = flags.DEFINE_string('model', 'cnn', 'Model.')
_NUM_CLIENTS = flags.DEFINE_integer('num_clients', 10, 'Clients, all taking part in every round.')
_TAU = flags.DEFINE_float('tau', registry.AggregatorParams.tau, 'GMA threshold (paper: 0.4).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', 'outputs/reproduce_gma', 'Where runs and results go.')

# The same learning rates for AVG and GMA of one algorithm, as the paper tunes them (App. C.4: "the same
# combination was giving the best performance for GMA and AVG versions of the same algorithm").
SERVER_LR = {'fedavg': 1.0, 'fedprox': 1.0, 'fedadam': 0.01, 'fedyogi': 0.01}
CLIENT_LR = 0.05


def cell_config(partition: str, algorithm: str, aggregator: str, seed: int, rounds: int, model: str,
                num_clients: int, tau: float, output_dir: str) -> experiment.ExperimentConfig:
  return experiment.ExperimentConfig(
      dataset='digits', partition=partition, classes_per_client=2, num_clients=num_clients,
      clients_per_round=num_clients, rounds=rounds, local_epochs=1, batch_size=16, model=model,
      algorithm=algorithm, client_lr=CLIENT_LR, server_lr=SERVER_LR[algorithm], aggregator=aggregator, tau=tau,
      seed=seed, output_dir=os.path.join(output_dir, f'{partition}-{algorithm}-{aggregator}-seed{seed}'))


def summarize(results: list[dict]) -> str:
  """Markdown table: rows algorithm x aggregator, columns partitions, cells mean +- std over seeds."""
  partitions = list(dict.fromkeys(r['partition'] for r in results))
  metric = lambda p: 'final_ood_accuracy' if any('final_ood_accuracy' in r for r in results
                                                 if r['partition'] == p) else 'final_accuracy'
  header = '| algorithm | aggregator | ' + ' | '.join(
      f'{p} ({"OOD test" if metric(p) == "final_ood_accuracy" else "test"})' for p in partitions) + ' |'
  lines = [header, '|---|---|' + '---|' * len(partitions)]
  for algorithm, aggregator in dict.fromkeys((r['algorithm'], r['aggregator']) for r in results):
    cells = []
    for p in partitions:
      values = [100 * r[metric(p)] for r in results
                if (r['algorithm'], r['aggregator'], r['partition']) == (algorithm, aggregator, p)]
      cells.append(f'{np.mean(values):.2f} +- {np.std(values):.2f} (n={len(values)})' if values else '-')
    lines.append(f'| {algorithm} | {aggregator} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def plot(results: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  partitions = list(dict.fromkeys(r['partition'] for r in results))
  fig, axes = plt.subplots(1, len(partitions), figsize=(5 * len(partitions), 3.5), squeeze=False)
  for ax, p in zip(axes[0], partitions):
    cells = list(dict.fromkeys((r['algorithm'], r['aggregator']) for r in results if r['partition'] == p))
    key = 'final_ood_accuracy' if any('final_ood_accuracy' in r for r in results if r['partition'] == p) \
        else 'final_accuracy'
    means = [np.mean([r[key] for r in results if (r['algorithm'], r['aggregator'], r['partition']) == (*c, p)])
             for c in cells]
    stds = [np.std([r[key] for r in results if (r['algorithm'], r['aggregator'], r['partition']) == (*c, p)])
            for c in cells]
    ax.bar(range(len(cells)), means, yerr=stds, color=['C0' if c[1] == 'mean' else 'C1' for c in cells])
    ax.set_xticks(range(len(cells)), [f'{a}\n{g}' for a, g in cells], fontsize=7)
    ax.set_ylabel('OOD accuracy' if key == 'final_ood_accuracy' else 'test accuracy')
    ax.set_title(f'digits, {p}')
    ax.set_ylim(0, 1)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  runtime.set_simulation_context()
  results = []
  seeds = [int(s) for s in _SEEDS.value]
  cells = list(itertools.product(_PARTITIONS.value, _ALGORITHMS.value, _AGGREGATORS.value, seeds))
  for i, (partition, algorithm, aggregator, seed) in enumerate(cells, 1):
    config = cell_config(partition, algorithm, aggregator, seed, _ROUNDS.value, _MODEL.value, _NUM_CLIENTS.value,
                         _TAU.value, _OUTPUT_DIR.value)
    print(f'[{i}/{len(cells)}] {partition} {algorithm} {aggregator} seed {seed}', flush=True)
    summary = experiment.run(config, show_progress=False).summary
    results.append({'partition': partition, 'algorithm': algorithm, 'aggregator': aggregator, 'seed': seed,
                    **{k: v for k, v in summary.items() if k.startswith('final_') or k == 'best_accuracy'}})
  table = summarize(results)
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  with open(os.path.join(_OUTPUT_DIR.value, 'results.md'), 'w') as f:
    f.write(f'Digits, {_NUM_CLIENTS.value} clients (full participation), {_MODEL.value}, {_ROUNDS.value} rounds, '
            f'seeds {seeds}, tau {_TAU.value}; final accuracy (%) = mean over the last 10 evaluated rounds.\n\n')
    f.write(table + '\n')
  with open(os.path.join(_OUTPUT_DIR.value, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2)
  plot(results, os.path.join(_OUTPUT_DIR.value, 'results.png'))
  print(table)
  print(f'Results: {os.path.abspath(_OUTPUT_DIR.value)}/results.md')


if __name__ == '__main__':
  app.run(main)
