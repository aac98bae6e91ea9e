"""What TFF's native context cannot run, and the one line that names the fix.

TFF's default native context cannot run the secure sums GMA and RFA use; a script that forgets
`tff_gma.runtime.set_simulation_context()` gets a long gRPC error naming neither. The check here runs only where
this library's own code runs a computation (`tff_gma.runtime.check_context_runs`, called by the experiment runner
before training): importing the library leaves TFF's context as TFF made it, and nothing here runs at import.
"""

from __future__ import annotations

import tensorflow_federated as tff

from tff_gma import tff_internals

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
    if isinstance(block, tff.framework.Intrinsic) and block.uri in SECURE_SUM_INTRINSICS:
      found.add(block.uri)
    return block, False  # Unchanged: the transformation only visits.

  tff.framework.transform_preorder(tree, visit)
  return sorted(found)


def missing_context_message(intrinsics: list[str]) -> str:
  """The one line that names the fix when a computation calling `intrinsics` meets a context that cannot run it."""
  return (f'this computation calls {", ".join(intrinsics)} (secure aggregation), which TFF\'s default context '
          f'cannot run: call tff_gma.runtime.set_simulation_context() once before running it (TFF\'s own '
          f'tff.backends.test.set_sync_test_cpp_execution_context() runs it too, on an unconfined worker; '
          f'docs/runtime.md#troubleshooting)')


def is_native_sync_context(context) -> bool:
  """Whether `context` is TFF's plain native synchronous context (`create_sync_local_cpp_execution_context()`, the
  kind TFF installs at import): one compiling with the native compiler only."""
  return (type(context) is tff.framework.SyncExecutionContext  # pylint: disable=unidiomatic-typecheck
          and tff_internals.compiler_fn_of(context) is tff.backends.native.desugar_and_transform_to_native)


def cannot_run_secure_sums(context) -> bool:
  """Whether `context` is one of TFF's native contexts (sync, async, or a program context over the async one),
  which compile with the native compiler only and so cannot run the secure-sum intrinsics."""
  return tff_internals.compiler_fn_of(context) is tff.backends.native.desugar_and_transform_to_native
