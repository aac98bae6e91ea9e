"""The experiment runner.

    python -m training.run --flagfile=configs/<name>.flags [--flag=value ...]

Trains one federated experiment (see `training.experiment` for what is written to --output_dir). Rerunning the
same command resumes from the last completed round; a larger --rounds continues training. Unknown flags and
inconsistent settings fail before any training, naming the flag (`invalid flags: ...`, exit 1, nothing written).
An --output_dir that another run holds, or whose checkpoints are all damaged, fails in one line (`error: ...`,
exit 1). Ctrl-C ends with one line saying after which round the run stopped and the command that resumes it
(exit 130).
"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import dataclasses  # pylint: disable=g-import-not-at-top
import json
import shlex
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from tff_gma import models
from tff_gma import runtime
from tff_gma.data import loaders
from training import checkpoints
from training import client_execution
from training import corruption
from training import experiment

_D = experiment.ExperimentConfig()
_ALL_PARTITIONS = sorted({p for d in loaders.DATASETS for p in loaders.supported_partitions(d)})

flags.DEFINE_enum('dataset', _D.dataset, list(loaders.DATASETS), 'Data set (digits is embedded and offline).')
flags.DEFINE_string('data_dir', _D.data_dir, 'Where TFDS/TFF data sets are (or are downloaded to).')
flags.DEFINE_enum('partition', _D.partition, _ALL_PARTITIONS, 'How training examples are dealt to clients.')
flags.DEFINE_integer('classes_per_client', _D.classes_per_client, 'label_skew/mixed_skew: classes per client.')
flags.DEFINE_float('alpha', _D.alpha, 'dirichlet: label concentration (smaller = more skew).')
flags.DEFINE_float('beta', _D.beta, 'quantity_skew: size concentration (paper: 0.5).')
flags.DEFINE_integer('num_clients', _D.num_clients, 'Clients in the federation.')
flags.DEFINE_integer('clients_per_round', _D.clients_per_round, 'Clients sampled per round.')
flags.DEFINE_integer('rounds', _D.rounds, 'Total rounds (a resumed run continues up to this).')
flags.DEFINE_integer('local_epochs', _D.local_epochs, 'Client epochs per round.')
flags.DEFINE_integer('batch_size', _D.batch_size, 'Client batch size.')
flags.DEFINE_enum('model', _D.model, list(models.MODELS), 'Keras model.')
flags.DEFINE_enum('algorithm', _D.algorithm, list(experiment.ALGORITHMS),
                  'Federated optimisation algorithm (personalized: personalized RFA, RFA paper Algorithm 4, with '
                  '--aggregator=rfa).')
flags.DEFINE_float('client_lr', _D.client_lr, 'Client SGD learning rate (momentum --client_momentum).')
flags.DEFINE_float('server_lr', _D.server_lr, 'Server learning rate (SGD, or Adam/Yogi for fedadam/fedyogi).')
flags.DEFINE_float('client_momentum', _D.client_momentum, 'Client SGD momentum (GMA paper: 0.9).')
flags.DEFINE_float('proximal_strength', _D.proximal_strength, 'fedprox: proximal term mu.')
flags.DEFINE_float('adaptive_epsilon', _D.adaptive_epsilon, 'fedadam/fedyogi: epsilon (adaptivity tau).')
flags.DEFINE_enum('aggregator', _D.aggregator, list(experiment.AGGREGATORS), 'How client updates are aggregated.')
flags.DEFINE_float('tau', _D.tau, 'gma/gma_binary: agreement threshold in [0, 1] (paper: 0.4).')
flags.DEFINE_integer('num_passes', _D.num_passes, 'rfa: secure averages per round (paper: 3).')
flags.DEFINE_float('smoothing', _D.smoothing, 'rfa/rfa_one_step: Weiszfeld smoothing nu.')
flags.DEFINE_enum('rfa_init', _D.rfa_init, ['mean', 'zero'],
                  'rfa: where Weiszfeld starts: the weighted mean (RFA paper) or the zero update (the current '
                  'model; pass 1 is then one-step RFA).')
flags.DEFINE_bool('secure', _D.secure, 'Aggregate the float sums through secure sums too.')
flags.DEFINE_float('secure_bound', _D.secure_bound,
                   'Per-coordinate clipping bound of secure float sums (required with --secure).')
flags.DEFINE_bool('secure_metrics', _D.secure_metrics, 'Aggregate training metrics with secure sums.')
flags.DEFINE_integer('eval_every', _D.eval_every, 'Evaluate every this many rounds (and at the last).')
flags.DEFINE_float('validation_fraction', _D.validation_fraction,
                   'In [0, 1). > 0: each client holds out this share of its examples (seeded); evaluations are on '
                   'the pooled held-out examples (validation/*) and never on the test split, for tuning.')
flags.DEFINE_integer('seed', _D.seed, 'Seed of the partition, initial model, client sampling and data order.')
flags.DEFINE_string('output_dir', _D.output_dir, 'Output directory (reused to resume).')
flags.DEFINE_string('workers', _D.workers, 'host:port,... (or unix:/path,...) of TFF workers to split clients over (python -m tff_gma.worker).')
flags.DEFINE_enum('client_execution', _D.client_execution, list(client_execution.MODES),
                  'Where clients train: worker (the TFF worker, CPU only) or local (this process\'s TensorFlow: '
                  'its GPUs round-robin, else its CPU; aggregation stays in the worker; FedAvg family only).')
flags.DEFINE_float('rfa_weight_bound', _D.rfa_weight_bound,
                   'rfa: warn when one client\'s normalized RFA weight exceeds this (simulation-only audit; logs '
                   'rfa_audit/* per round; trains the round\'s clients twice).')
flags.DEFINE_bool('membership_inference', _D.membership_inference,
                  'Attack the final model with a membership-inference attacker; writes membership.json.')
flags.DEFINE_bool('audit', _D.audit, 'Write audit.md: the privacy audit of the round computation.')
flags.DEFINE_enum('corruption', _D.corruption, list(corruption.CORRUPTIONS),
                  'Simulated corruption of a fixed seeded set of clients: poisoned data (data_negate: x -> 1 - x; '
                  'data_flip_labels: y -> C - 1 - y) or updates (gaussian noise; omniscient: the mean negated).')
flags.DEFINE_float('corrupt_fraction', _D.corrupt_fraction,
                   'rho: round(rho * num_clients) clients are corrupted (trimmed_mean and krum are told rho).')

FLAGS = flags.FLAGS


def config_from_flags() -> experiment.ExperimentConfig:
  return experiment.ExperimentConfig(**{f.name: FLAGS[f.name].value
                                        for f in dataclasses.fields(experiment.ExperimentConfig)})


def interrupted_message(config: experiment.ExperimentConfig, args: list[str]) -> str:
  """`interrupted after round N of R; resume with: python -m training.run <args>` (N: the last checkpoint)."""
  saved = checkpoints.saved_rounds(config.output_dir)
  done = max(saved, default=0)
  if done >= config.rounds:
    where = f'after round {done} of {config.rounds}, before summary.json was written'
  elif done > 0:
    where = f'after round {done} of {config.rounds}'
  else:
    where = f'before round 1 of {config.rounds} completed'
  command = ' '.join(['python -m training.run'] + [shlex.quote(a) for a in args])
  return f'interrupted {where}; resume with: {command}'


def _stop_quietly(message: str) -> None:
  """After Ctrl-C: one line, the workers stopped without their noise, exit 130 (no traceback)."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # A second Ctrl-C does not interrupt the shutdown.
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  # The round's computation may still be in flight on the worker: stopping the worker makes that call fail in
  # TFF's background thread, and nothing said after our line helps, so stderr is silenced from here on.
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  try:
    runtime.stop_all_workers()
  except Exception:  # pylint: disable=broad-except  # Exiting anyway; the atexit hook tries again.
    pass
  sys.exit(130)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  config = config_from_flags()
  try:
    if config.workers is None:
      runtime.set_simulation_context()
    summary = experiment.run(config).summary  # Checks every setting first, before anything is written.
  except experiment.ConfigError as e:
    raise app.UsageError(f'invalid flags: {e}') from e
  except (experiment.DirectoryLockedError, experiment.CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)
  except KeyboardInterrupt:
    _stop_quietly(interrupted_message(config, sys.argv[1:]))
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
  print(f'Outputs: {os.path.abspath(config.output_dir)}')


if __name__ == '__main__':
  app.run(main)
