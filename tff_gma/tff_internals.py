"""The one place tff_gma reaches into TFF 0.87's private modules, where TFF has no public API for what it needs.

Each use is one name here that says why no public API serves, pinned by `tests/tff_gma/tff_internals_test.py` so
that a TFF upgrade that moves one fails there, by name; everything else (the audit's building-block walker included)
uses TFF's public names only. Each name imports TFF only when called, keeping lazy what its callers keep lazy.
"""

from __future__ import annotations

import subprocess
import types
from collections.abc import Callable, Sequence
from typing import Any, Optional

# ---------------------------------------------------------------------------------------------------------------
# Execution contexts and the worker (tff_gma/runtime).


def default_context() -> Any:
  """The context at the bottom of TFF's context stack (the default one), or None where the stack has no frames."""
  # No public getter: `get_context_stack().current` is the top of the stack, which `install` may have covered.
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  frames = getattr(tff.framework.get_context_stack(), '_stack', None)
  return frames[0] if frames else None


def compiler_fn_of(context: Any) -> Optional[Callable[..., Any]]:
  """The compiler function of a TFF execution context (sync, async, or a `tff.program.NativeFederatedContext` over
  an async one); None for any other context."""
  # No public API says how a context compiles: it is held by the context's private compiler pipeline.
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  context = getattr(context, '_context', context)  # `tff.program.NativeFederatedContext` wraps an async context.
  if type(context) is tff.framework.SyncExecutionContext:  # pylint: disable=unidiomatic-typecheck
    context = getattr(context, '_async_context', None)
  if type(context) is not tff.framework.AsyncExecutionContext:  # pylint: disable=unidiomatic-typecheck
    return None
  return getattr(getattr(context, '_compiler_pipeline', None), '_compiler_fn', None)


def local_cpp_worker_process(context: Any) -> Optional[subprocess.Popen]:
  """The worker process that one of TFF's local C++ contexts (native or test; sync, async, or a program context
  over one) has started; None if it has started none or `context` is not built as TFF 0.87 builds those."""
  # TFF keeps the process in a `ServiceManager` closed over by its executor stack function, and stops it only from
  # that object's `__del__`; no public API reaches it.
  context = getattr(context, '_context', context)  # `tff.program.NativeFederatedContext`.
  context = getattr(context, '_async_context', context)  # A synchronous context's asynchronous one.
  stack_fn = getattr(getattr(context, '_executor_factory', None), '_executor_stack_fn', None)
  try:
    cells = dict(zip(stack_fn.__code__.co_freevars, stack_fn.__closure__ or ()))
    process = cells['service_manager'].cell_contents._process  # pylint: disable=protected-access
  except (AttributeError, KeyError, ValueError):
    return None  # Not TFF's local C++ executor factory (or not as TFF 0.87 builds it).
  return process if isinstance(process, subprocess.Popen) else None


def async_thread_runner() -> Any:
  """TFF's `AsyncThreadRunner`: a thread running an event loop, on which TFF's contexts run their coroutines from
  synchronous code (`run_coro_and_return_result`)."""
  # No public API: TFF's synchronous contexts are built on it, and it lives in TFF's private common_libs.
  from tensorflow_federated.python.common_libs import async_utils  # pylint: disable=g-import-not-at-top
  return async_utils.AsyncThreadRunner()


# ---------------------------------------------------------------------------------------------------------------
# The audit (tff_gma/audit).


def is_known_intrinsic(uri: str) -> bool:
  """Whether `uri` names one of TFF's own intrinsics (as opposed to one a computation's building blocks made up)."""
  # TFF's public `tff.framework` has the `Intrinsic` building block but no registry of the intrinsics it defines.
  from tensorflow_federated.python.core.impl.compiler import intrinsic_defs  # pylint: disable=g-import-not-at-top
  return intrinsic_defs.uri_to_intrinsic_def(uri) is not None


def is_secure_intrinsic(uri: str) -> bool:
  """Whether TFF marks the intrinsic `uri` as a secure aggregation or a secure broadcast (select); False for an
  intrinsic TFF does not define."""
  # Only TFF's private intrinsic definitions say which intrinsics are secure.
  from tensorflow_federated.python.core.impl.compiler import intrinsic_defs  # pylint: disable=g-import-not-at-top
  definition = intrinsic_defs.uri_to_intrinsic_def(uri)
  if definition is None:
    return False
  return (definition.aggregation_kind is intrinsic_defs.AggregationKind.SECURE
          or definition.broadcast_kind is intrinsic_defs.BroadcastKind.SECURE)


def is_polymorphic_computation(value: Any) -> bool:
  """Whether `value` is a computation whose parameter type is not fixed yet (e.g. `tff.federated_computation`
  with no types), which has no type signature to audit until it is called."""
  # `tff.Computation` excludes it, but TFF exports no name for the class itself.
  # pylint: disable-next=g-import-not-at-top
  from tensorflow_federated.python.core.impl.computation import polymorphic_computation
  return isinstance(value, polymorphic_computation.PolymorphicComputation)


# ---------------------------------------------------------------------------------------------------------------
# Aggregators (tff_gma/aggregators/composition.py).


def create_running_above(frame: Optional[types.FrameType], classes: Sequence[type]) -> Optional[type]:
  """The first of `classes` whose `create` method runs in `frame` or in a frame that called it; None if none does.

  Each class is recognised by the code object of its own `create` (not by name, so no other function is taken for
  it).
  """
  # TFF creates an inner factory from inside its own `create` and says nowhere which slot it creates it for (a sum,
  # a mean): only the calling frames do.
  codes = {cls.create.__code__: cls for cls in classes}
  while frame is not None:
    found = codes.get(frame.f_code)
    if found is not None:
      return found
    frame = frame.f_back
  return None


# ---------------------------------------------------------------------------------------------------------------
# Learning processes, models and data (tff_gma/learning, tff_gma/models.py, tff_gma/data, training/engine).


def build_model_delta_update_with_tff_optimizer(model_fn: Callable[[], Any], *, weighting: Any,
                                                loop_implementation: Any) -> Callable[..., Any]:
  """TFF's FedAvg client update (`tff.learning.templates.build_model_delta_client_work`'s): a `tf.function`
  `(optimizer, initial_weights, dataset, optimizer_hparams=None) -> (ClientResult, unfinalized metrics)`."""
  # TFF exports only the client work process built around it, not the update, which the library's client works
  # (datasets built in the worker, the corrupted clients) run inside computations of their own.
  # pylint: disable-next=g-import-not-at-top
  from tensorflow_federated.python.learning.templates import model_delta_client_work
  return model_delta_client_work.build_model_delta_update_with_tff_optimizer(
      model_fn=model_fn, weighting=weighting, loop_implementation=loop_implementation)


def keras_model_of(model: Any) -> Any:
  """The Keras model inside a `tff.learning.models.from_keras_model` model; None for any other model."""
  # TFF's wrapper keeps it private and exports no accessor.
  return getattr(model, '_keras_model', None)
