"""What the harness's commands share: a usage or file-system error is one line, never a traceback.

Never the command's whole help either (`one_line_usage_errors`, `parse_flags`, `run_main`)."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app
from absl import flags

from training import safe_files


STUDY_RESUMES = 'the study resumes from its finished runs when the same command runs again'


class CommandError(Exception):
  """A user error found while the command starts (a refused worker setting...): `error: ` and its message, exit 1."""


def one_line_usage_errors(main: Callable[[list[str]], Any], resume_hint: str = '') -> Callable[[list[str]], Any]:
  """`main` for `app.run`, with an `app.UsageError` ending in its message alone on stderr and its exit code.

  absl's `app.run` prints the module's docstring and every flag's help (about 150 lines for the runner) before the
  error, which then scrolls out of sight; the message already names the flag and the value.

  An `OSError` (an output path that is a file, a read-only or full disk) ends in one `error:` line naming the path
  (and `resume_hint`, for a command that resumes), exit 1; a `CommandError`, or a run's refusal that the runner
  too reports in one line (`is_run_refusal`: settings a run's data or its directory refuse, a directory another
  run holds, damaged checkpoints, a run stopped for non-finite updates), in its `error:` line, exit 1.
  """

  @functools.wraps(main)
  def wrapped(argv: list[str]) -> Any:
    try:
      return main(argv)
    except app.UsageError as e:
      print(str(e), file=sys.stderr, flush=True)
      sys.exit(e.exitcode)
    except CommandError as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(1)
    except (ValueError, RuntimeError) as e:
      if not is_run_refusal(e):
        fault = resource_fault(e)
        if fault is None:
          raise
        print(f'error: {fault}' + (f' ({resume_hint})' if resume_hint else ''), file=sys.stderr, flush=True)
        _silence_stderr()
        sys.exit(1)
      settings = isinstance(e, ValueError)  # A setting or the data: the same command would be refused again.
      print(f'error: {e}' + (f' ({resume_hint})' if resume_hint and not settings else ''), file=sys.stderr,
            flush=True)
      sys.exit(1)
    except OSError as e:
      where = f': {e.filename}' if e.filename else ''
      print(f'error: {e.strerror or e}{where}' + (f' ({resume_hint})' if resume_hint else ''), file=sys.stderr,
            flush=True)
      sys.exit(1)

  return wrapped


def _silence_stderr() -> None:
  """Points fd 2 at /dev/null once a resource fault's line is out. A process at its address-space limit can fail
  anything its exit allocates for (an allocation in a finalizer or an atexit handler), each failure one more
  `MemoryError` line after the line that already names the cause; the exit's cleanup still runs."""
  try:
    devnull = os.open(os.devnull, os.O_WRONLY)
  except OSError:
    return
  os.dup2(devnull, 2)
  os.close(devnull)


THREAD_FAULT = ("cannot start a thread (the process's thread or address-space limit: ulimit -u / -v, or the "
                'memory); raise it, or run fewer processes at once')


def resource_fault(error: BaseException) -> str | None:
  """The one line for an error that a resource limit caused rather than a bug (Python's "can't start new thread",
  which TFF's contexts raise when the thread or address-space limit is reached), or None. Its causes count too."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
      return THREAD_FAULT
    error = error.__cause__ or error.__context__
  return None


def check_output_dir(directory: str, flag: str = 'output_dir') -> None:
  """Before any work: `app.UsageError('invalid flags: ...')` when `--flag`'s directory could not be written (a
  file, under a file, empty, not writable, on a read-only file system), instead of failing after the work."""
  problem = safe_files.output_dir_problem(directory, flag)
  if problem is not None:
    raise app.UsageError(f'invalid flags: {problem}')


def check_output_file(path: str, flag: str = 'output') -> None:
  """`check_output_dir` for a flag naming a file (or a prefix of files): not a directory, its directory writable."""
  problem = safe_files.output_file_problem(path, flag)
  if problem is not None:
    raise app.UsageError(f'invalid flags: {problem}')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run`'s `flags_parser`), a value it cannot parse or an unknown flag said in one line
  (`invalid flags: ...`, exit 1) instead of absl's 'FATAL Flags parsing error' and a second line."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = ' '.join(str(e).split())
    print(f'invalid flags: {message} (--helpshort lists the flags)', file=sys.stderr, flush=True)
    sys.exit(1)


def run(main: Callable[[list[str]], Any], resume_hint: str = '') -> None:
  """`app.run(main)` for a harness command: its flag, usage and file-system errors in one line (`parse_flags`,
  `one_line_usage_errors`). TFF's import-time context is released first and TF's unused-assertion reports dropped
  (`tff_gma.runtime.set_up_entry_point`)."""
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  runtime.set_up_entry_point()
  logging.getLogger('tensorflow').addFilter(_drop_unreadable_source_warnings)
  app.run(one_line_usage_errors(main, resume_hint), flags_parser=parse_flags)


def _drop_unreadable_source_warnings(record: logging.LogRecord) -> bool:
  """Drops AutoGraph's "could not transform ... Unable to locate the source code" warning. The harness's functions
  all have their source; it cannot be read when the process is out of file descriptors, and then these warnings,
  three lines each, came before the one line that names the fault. AutoGraph runs such a function as written."""
  message = record.getMessage()
  return not ('AutoGraph could not transform' in message and 'Unable to locate the source code' in message)


def is_run_refusal(error: BaseException) -> bool:
  """Whether `error` is one of the runner's own refusals (`training.runner.experiment`'s `ConfigError`,
  `DirectoryLockedError`, `CheckpointError`, `UnsafeOutputError`, `TrainingStopped`, `WorkerUnresponsive`; the
  data's `IdxError`): a message for the user, not a bug. Read from the loaded modules: an error of a module never
  imported is none."""
  experiment = sys.modules.get('training.runner.experiment')
  idx = sys.modules.get('tff_gma.data.idx')
  kinds = () if experiment is None else (experiment.ConfigError, experiment.DirectoryLockedError,
                                         experiment.CheckpointError, experiment.UnsafeOutputError,
                                         experiment.TrainingStopped, experiment.WorkerUnresponsive)
  kinds += () if idx is None else (idx.IdxError,)
  return isinstance(error, kinds)


def start_simulation():
  """`tff_gma.runtime.set_simulation_context()`, its refusals (the worker's log a link or a FIFO, an unknown or
  unmet `$TFF_GMA_WORKER_CONFINEMENT`) raised as one-line `CommandError`s; returns the worker."""
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  try:
    return runtime.set_simulation_context()
  except (RuntimeError, ValueError) as e:
    raise CommandError(' '.join(str(e).split())) from e
