"""One warning line, while TFF traces this library's secure sums, when TFF's default context cannot run them.

A factory composed into TFF's own builders under TFF's default context otherwise fails only at `next`, with a long
gRPC error naming neither the intrinsic nor the fix. Nothing here runs at import or changes TFF; why a warning at
build time (not an error, not at run time): `warn_if_context_cannot_run`.
"""

from __future__ import annotations

import os
import traceback
import warnings

import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import _default_context
from tff_gma import tff_internals

# Frames of these packages are skipped when the warning picks its source line: it points at the caller's own line
# (the builder call in the user's script), not at the library's or TFF's internals.
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (tf, tff))
_TFF_GMA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # The package's own frames.


class SecureSumContextWarning(UserWarning):
  """A secure sum of this library was traced while TFF's default context is one that cannot run it."""


_warned = False  # Once per process: every factory of a process traces several secure sums.


def _running_context():
  """The context that will run what is being traced: the bottom of TFF's context stack (its default context).

  While TFF traces, the top of the stack is its tracing context; the default context sits below it, and TFF's own
  `set_*_execution_context()` and the library's `set_simulation_context()` replace exactly that one. An execution
  context a caller pushes with `get_context_stack().install(...)` in between is not read (TFF has no public API
  for the frames in between): such a caller gets no warning, never a wrong one.
  """
  return tff_internals.default_context()


def _caller_stacklevel() -> int:
  """`warnings.warn`'s stacklevel, from its call in `warn_if_context_cannot_run`, of the first frame outside this
  library, TFF and TensorFlow: the line of the caller's code that built the process."""
  frames = traceback.extract_stack()[:-1]  # Outermost first; without this function's own frame.
  for level, frame in enumerate(reversed(frames), start=1):
    if not _skipped(frame.filename):
      return level
  return len(frames)


def _skipped(filename: str) -> bool:
  return filename.startswith(_LIBRARY_DIRS) or filename.startswith(_TFF_GMA_DIR)


def message(intrinsic: str) -> str:
  """The warning: the runner's one line for the same mistake, and the error it explains (which comes later)."""
  return (f'{_default_context.missing_context_message([intrinsic])}; without it, running it fails with TFF\'s gRPC '
          f'error "Cannot embed a federated value"')


def warn_if_context_cannot_run(intrinsic: str) -> None:
  """Where the library traces `intrinsic` (a secure sum): warns in one line, once per process, when the context
  that will run it (`_running_context`) is one of TFF's native contexts, which cannot run secure sums.

  Why here: `next` is TFF's call (its builders', e.g. `build_weighted_fed_avg`), so its gRPC error could only be
  made clear by patching TFF; the trace of the library's own secure sums runs while the process is built, and every
  factory passes through it. Why a warning, not an error: at build time the context that will run it may not be
  installed yet (a caller may build first and install it right after, as the project's runner does). Silent under
  the library's simulation and multi-worker contexts, TFF's test context and TFF's runtime-error context (which
  the project's entry points install before they build anything); cheap after the first warning (nothing is read).
  """
  global _warned
  if _warned or not _default_context.cannot_run_secure_sums(_running_context()):
    return
  _warned = True
  warnings.warn(message(intrinsic), SecureSumContextWarning, stacklevel=_caller_stacklevel())
