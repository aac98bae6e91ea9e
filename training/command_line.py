"""What the harness's commands share: a usage error, or a file-system error, is one line; never the command's whole
help or a traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from absl import app

from training import safe_files


STUDY_RESUMES = 'the study resumes from its finished runs when the same command runs again'


def one_line_usage_errors(main: Callable[[list[str]], Any], resume_hint: str = '') -> Callable[[list[str]], Any]:
  """`main` for `app.run`, with an `app.UsageError` ending in its message alone on stderr and its exit code.

  absl's `app.run` prints the module's docstring and every flag's help (about 150 lines for the runner) before the
  error, which then scrolls out of sight; the message already names the flag and the value.

  An `OSError` (an output path that is a file, a read-only or full disk) ends in one `error:` line naming the path
  (and `resume_hint`, for a command that resumes), exit 1.
  """

  @functools.wraps(main)
  def wrapped(argv: list[str]) -> Any:
    try:
      return main(argv)
    except app.UsageError as e:
      print(str(e), file=sys.stderr, flush=True)
      sys.exit(e.exitcode)
    except OSError as e:
      where = f': {e.filename}' if e.filename else ''
      print(f'error: {e.strerror or e}{where}' + (f' ({resume_hint})' if resume_hint else ''), file=sys.stderr,
            flush=True)
      sys.exit(1)

  return wrapped


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
