"""The simulation contexts on this process's worker: which TFF context runs a computation, and TFF's own.

`set_simulation_context()` (plain calls from Python) and `set_async_simulation_context()` (`tff.program`) install
TFF contexts that lower the secure-sum intrinsics as TFF's test backend does, on one `WorkerProcess` they own
(`state.STATE`). Replacing TFF's default context is done here too: TFF's own worker is stopped first by a bounded
escalation, and the replaced context collected while the interpreter is whole (`set_up_entry_point`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Optional

import grpc
import tensorflow_federated as tff

from tff_gma import confinement
from tff_gma import tff_internals
from tff_gma.runtime import files
from tff_gma.runtime import worker_process
from tff_gma.runtime.state import STATE
from tff_gma.runtime.worker_process import WorkerProcess


def compile_for_simulation(comp):
  """The simulation contexts' compiler (and each worker's, under the multi-worker context)."""
  # As TFF's test backend: lower the secure-sum intrinsics to their insecure bodies (with the overflow checks
  # of their bounds), then to what the native runtime executes.
  comp = tff.backends.test.replace_secure_intrinsics_with_bodies(comp)
  return tff.backends.native.desugar_and_transform_to_native(comp)


def executor_factory(worker: Optional[WorkerProcess], default_num_clients: int, target: Optional[str] = None):
  """Executors on `worker` (restarted if it died), or on a worker this process does not own at `target`."""
  stub_holder = {}

  def stack_fn(cardinalities):
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = default_num_clients
    if worker is not None and not worker.running():
      # The worker died (e.g. OOM-killed): start a fresh one rather than fail every later call.
      if worker.listen_host is None:
        worker.port = None
      worker.start()
      stub_holder.clear()
    if worker is not None and stub_holder.get('target') != worker.target:
      stub_holder.clear()  # The worker was restarted elsewhere (e.g. with other intra-op threads).
    if 'stub' not in stub_holder:
      stub_holder['stub'] = worker.stub() if worker is not None else tff.framework.RemoteExecutorGrpcStub(
          grpc.insecure_channel(target, worker_process.GRPC_OPTIONS))
      stub_holder['target'] = worker.target if worker is not None else target
    executor = tff.framework.RemoteExecutor(stub_holder['stub'])
    executor.set_cardinalities(cardinalities)
    return executor

  return tff.framework.ResourceManagingExecutorFactory(executor_stack_fn=stack_fn)


def create_simulation_context(
    worker: WorkerProcess, default_num_clients: int = 0) -> tff.framework.SyncExecutionContext:
  """A synchronous context that runs on `worker` and supports the secure-sum intrinsics in simulation."""
  return tff.framework.SyncExecutionContext(
      executor_fn=executor_factory(worker, default_num_clients),
      compiler_fn=compile_for_simulation,
      transform_args=tff.tensorflow.transform_args,
      transform_result=tff.tensorflow.transform_result,
  )


def create_async_simulation_context(
    worker: WorkerProcess, default_num_clients: int = 0) -> tff.framework.AsyncExecutionContext:
  """The asynchronous form of `create_simulation_context` (same worker, compiler and executors): its `invoke` is
  a coroutine. Wrapped in `tff.program.NativeFederatedContext` it runs TFF programs (`set_async_simulation_context`)."""
  return tff.framework.AsyncExecutionContext(
      executor_fn=executor_factory(worker, default_num_clients),
      compiler_fn=compile_for_simulation,
      transform_args=tff.tensorflow.transform_args,
      transform_result=tff.tensorflow.transform_result,
  )


def _owned_worker(log_path: Optional[str], threads: Optional[int] = None) -> WorkerProcess:
  """The worker of the simulation contexts, started (with fresh contexts) if there is none, it died, or `threads`
  asks for other intra-op threads than it runs with (`None`: any running worker; a new one gets
  `intra_op_threads()`). Called with `STATE.lock` held."""
  threads = None if threads is None else worker_process.intra_op_threads(threads)
  worker = STATE.worker
  if threads is not None and worker is not None and worker.running() and worker.intra_op_threads != threads:
    # Restarted as the same object (callers may hold it), with fresh contexts (its address changes).
    STATE.context = STATE.program_context = None
    worker.stop()
    worker.intra_op_threads = threads
    if worker.listen_host is None:
      worker.port = None
    worker.start()
  if worker is None or not worker.running():
    default_log = log_path is None and os.environ.get('TFF_GMA_WORKER_LOG') is None
    STATE.worker = WorkerProcess(log_path=log_path or files.default_log_path(),
                                 remove_log_on_stop=default_log, intra_op_threads=threads).start()
    worker_process.install_sigterm_handler()
    STATE.context = STATE.program_context = None
  return STATE.worker


class _DropUnusedAssertionNoise(logging.Filter):
  """Drops TF's "Object was never used" report, which TFF's quantized secure sum triggers on every trace.

  Its bound assertions are built but not used in graph mode; TF then logs a long ERROR with a stack trace for
  each, although nothing is wrong. Only that report is dropped; other TF messages pass.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return 'Object was never used' not in record.getMessage()


def drop_unused_assertion_reports() -> None:
  """Adds `_DropUnusedAssertionNoise` to TF's logger (once). Called where this library's own code runs (its
  contexts, the project's entry points), never at import: a process that only imports `tff_gma` keeps TF's
  logging as it was."""
  tf_logger = logging.getLogger('tensorflow')
  if not any(isinstance(f, _DropUnusedAssertionNoise) for f in tf_logger.filters):
    tf_logger.addFilter(_DropUnusedAssertionNoise())


def stop_tff_worker_of_default_context() -> None:
  """Before the runtime replaces TFF's default context: stops the worker that context started, if it is one of
  TFF's local C++ contexts (native or test) that ran a computation; leaves it unreaped.

  TFF stops that worker only from the context's `__del__`, which runs when the context is replaced: it sends SIGINT
  and then waits without a limit. In a background job (`nohup cmd &`, a script's `cmd &`) the worker ignores
  SIGINT, and that wait never ends. So the worker is stopped here first by the bounded escalation, and left a
  zombie: TFF's `__del__` then signals it without error and reaps it at once. Anything unexpected in TFF's objects
  leaves them alone (TFF's own behaviour)."""
  process = tff_internals.local_cpp_worker_process(tff_internals.default_context())
  if process is None or process.returncode is not None:
    return  # Not TFF's local C++ context (or not as TFF 0.87 builds it), or its worker is not running.
  for signum in confinement.STOP_SIGNALS[1:]:  # SIGINT is the one such a worker may ignore.
    if not files.pid_alive(process.pid):
      return
    try:
      os.kill(process.pid, signum)  # Not `process.send_signal`: it would reap the zombie TFF's `__del__` waits for.
    except ProcessLookupError:
      return
    deadline = time.monotonic() + confinement.STOP_WAIT_S
    while files.pid_alive(process.pid) and time.monotonic() < deadline:
      time.sleep(0.01)


def set_up_entry_point() -> None:
  """For a program's entry point (`python -m tff_gma.worker`, the project's commands), before it parses its flags:
  drops TF's unused-assertion reports (`drop_unused_assertion_reports`) and, if TFF's default context is still
  its native import-time one, replaces it with TFF's `RuntimeErrorContext` and collects it now.

  That context has run nothing yet, so collecting it stops nothing; left to interpreter shutdown, its `__del__`
  ends every such program with "Exception ignored in: ... ServiceManager.__del__ ... 'NoneType' object has no
  attribute 'Popen'". A program that runs computations installs its own context afterwards
  (`set_simulation_context`). Never called at import: importing the library leaves TFF's context alone.
  """
  from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
  drop_unused_assertion_reports()
  stack = tff.framework.get_context_stack()
  if _default_context.is_native_sync_context(stack.current):
    stop_tff_worker_of_default_context()
    stack.set_default_context(tff.test.create_runtime_error_context())
    gc.collect()


def install_default(context) -> None:
  """Installs `context` as TFF's default context, stopping and collecting the one it replaces (nothing to do when
  it is the default already: a collection costs some 0.15 s in a process that has built a few processes, and the
  runner installs its context before every run)."""
  drop_unused_assertion_reports()
  if tff_internals.default_context() is context:
    return
  stop_tff_worker_of_default_context()
  # (Re)install it: another context (e.g. the multi-worker one) may have replaced it since.
  tff.framework.get_context_stack().set_default_context(context)
  # Collect a replaced context now, while the interpreter is whole: TFF's own contexts stop their worker only from
  # a `__del__`, which at interpreter shutdown fails ("'NoneType' object has no attribute 'Popen'").
  gc.collect()


def set_simulation_context(
    *, log_path: Optional[str] = None, default_num_clients: int = 0,
    intra_op_threads: Optional[int] = None) -> WorkerProcess:
  """Installs the simulation context as TFF's default context; returns the worker it runs on.

  The context for computations called from Python (`process.next(state, data)`). Idempotent: a second call keeps
  the running worker. The worker is started here, eagerly, from the calling thread (`PR_SET_PDEATHSIG` is tied to
  the thread that forks), and stopped at exit. It is confined to a private network namespace (reached through a
  Unix socket) where the kernel allows it; see `WorkerProcess` and `$TFF_GMA_WORKER_CONFINEMENT` for what happens
  where it does not. `set_async_simulation_context` installs the context TFF programs need, on the same worker.

  Args:
    log_path: file that receives the worker's log (a symbolic link there is refused). Default:
      `$TFF_GMA_WORKER_LOG` if set ('none' discards, 'stderr' shows it), else `worker_<n>.log` in this process's
      private directory (`<tmpdir>/tff_gma_worker_<pid>_<random>/`, mode 0700), removed when the worker is
      stopped (at exit); a process killed without running its exit hooks leaves it behind until the next
      process of this user that starts a worker removes it.
    default_num_clients: the CLIENTS cardinality for computations whose arguments do not fix it.
    intra_op_threads: the worker's TensorFlow intra-op threads (`WorkerProcess.intra_op_threads`): a running
      worker with another setting is replaced. `None` keeps a running worker; a new one reads
      `$TFF_GMA_WORKER_INTRA_OP_THREADS` (default 1).
  """
  with STATE.lock:
    worker = _owned_worker(log_path, intra_op_threads)
    if STATE.context is None:
      STATE.context = create_simulation_context(worker, default_num_clients)
    install_default(STATE.context)
    return worker


def simulation_context_applies() -> bool:
  """Whether TFF's current context is this module's simulation context or TFF's native synchronous context (the
  kind TFF installs at import, which cannot run the secure intrinsics): not a context the caller installed
  instead (several workers, a program context, TFF's test context)."""
  from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
  current = tff.framework.get_context_stack().current
  return (STATE.context is not None and current is STATE.context) or _default_context.is_native_sync_context(
      current)


def check_context_runs(process) -> None:
  """Raises RuntimeError, in one line naming `set_simulation_context()`, when TFF's current context is one of its
  native contexts (which cannot run the secure-sum intrinsics) and `process` (a computation, or a process whose
  `next` is checked) calls them; otherwise returns. Cheap when the context can run them (nothing is inspected).

  TFF's native context would send such a computation to its worker and fail there with a long gRPC error
  ("Cannot embed a federated value") that names neither the intrinsic nor the fix. This library's own code (the
  experiment runner) calls this before it runs anything; importing the library changes no TFF context.
  """
  from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
  if not _default_context.cannot_run_secure_sums(tff.framework.get_context_stack().current):
    return
  if hasattr(process, 'computations'):  # A round in stages (`tff_gma.learning.StagedLearningProcess`).
    comps = [c for _, c in process.computations()]
  else:
    comps = [process if isinstance(process, tff.Computation) else getattr(process, 'next', process)]
  intrinsics = sorted({i for comp in comps for i in _default_context.secure_intrinsics(comp)})
  if intrinsics:
    raise RuntimeError(_default_context.missing_context_message(intrinsics))


def set_async_simulation_context(
    *, log_path: Optional[str] = None, default_num_clients: int = 0) -> WorkerProcess:
  """Installs the context TFF programs need as TFF's default context; returns the worker it runs on.

  `tff.program` logic, `tff.learning.programs.train_model` included, runs only in a `tff.program.FederatedContext`
  (TFF checks it first) and awaits its computations: this installs `tff.program.NativeFederatedContext` over
  `create_async_simulation_context`, on the worker of `set_simulation_context` (started here if none runs), so
  it is confined, logged, stopped at exit and runs the secure intrinsics exactly as that one. Computations called
  in it return value references to materialize or await, inside an event loop (`asyncio.run(program(...))`);
  call `set_simulation_context()` to go back to plain calls. Arguments as `set_simulation_context`'s.
  """
  with STATE.lock:
    worker = _owned_worker(log_path)
    if STATE.program_context is None:
      STATE.program_context = tff.program.NativeFederatedContext(
          create_async_simulation_context(worker, default_num_clients))
    install_default(STATE.program_context)
    return worker


def shutdown() -> None:
  """Stops the worker started by `set_simulation_context` or `set_async_simulation_context` (the next call starts
  a fresh one)."""
  with STATE.lock:
    if STATE.worker is not None:
      STATE.worker.stop()
      STATE.worker = None
    STATE.context = STATE.program_context = None
