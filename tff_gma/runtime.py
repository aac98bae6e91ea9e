"""The TFF simulation execution context, with the C++ worker's lifecycle owned by this process.

TFF's own `tff.backends.test.set_sync_test_cpp_execution_context()` is the context that can run the secure
intrinsics in simulation (it lowers `federated_secure_sum*` to plain sums with overflow checks). It starts the
C++ `worker_binary` as a child process that inherits the caller's stdout/stderr and is stopped only from a
`__del__`; seen here, the worker can outlive Python and keep the caller's output pipe open, which hangs whatever
is waiting on that pipe (a CI job, `cmd | tee`). This module builds the same context around a worker it owns:

* the worker's stdout/stderr go to a log file (or are discarded), never to the caller's pipes;
* the worker runs in its own session (a Ctrl-C reaches Python, which then stops the worker cleanly) and gets
  `PR_SET_PDEATHSIG=SIGKILL`, so the kernel kills it if this process dies by any means, SIGKILL included;
* an `atexit` hook stops it at normal exit and after an uncaught exception, and SIGTERM is turned into a
  normal exit (running that hook) when no other SIGTERM handler is installed.

Usage: `tff_gma.runtime.set_simulation_context()` once, before running computations.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, Optional

import grpc
import portpicker
import tensorflow_federated as tff
from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler
from tensorflow_federated.python.core.backends.test import compiler as test_compiler
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.impl.context_stack import runtime_error_context
from tensorflow_federated.python.core.impl.types import type_conversions
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation

# Same limits as TFF's local executor factory: models cross the channel as single messages.
_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_BYTES),
]
_PR_SET_PDEATHSIG = 1
_STARTUP_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 10.0


def worker_binary_path() -> str:
  """Path of the C++ worker shipped in the tensorflow-federated wheel."""
  path = os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeError(f'TFF worker binary not found at {path}; is tensorflow-federated installed?')
  return path


def _die_with_parent() -> None:
  """Runs in the child between fork and exec: ask the kernel to SIGKILL it when the parent dies."""
  try:
    libc = ctypes.CDLL('libc.so.6', use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  except OSError:  # Not Linux: the atexit hook still stops the worker on a normal exit.
    pass


@dataclasses.dataclass
class WorkerProcess:
  """One TFF C++ worker serving gRPC on 127.0.0.1, owned by this Python process.

  Attributes:
    log_path: where the worker's stdout/stderr go; `None` discards them; the string `'stderr'` lets the
      worker write into this process's stderr (for debugging only: then it shares the caller's pipe).
    port: the port to serve on; picked when `None`.
    max_concurrent_computation_calls: passed to the worker; nonpositive means unlimited.
  """

  log_path: Optional[str] = None
  port: Optional[int] = None
  max_concurrent_computation_calls: int = -1
  remove_log_on_stop: bool = False  # For the default per-process log: do not leave one file per run behind.
  _process: Optional[subprocess.Popen] = dataclasses.field(default=None, init=False, repr=False)
  _log_file: Optional[IO[bytes]] = dataclasses.field(default=None, init=False, repr=False)

  @property
  def pid(self) -> Optional[int]:
    return self._process.pid if self._process is not None else None

  @property
  def target(self) -> str:
    return f'127.0.0.1:{self.port}'

  def running(self) -> bool:
    return self._process is not None and self._process.poll() is None

  def start(self) -> 'WorkerProcess':
    """Starts the worker and blocks until its gRPC service answers."""
    if self.running():
      return self
    if self.port is None:
      self.port = portpicker.pick_unused_port()
    if self.log_path == 'stderr':
      out = sys.stderr
    elif self.log_path is None:
      out = subprocess.DEVNULL
    else:
      self._log_file = open(self.log_path, 'ab')
      out = self._log_file
    self._process = subprocess.Popen(
        [
            worker_binary_path(),
            f'--port={self.port}',
            f'--max_concurrent_computation_calls={self.max_concurrent_computation_calls}',
        ],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT if out is not sys.stderr else sys.stderr,
        close_fds=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    _live_workers.add(self)
    self._wait_until_serving()
    return self

  def _wait_until_serving(self) -> None:
    channel = grpc.insecure_channel(self.target, _GRPC_OPTIONS)
    try:
      grpc.channel_ready_future(channel).result(timeout=_STARTUP_TIMEOUT_S)
    except grpc.FutureTimeoutError as e:
      code = self._process.poll()
      self.stop()
      raise RuntimeError(
          f'TFF worker on {self.target} did not start within {_STARTUP_TIMEOUT_S:.0f}s '
          f'(exit code {code}); its log: {self.log_path}') from e
    finally:
      channel.close()

  def stub(self) -> tff.framework.RemoteExecutorGrpcStub:
    return tff.framework.RemoteExecutorGrpcStub(grpc.insecure_channel(self.target, _GRPC_OPTIONS))

  def stop(self) -> None:
    """Stops the worker (SIGTERM, then SIGKILL) and waits for it. Safe to call more than once."""
    process, self._process = self._process, None
    if process is not None and process.poll() is None:
      process.terminate()
      try:
        process.wait(timeout=_STOP_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if self._log_file is not None:
      self._log_file.close()
      self._log_file = None
      if self.remove_log_on_stop and self.log_path and os.path.exists(self.log_path):
        os.remove(self.log_path)
    _live_workers.discard(self)

  def __hash__(self) -> int:
    return id(self)

  def __eq__(self, other) -> bool:
    return self is other


_live_workers: set[WorkerProcess] = set()
_lock = threading.Lock()
_current_worker: Optional[WorkerProcess] = None
_current_context = None


def stop_all_workers() -> None:
  """Stops every worker this process started. Registered with `atexit`."""
  for worker in list(_live_workers):
    worker.stop()


atexit.register(stop_all_workers)


def _drop_import_time_context() -> None:
  # `import tensorflow_federated` installs a default context whose executor factory's __del__ runs at interpreter
  # shutdown, when `subprocess` is already gone, and prints a spurious traceback. Replacing and collecting it at
  # exit (atexit runs before module teardown) keeps processes that never ran a computation quiet too.
  if _current_worker is None:
    tff.framework.get_context_stack().set_default_context(runtime_error_context.RuntimeErrorContext())
    gc.collect()


atexit.register(_drop_import_time_context)


def _sigterm_to_exit(signum, frame):
  del frame
  # Turn SIGTERM into a normal exit so the atexit hook stops the workers. (If the process is killed without
  # running Python code, PR_SET_PDEATHSIG still takes the worker down.)
  raise SystemExit(128 + signum)


def _install_sigterm_handler() -> None:
  if threading.current_thread() is not threading.main_thread():
    return
  if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _sigterm_to_exit)


def _compile_for_simulation(comp):
  # As TFF's test backend: lower the secure-sum intrinsics to their insecure bodies (with the overflow checks
  # of their bounds), then to what the native runtime executes.
  comp = test_compiler.replace_secure_intrinsics_with_bodies(comp)
  return native_compiler.desugar_and_transform_to_native(comp)


def _executor_factory(worker: Optional[WorkerProcess], default_num_clients: int, target: Optional[str] = None):
  """Executors on `worker` (restarted if it died), or on a worker this process does not own at `target`."""
  stub_holder = {}

  def stack_fn(cardinalities):
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = default_num_clients
    if worker is not None and not worker.running():
      # The worker died (e.g. OOM-killed): start a fresh one on a new port rather than fail every later call.
      worker.port = None
      worker.start()
      stub_holder.clear()
    if 'stub' not in stub_holder:
      stub_holder['stub'] = worker.stub() if worker is not None else tff.framework.RemoteExecutorGrpcStub(
          grpc.insecure_channel(target, _GRPC_OPTIONS))
    executor = tff.framework.RemoteExecutor(stub_holder['stub'])
    executor.set_cardinalities(cardinalities)
    return executor

  return tff.framework.ResourceManagingExecutorFactory(executor_stack_fn=stack_fn)


def _default_log_path() -> Optional[str]:
  """`TFF_GMA_WORKER_LOG`: unset -> a file in the temp dir; 'none' -> discard; 'stderr' -> our stderr."""
  setting = os.environ.get('TFF_GMA_WORKER_LOG')
  if setting is None:
    return os.path.join(tempfile.gettempdir(), f'tff_gma_worker_{os.getpid()}.log')
  if setting.lower() in ('none', 'off', ''):
    return None
  return setting


def create_simulation_context(
    worker: WorkerProcess, default_num_clients: int = 0) -> tff.framework.SyncExecutionContext:
  """A synchronous context that runs on `worker` and supports the secure-sum intrinsics in simulation."""
  return tff.framework.SyncExecutionContext(
      executor_fn=_executor_factory(worker, default_num_clients),
      compiler_fn=_compile_for_simulation,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result,
  )


def set_simulation_context(
    *, log_path: Optional[str] = None, default_num_clients: int = 0) -> WorkerProcess:
  """Installs the simulation context as TFF's default context; returns the worker it runs on.

  Idempotent: a second call keeps the running worker. The worker is started here, eagerly, from the calling
  thread (`PR_SET_PDEATHSIG` is tied to the thread that forks), and stopped at exit.

  Args:
    log_path: file that receives the worker's log. Default: `$TFF_GMA_WORKER_LOG` if set ('none' discards,
      'stderr' shows it), else `<tmpdir>/tff_gma_worker_<pid>.log`, removed when the worker is stopped (at exit);
      a process killed without running its exit hooks leaves it behind for inspection.
    default_num_clients: the CLIENTS cardinality for computations whose arguments do not fix it.
  """
  global _current_worker, _current_context
  with _lock:
    if _current_worker is None or not _current_worker.running():
      default_log = log_path is None and os.environ.get('TFF_GMA_WORKER_LOG') is None
      _current_worker = WorkerProcess(log_path=log_path or _default_log_path(),
                                      remove_log_on_stop=default_log).start()
      _install_sigterm_handler()
      _current_context = create_simulation_context(_current_worker, default_num_clients)
    # (Re)install it: another context (e.g. the multi-worker one) may have replaced it since.
    tff.framework.get_context_stack().set_default_context(_current_context)
    # Collect a replaced context now: the executor factory of TFF's import-time context has a __del__ that
    # otherwise runs at interpreter shutdown, when `subprocess` is already gone, and prints a traceback.
    gc.collect()
    return _current_worker


class _MergeableContext(tff.framework.MergeableCompExecutionContext):
  """TFF's mergeable context, returning results in the Python containers of the computation's result type.

  TFF's version converts results with the type of the compiled `after_merge` part, which has lost the
  containers (a learning process's `next` then returns an OrderedDict instead of a `LearningProcessOutput`).
  """

  def invoke(self, comp, arg=None):
    result = super().invoke(comp, arg)
    if isinstance(comp, tff.Computation):
      result = type_conversions.type_to_py_container(
          structure.from_container(result, recursive=True), comp.type_signature.result)
    return result


def set_multi_worker_context(targets: Sequence[str], *, default_num_clients: int = 0) -> None:
  """Distributes each computation's clients over the TFF workers at `targets` ('host:port', ...).

  TFF's own distributed runtime: one asynchronous context per worker and TFF's mergeable-computation context,
  which compiles a computation to `MergeableCompForm` (the work before the aggregation runs on every worker
  on its share of the clients, the partial aggregates are merged, the rest runs once). Limit of that form: one
  aggregation stage per computation, so multi-pass aggregates (RFA with more than one pass) cannot run on it
  (`check_single_aggregation_stage` says so before training). The workers are not owned here: start them with
  `start_local_workers` on this host, or `python -m tff_gma.worker --port=P` on other hosts.
  """
  if not targets:
    raise ValueError('targets must name at least one worker (host:port)')
  for target in targets:
    host, _, port = target.rpartition(':')
    if not host or not port.isdigit():
      raise ValueError(f'targets: {target!r} is not host:port')
    channel = grpc.insecure_channel(target, _GRPC_OPTIONS)
    try:
      grpc.channel_ready_future(channel).result(timeout=_STARTUP_TIMEOUT_S)
    except grpc.FutureTimeoutError as e:
      raise RuntimeError(f'no TFF worker answers at {target}') from e
    finally:
      channel.close()
  contexts = [
      tff.framework.AsyncExecutionContext(
          executor_fn=_executor_factory(None, default_num_clients, target=target),
          compiler_fn=_compile_for_simulation,
          transform_args=tensorflow_computation.transform_args,
          transform_result=tensorflow_computation.transform_result,
      ) for target in targets
  ]
  # Lower the secure intrinsics before splitting into mergeable form (as the per-worker compiler does): TFF's
  # mergeable compiler only recognises the plain aggregation intrinsics.
  context = _MergeableContext(
      async_contexts=contexts,
      compiler_fn=lambda comp: mergeable_comp_compiler.compile_to_mergeable_comp_form(
          test_compiler.replace_secure_intrinsics_with_bodies(comp)))
  tff.framework.get_context_stack().set_default_context(context)
  gc.collect()


def start_local_workers(count: int, *, log_dir: Optional[str] = None) -> list[WorkerProcess]:
  """Starts `count` owned workers on 127.0.0.1 (stopped at exit like the simulation context's worker)."""
  if count < 1:
    raise ValueError(f'count must be positive, got {count}')
  workers = []
  for i in range(count):
    log = os.path.join(log_dir, f'worker_{i}.log') if log_dir else _default_log_path()
    workers.append(WorkerProcess(log_path=log).start())
  _install_sigterm_handler()
  return workers


def check_single_aggregation_stage(process) -> int:
  """Raises ValueError if `process.next` aggregates client data in more than one sequential stage.

  TFF's mergeable-computation context (several workers) supports a single stage; the count comes from the
  static audit of the computation (`tff_gma.audit`). Returns the number of stages.
  """
  from tff_gma import audit  # pylint: disable=g-import-not-at-top
  passes = audit.audit_computation(process, policy=audit.AuditPolicy(allow_plain_sum=True)).aggregation_passes
  if passes > 1:
    raise ValueError(
        f'this process aggregates in {passes} sequential client-to-server stages; TFF\'s multi-worker '
        f'(mergeable-computation) runtime runs one stage per computation: use one worker, or a one-stage '
        f'aggregator (mean, gma, rfa_one_step)')
  return passes


def shutdown() -> None:
  """Stops the worker started by `set_simulation_context` (the next call starts a fresh one)."""
  global _current_worker
  with _lock:
    if _current_worker is not None:
      _current_worker.stop()
      _current_worker = None
