"""What importing `tff_gma` does to TensorFlow Federated's import-time default context (docs/runtime.md#contexts).

`import tensorflow_federated` installs TFF's native C++ context (`set_sync_local_cpp_execution_context()`) as the
default. Two things about it trip a user of this library:

* It cannot run the secure-sum intrinsics that GMA, RFA and `secure_sum_then_finalize` use. A script that forgets
  `tff_gma.runtime.set_simulation_context()` starts TFF's (unconfined) worker, sends it the round, and gets back a
  1.3 KB gRPC error, "Cannot embed a federated value. while evaluating local [_lze142] in block locals [...]",
  that names neither the intrinsic nor the fix. `install` wraps that context in `NamedFixContext`, which refuses
  such a computation in one line naming the fix, before any worker starts, and hands every other computation to
  TFF's context unchanged (TFF's behaviour, TFF's worker).
* Its executor factory's service manager stops its worker only from a `__del__`, which runs at interpreter
  shutdown after the `subprocess` module has been torn down: every process that imported TFF and never replaced
  that context (one that only trains with Keras, say) ends with "Exception ignored in: <function
  local_cpp_executor_factory.<locals>.ServiceManager.__del__ ...> AttributeError: 'NoneType' object has no
  attribute 'Popen'", and a worker it did start outlives Python holding the caller's pipes (docs/runtime.md).
  `release_at_exit` (an `atexit` hook of `tff_gma/__init__.py`, so it runs before module teardown) replaces the
  default context with TFF's `RuntimeErrorContext` and collects the old one while `subprocess` still exists: the
  `__del__` then runs cleanly, and stops (SIGINT, then waits for) a worker TFF's context had started.

`tff_gma/__init__.py` calls `install` right after `tensorflow_federated` is imported (or at once, if it already
was); this module imports TFF and is imported only then.
"""

from __future__ import annotations

import gc
from typing import Any

from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import tree_analysis
from tensorflow_federated.python.core.impl.context_stack import context_base
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.context_stack import runtime_error_context
from tensorflow_federated.python.core.impl.execution_contexts import sync_execution_context

# The intrinsics TFF's native runtime cannot execute and the simulation contexts lower to plain sums with overflow
# checks (TFF's test backend compiler, `replace_secure_intrinsics_with_bodies`).
SECURE_SUM_INTRINSICS = ('federated_secure_sum', 'federated_secure_sum_bitwidth', 'federated_secure_modular_sum')


def secure_intrinsics(comp) -> list[str]:
  """The secure-sum intrinsics `comp` (a `tff.Computation`) calls, sorted; [] when it calls none (or is not one
  whose building block can be read)."""
  try:
    tree = comp.to_building_block()
  except (AttributeError, TypeError, ValueError):
    return []
  found = set()

  def visit(block):
    if isinstance(block, building_blocks.Intrinsic) and block.uri in SECURE_SUM_INTRINSICS:
      found.add(block.uri)

  tree_analysis.visit_preorder(tree, visit)
  return sorted(found)


def missing_context_message(intrinsics: list[str]) -> str:
  return (f'this computation calls {", ".join(intrinsics)} (secure aggregation), which TFF\'s default context '
          f'cannot run: call tff_gma.runtime.set_simulation_context() once before running it (TFF\'s own '
          f'tff.backends.test.set_sync_test_cpp_execution_context() runs it too, on an unconfined worker; '
          f'docs/runtime.md#contexts)')


class NamedFixContext(context_base.SyncContext):
  """TFF's native default context, refusing in one line (naming the fix) what it cannot run.

  `invoke` checks once per computation whether it calls a secure-sum intrinsic; if so it raises
  `context_base.ContextError` (a `RuntimeError`) before anything runs. Everything else goes to the wrapped context.
  """

  _MAX_CHECKED = 256  # Computations whose check is remembered (keyed by identity: TFF's hash serializes them).

  def __init__(self, wrapped: context_base.SyncContext):
    self._wrapped = wrapped
    self._checked: dict[int, tuple[Any, list[str]]] = {}

  @property
  def wrapped(self) -> context_base.SyncContext:
    return self._wrapped

  @property
  def executor_factory(self):
    return self._wrapped.executor_factory

  def invoke(self, comp, arg):
    key = id(comp)
    entry = self._checked.get(key)
    if entry is None or entry[0] is not comp:
      if len(self._checked) >= self._MAX_CHECKED:
        self._checked.clear()
      entry = self._checked[key] = (comp, secure_intrinsics(comp))  # Holds `comp`, so its id stays its own.
    if entry[1]:
      raise context_base.ContextError(missing_context_message(entry[1]))
    return self._wrapped.invoke(comp, arg)


def _is_native_sync_context(context) -> bool:
  """Whether `context` is TFF's plain native context (`create_sync_local_cpp_execution_context()`, which TFF
  installs at import): one compiling with the native compiler only, which cannot run the secure intrinsics."""
  if type(context) is not sync_execution_context.SyncExecutionContext:  # pylint: disable=unidiomatic-typecheck
    return False
  pipeline = getattr(getattr(context, '_async_context', None), '_compiler_pipeline', None)
  return getattr(pipeline, '_compiler_fn', None) is native_compiler.desugar_and_transform_to_native


def install() -> bool:
  """Wraps TFF's default context in `NamedFixContext` if it is TFF's native one; returns whether it did.

  Any other default (TFF's test context, this library's contexts, a context the user set) is left alone.
  """
  stack = context_stack_impl.context_stack
  frames = getattr(stack, '_stack', None) or [None]  # The bottom frame is the default (TFF 0.87's layout).
  current = frames[0]
  if not _is_native_sync_context(current):
    return False
  stack.set_default_context(NamedFixContext(current))
  return True


def release_at_exit() -> None:
  """Replaces TFF's default context with `RuntimeErrorContext` and collects the old one (see the module doc)."""
  context_stack_impl.context_stack.set_default_context(runtime_error_context.RuntimeErrorContext())
  gc.collect()
