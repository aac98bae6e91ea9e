"""The experiment runner: `python -m training.run --flagfile=configs/<name>.flags [--flag=value ...]`.

Trains one federated experiment into --output_dir; rerunning the command resumes (a larger --rounds continues).
Bad flags fail before any training in one line (exit 1); Ctrl-C says how to resume (exit 130). `--seeds=0,1,2`: one
run per seed into <output_dir>/seed_<s>, compared by `python -m training.compare <output_dir>`.
Outputs, exit codes, resuming: docs/experiments.md#one-experiment-python--m-trainingrun"""

from __future__ import annotations

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

import _thread  # pylint: disable=g-import-not-at-top
import dataclasses
import errno
import json
import shlex
import signal
import sys
import threading
from typing import Optional

from absl import app
from absl import flags
from absl import logging

from tff_gma import models
from tff_gma import runtime
from tff_gma.runtime import worker_process
from tff_gma.aggregators import geometric_median
from tff_gma.data import idx
from tff_gma.data import loaders
from training import command_line
from training import config as config_lib
from training.engine import attacks
from training.engine import client_execution
from training.engine import corruption
from training.engine import registry
from training.engine import worker_datasets
from training.runner import checkpoints
from training.runner import experiment
from training.runner import run_files

# The choices of the settings that name something; every other flag's kind follows its field's type.
_ENUMS = {
    'dataset': list(loaders.DATASETS),
    'partition': sorted({p for d in loaders.DATASETS for p in loaders.supported_partitions(d)}),
    'model': list(models.MODELS),
    'algorithm': list(registry.ALGORITHMS),
    'aggregator': list(registry.AGGREGATORS),
    'rfa_init': list(geometric_median.INITS),
    'client_execution': list(client_execution.MODES),
    'dataset_placement': list(worker_datasets.PLACEMENTS),
    'client_loop': list(config_lib.CLIENT_LOOPS),
    'adaptive_optimizer': list(config_lib.ADAPTIVE_OPTIMIZERS),
    'fashion_mnist_source': list(loaders.FASHION_MNIST_SOURCES),
    'corruption': list(corruption.CORRUPTIONS),
    'minmax_perturbation': list(attacks.PERTURBATIONS),
}
_DEFINE = {'int': flags.DEFINE_integer, 'float': flags.DEFINE_float, 'bool': flags.DEFINE_bool,
           'str': flags.DEFINE_string}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """One flag per `ExperimentConfig` field: its name, default and help; enums from the registries."""
  for field in dataclasses.fields(config_lib.ExperimentConfig):
    help_text = field.metadata['help']
    if field.name in _ENUMS:
      flags.DEFINE_enum(field.name, field.default, _ENUMS[field.name], help_text, flag_values=flag_values)
      continue
    kind = str(field.type).replace('Optional[', '').rstrip(']')
    _DEFINE[kind](field.name, field.default, help_text, flag_values=flag_values)


define_flags()
flags.DEFINE_list('seeds', None, 'Instead of --seed: run these seeds (e.g. 0,1,2) one after another with the same '
                  'settings, seed s into <output_dir>/seed_<s>; rerunning resumes each. Compare them with: python -m '
                  'training.compare <output_dir>.')

FLAGS = flags.FLAGS


def config_from_flags() -> config_lib.ExperimentConfig:
  return config_lib.ExperimentConfig(**{f.name: FLAGS[f.name].value
                                        for f in dataclasses.fields(config_lib.ExperimentConfig)})


def interrupted_message(config: config_lib.ExperimentConfig, args: list[str], seeds: int = 1) -> str:
  """`interrupted after round N of R; resume with: python -m training.run <args>` (N: the last checkpoint).

  `seeds` > 1: the run is one seed's of a --seeds run, and the message names the seed (`interrupted seed S (one of
  3 seeds) after round N of R; ...`); the same command resumes it and runs the seeds after it."""
  saved = checkpoints.saved_rounds(config.output_dir)
  done = max(saved, default=0)
  if done >= config.rounds:
    where = f'after round {done} of {config.rounds}, before summary.json was written'
  elif done > 0:
    where = f'after round {done} of {config.rounds}'
  else:
    where = f'before round 1 of {config.rounds} completed'
  if seeds > 1:
    where = f'seed {config.seed} (one of {seeds} seeds) {where}'
  return f'interrupted {where}; resume with: {resume_command(args)}'


def seed_configs(config: config_lib.ExperimentConfig, seeds: Optional[list[str]], seed_given: bool
                 ) -> list[config_lib.ExperimentConfig]:
  """The runs of one command: `config` alone, or with --seeds one per seed, seed s into <output_dir>/seed_<s>.

  Raises `app.UsageError` (`invalid flags: seeds...`) on a value that is not a seed, a repeated seed, an empty
  list, --seeds with --seed, or an output directory that holds a single run."""
  if seeds is None:
    return [config]
  if seed_given:
    raise app.UsageError('invalid flags: seeds: give --seeds or --seed, not both (--seeds runs each seed into '
                         f'{os.path.join(config.output_dir, config_lib.SEED_DIR.format("<s>"))})')
  values = []
  for text in seeds:
    try:
      seed = int(text)
    except ValueError:
      raise app.UsageError(f'invalid flags: seeds: {text!r} is not an integer (e.g. --seeds=0,1,2)') from None
    if not 0 <= seed <= experiment.MAX_SEED:
      raise app.UsageError(f'invalid flags: seeds: {seed} is not in [0, {experiment.MAX_SEED}]')
    if seed in values:
      raise app.UsageError(f'invalid flags: seeds: {seed} is given twice')
    values.append(seed)
  if not values:
    raise app.UsageError('invalid flags: seeds is empty (e.g. --seeds=0,1,2)')
  if os.path.isfile(os.path.join(config.output_dir, experiment.CONFIG_FILE)):
    raise app.UsageError(f'invalid flags: seeds: {config.output_dir} holds a single run ({experiment.CONFIG_FILE}); '
                         'give another --output_dir for the seeds\' runs')
  return [dataclasses.replace(config, seed=s, output_dir=os.path.join(config.output_dir, config_lib.SEED_DIR.format(s)))
          for s in values]


def resume_command(args: list[str]) -> str:
  """The runner's command line with `args`, quoted for a shell: what resumes the run."""
  return ' '.join(['python -m training.run'] + [shlex.quote(a) for a in args])


class _Terminated(KeyboardInterrupt):
  """SIGTERM (a scheduler or `kill` stopping the run), raised in the main thread: stops the run as Ctrl-C does."""


def _raise_terminated(signum, frame) -> None:
  del signum, frame
  raise _Terminated()


def _deliver_lost_stops(previous_hook):
  """An `unraisablehook` that delivers again a Ctrl-C or SIGTERM whose exception Python dropped: raised while a
  garbage-collection callback (JAX registers one) or a `__del__` ran, it is printed as "Exception ignored in" and
  the run would go on. Other unraisable exceptions go to `previous_hook`."""

  def hook(unraisable) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
      # From another thread, a moment later: delivered here, it would be raised inside this hook and dropped too.
      signum = signal.SIGTERM if isinstance(unraisable.exc_value, _Terminated) else signal.SIGINT
      threading.Timer(0.01, _thread.interrupt_main, (signum,)).start()
      return
    previous_hook(unraisable)

  return hook


def _stop_quietly(message: str, exit_code: int = 130) -> None:
  """After Ctrl-C or SIGTERM: one line, the workers stopped without their noise, exit 130 (SIGTERM: 143), no
  traceback."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # A second Ctrl-C does not interrupt the shutdown.
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  # The round's computation may still be in flight on the worker: stopping the worker makes that call fail in
  # TFF's background thread, and nothing said after our line helps, so stderr is silenced from here on.
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  try:
    worker_process.stop_all_workers()
  except Exception:  # pylint: disable=broad-except  # Exiting anyway; the atexit hook tries again.
    pass
  sys.exit(exit_code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  configs = seed_configs(config_from_flags(), FLAGS.seeds, FLAGS['seed'].present)
  config = configs[0]
  # Before the runtime's own SIGTERM handler (a plain exit): a terminated run says how to resume, as Ctrl-C does.
  signal.signal(signal.SIGTERM, _raise_terminated)
  sys.unraisablehook = _deliver_lost_stops(sys.unraisablehook)
  try:
    for config in configs:  # Every seed's settings and directory, before any training (or a worker).
      experiment.prepare(config)
    if config.workers is None:
      try:  # With the run's intra-op threads (the seeds share every setting but the seed and directory).
        runtime.set_simulation_context(intra_op_threads=config.worker_intra_op_threads)
      except (RuntimeError, ValueError) as e:  # The worker's log or confinement setting refused it.
        print(f'error: {e}', file=sys.stderr, flush=True)
        sys.exit(1)
    for config in configs:
      summary = experiment.run(config).summary  # Checks every setting first, before anything is written.
      print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
      print(f'Outputs: {os.path.abspath(config.output_dir)}', flush=True)
  except experiment.ConfigError as e:
    raise app.UsageError(f'invalid flags: {e}') from e
  except (experiment.DirectoryLockedError, experiment.CheckpointError, experiment.TrainingStopped,
          experiment.UnsafeOutputError, idx.IdxError) as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)
  except OSError as e:  # The output directory failed under the run (disk full, removed, made read-only).
    where = interrupted_message(config, sys.argv[1:], len(configs)).partition(';')[0].replace(
        'interrupted', 'stopped', 1)
    if isinstance(e, run_files.OutputDirectoryGone):  # Moved or removed under the run: what it held is unknown.
      where = 'stopped with its output directory gone'
    limit = " (this process's open-file limit: ulimit -n)" if e.errno == errno.EMFILE else ''
    print(f'error: {e.strerror or e}{limit}: {e.filename or config.output_dir} ({where}); fix it, then resume with: '
          f'{resume_command(sys.argv[1:])}', file=sys.stderr, flush=True)
    sys.exit(1)
  except KeyboardInterrupt as e:
    _stop_quietly(interrupted_message(config, sys.argv[1:], len(configs)),
                  143 if isinstance(e, _Terminated) else 130)
  if len(configs) > 1:
    print(f'Seeds {",".join(str(c.seed) for c in configs)} done; compare them with: python -m training.compare '
          f'{shlex.quote(FLAGS.output_dir)}')


if __name__ == '__main__':
  command_line.run(main)
