"""What the harness's commands share: a usage error is one line, not the command's whole help before it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from absl import app


def one_line_usage_errors(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  """`main` for `app.run`, with an `app.UsageError` ending in its message alone on stderr and its exit code.

  absl's `app.run` prints the module's docstring and every flag's help (about 150 lines for the runner) before the
  error, which then scrolls out of sight; the message already names the flag and the value.
  """

  @functools.wraps(main)
  def wrapped(argv: list[str]) -> Any:
    try:
      return main(argv)
    except app.UsageError as e:
      print(str(e), file=sys.stderr, flush=True)
      sys.exit(e.exitcode)

  return wrapped
