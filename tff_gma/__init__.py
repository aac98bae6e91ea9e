"""tff-gma: aggregation beyond plain averaging for TensorFlow Federated.

Subpackages are imported lazily by their users (`tff_gma.aggregators`, `tff_gma.data`, ...) so that
`import tff_gma` itself stays cheap and does not import TensorFlow.
"""

__version__ = '0.1.0'

import atexit as _atexit
import importlib.abc as _importlib_abc
import logging as _logging
import sys as _sys


class _DropUnusedAssertionNoise(_logging.Filter):
  """Drops TF's "Object was never used" report, which TFF's quantized secure sum triggers on every trace.

  Its bound assertions are built but not used in graph mode; TF then logs a long ERROR with a stack trace for
  each, although nothing is wrong. Only that report is dropped; other TF messages pass.
  """

  def filter(self, record: _logging.LogRecord) -> bool:
    return 'Object was never used' not in record.getMessage()


_logging.getLogger('tensorflow').addFilter(_DropUnusedAssertionNoise())


# --- TFF's import-time default context (tff_gma/_default_context.py; docs/runtime.md#contexts). --------------------
# Once `tensorflow_federated` is imported (by a tff_gma module or by the user, before or after `import tff_gma`),
# its default context is wrapped so that a computation it cannot run (secure sums: a forgotten
# `tff_gma.runtime.set_simulation_context()`) fails in one line naming the fix; at exit that context is released
# while the interpreter is still whole, so TFF's `__del__` neither prints a traceback nor leaves its worker behind.
# Nothing here imports TensorFlow: a process that never imports TFF pays only for the hook below.

_TFF = 'tensorflow_federated'


def _tff_imported() -> None:
  try:
    from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
    _default_context.install()
  except Exception as e:  # pylint: disable=broad-except
    # Never break `import tensorflow_federated`: without the wrapper, TFF's context fails as TFF's does.
    _logging.getLogger(__name__).warning('tff_gma could not wrap TFF\'s default context: %s', e)


class _AfterTFFImport(_importlib_abc.MetaPathFinder):
  """Runs `_tff_imported` right after `import tensorflow_federated` has executed (the first time only)."""

  def find_spec(self, fullname, path, target=None):
    if fullname != _TFF:
      return None
    for finder in _sys.meta_path:  # The other finders locate the package.
      if finder is self:
        continue
      find = getattr(finder, 'find_spec', None)
      spec = find(fullname, path, target) if find is not None else None
      if spec is not None:
        break
    else:
      return None
    loader = spec.loader
    if loader is None or not hasattr(loader, 'exec_module'):
      return spec
    exec_module = loader.exec_module

    def exec_then_install(module):
      exec_module(module)
      if self in _sys.meta_path:
        _sys.meta_path.remove(self)  # One-shot: TFF is imported now.
      _tff_imported()

    loader.exec_module = exec_then_install  # On this spec's own loader instance only.
    return spec


def _release_tff_context_at_exit() -> None:
  if _TFF in _sys.modules:
    try:
      from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
      _default_context.release_at_exit()
    except Exception:  # pylint: disable=broad-except
      pass  # At exit there is nothing better to do; TFF's own `__del__` then runs as without this library.


if _TFF in _sys.modules:
  _tff_imported()
else:
  _sys.meta_path.insert(0, _AfterTFFImport())
# Registered first (at `import tff_gma`), so it runs last among the exit hooks of this library and TFF.
_atexit.register(_release_tff_context_at_exit)
