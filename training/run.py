"""The experiment runner.

    python -m training.run --flagfile=configs/<name>.flags [--flag=value ...]

Trains one federated experiment (see `training.runner.experiment` for what is written to --output_dir). Rerunning the
same command resumes from the last completed round; a larger --rounds continues training. Unknown flags and
inconsistent settings fail before any training, naming the flag (`invalid flags: ...`, exit 1, nothing written).
An --output_dir that another run holds, or whose checkpoints are all damaged, fails in one line (`error: ...`,
exit 1). Ctrl-C ends with one line saying after which round the run stopped and the command that resumes it
(exit 130); SIGTERM the same (exit 143).
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
from tff_gma.data import idx
from tff_gma.data import loaders
from training import command_line
from training import config as config_lib
from training.engine import client_execution
from training.engine import corruption
from training.engine import registry
from training.engine import worker_datasets
from training.runner import checkpoints
from training.runner import experiment

# The choices of the settings that name something; every other flag's kind follows its field's type.
_ENUMS = {
    'dataset': list(loaders.DATASETS),
    'partition': sorted({p for d in loaders.DATASETS for p in loaders.supported_partitions(d)}),
    'model': list(models.MODELS),
    'algorithm': list(registry.ALGORITHMS),
    'aggregator': list(registry.AGGREGATORS),
    'rfa_init': ['mean', 'zero'],
    'client_execution': list(client_execution.MODES),
    'dataset_placement': list(worker_datasets.PLACEMENTS),
    'corruption': list(corruption.CORRUPTIONS),
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

FLAGS = flags.FLAGS


def config_from_flags() -> config_lib.ExperimentConfig:
  return config_lib.ExperimentConfig(**{f.name: FLAGS[f.name].value
                                        for f in dataclasses.fields(config_lib.ExperimentConfig)})


def interrupted_message(config: config_lib.ExperimentConfig, args: list[str]) -> str:
  """`interrupted after round N of R; resume with: python -m training.run <args>` (N: the last checkpoint)."""
  saved = checkpoints.saved_rounds(config.output_dir)
  done = max(saved, default=0)
  if done >= config.rounds:
    where = f'after round {done} of {config.rounds}, before summary.json was written'
  elif done > 0:
    where = f'after round {done} of {config.rounds}'
  else:
    where = f'before round 1 of {config.rounds} completed'
  return f'interrupted {where}; resume with: {resume_command(args)}'


def resume_command(args: list[str]) -> str:
  """The runner's command line with `args`, quoted for a shell: what resumes the run."""
  return ' '.join(['python -m training.run'] + [shlex.quote(a) for a in args])


class _Terminated(KeyboardInterrupt):
  """SIGTERM (a scheduler or `kill` stopping the run), raised in the main thread: stops the run as Ctrl-C does."""


def _raise_terminated(signum, frame) -> None:
  del signum, frame
  raise _Terminated()


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
    runtime.stop_all_workers()
  except Exception:  # pylint: disable=broad-except  # Exiting anyway; the atexit hook tries again.
    pass
  sys.exit(exit_code)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  config = config_from_flags()
  # Before the runtime's own SIGTERM handler (a plain exit): a terminated run says how to resume, as Ctrl-C does.
  signal.signal(signal.SIGTERM, _raise_terminated)
  try:
    if config.workers is None:
      try:
        runtime.set_simulation_context()
      except (RuntimeError, ValueError) as e:  # The worker's log or confinement setting refused it.
        print(f'error: {e}', file=sys.stderr, flush=True)
        sys.exit(1)
    summary = experiment.run(config).summary  # Checks every setting first, before anything is written.
  except experiment.ConfigError as e:
    raise app.UsageError(f'invalid flags: {e}') from e
  except (experiment.DirectoryLockedError, experiment.CheckpointError, experiment.TrainingStopped,
          experiment.UnsafeOutputError, idx.IdxError) as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)
  except OSError as e:  # The output directory failed under the run (disk full, removed, made read-only).
    where = interrupted_message(config, sys.argv[1:]).partition(';')[0].replace('interrupted', 'stopped', 1)
    print(f'error: {e.strerror or e}: {e.filename or config.output_dir} ({where}); fix it, then resume with: '
          f'{resume_command(sys.argv[1:])}', file=sys.stderr, flush=True)
    sys.exit(1)
  except KeyboardInterrupt as e:
    _stop_quietly(interrupted_message(config, sys.argv[1:]), 143 if isinstance(e, _Terminated) else 130)
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
  print(f'Outputs: {os.path.abspath(config.output_dir)}')


if __name__ == '__main__':
  app.run(command_line.one_line_usage_errors(main))
