"""The TFF simulation execution context, with the C++ worker's lifecycle and exposure owned by this process.

TFF's own `tff.backends.test.set_sync_test_cpp_execution_context()` is the context that can run the secure
intrinsics in simulation (it lowers `federated_secure_sum*` to plain sums with overflow checks). It starts the
C++ `worker_binary` as a child process that inherits the caller's stdout/stderr, is stopped only from a
`__del__`, and listens on all interfaces with no authentication. This module builds the same context around a
worker it owns:

* the worker runs in a private network namespace (`tff_gma.confinement`): the driver reaches it through a Unix
  socket in a private (0700) directory, and no TCP port is open on the host; where the kernel refuses the
  namespace, `$TFF_GMA_WORKER_CONFINEMENT` decides (`require`, the default: refuse; `auto` or `off`, opt-ins:
  warn once and run it unconfined);
* the worker's stdout/stderr go to a log file (or are discarded), never to the caller's pipes; the default log
  lives in that private directory, and those of dead processes are removed;
* the worker runs in its own session (a Ctrl-C reaches Python, which then stops the worker cleanly), with SIGINT
  and SIGQUIT at their defaults whatever this process ignores (a background job's), and gets
  `PR_SET_PDEATHSIG=SIGKILL`, so the kernel kills it if this process dies by any means, SIGKILL included;
* it is stopped by a bounded escalation (SIGINT, then SIGTERM, then SIGKILL, `confinement.stop_process`), never
  waited for without a limit;
* once this module has started a worker (not at import), an `atexit` hook stops it at normal exit and after an
  uncaught exception, and SIGTERM is turned into a normal exit (running that hook) when no other SIGTERM handler
  is installed.

Importing this module changes nothing in TFF or the process: TFF's default context stays TFF's, and no exit hook,
signal handler or logging filter is installed until one of the functions below starts a worker or a context.

Usage: `tff_gma.runtime.set_simulation_context()` once, before running computations from Python;
`set_async_simulation_context()` for TFF programs (`tff.program`, `tff.learning.programs.train_model`), on the same
worker; `set_multi_worker_context(targets)` to split rounds over several workers. Which to use when, and TFF's own
contexts: docs/runtime.md#contexts.

The package by job: `worker_process.py` (`WorkerProcess`: start, stop, exit hook, SIGTERM), `listeners.py` (the
sockets a confined worker is reached through, and the confinement glue), `files.py` (the private directory, logs,
stale files), `contexts.py` (the simulation contexts and TFF's default context), `multi_worker.py` (several
workers per round), `state.py` (everything kept per process, in one object). The names below are the API.
"""

from tff_gma.runtime.contexts import check_context_runs
from tff_gma.runtime.contexts import create_async_simulation_context
from tff_gma.runtime.contexts import create_simulation_context
from tff_gma.runtime.contexts import drop_unused_assertion_reports
from tff_gma.runtime.contexts import set_async_simulation_context
from tff_gma.runtime.contexts import set_simulation_context
from tff_gma.runtime.contexts import set_up_entry_point
from tff_gma.runtime.contexts import shutdown
from tff_gma.runtime.contexts import simulation_context_applies
from tff_gma.runtime.files import pid_exists
from tff_gma.runtime.files import private_dir
from tff_gma.runtime.files import remove_stale_files
from tff_gma.runtime.listeners import confinement_status
from tff_gma.runtime.listeners import is_loopback_host
from tff_gma.runtime.multi_worker import check_single_aggregation_stage
from tff_gma.runtime.multi_worker import CONNECT_TIMEOUT_S
from tff_gma.runtime.multi_worker import set_multi_worker_context
from tff_gma.runtime.multi_worker import start_local_workers
from tff_gma.runtime.worker_process import DEFAULT_INTRA_OP_THREADS
from tff_gma.runtime.worker_process import INTRA_OP_THREADS_ENV
from tff_gma.runtime.worker_process import intra_op_threads
from tff_gma.runtime.worker_process import MAX_INTRA_OP_THREADS
from tff_gma.runtime.worker_process import stop_all_workers
from tff_gma.runtime.worker_process import worker_binary_path
from tff_gma.runtime.worker_process import WorkerProcess

__all__ = [
    'CONNECT_TIMEOUT_S',
    'DEFAULT_INTRA_OP_THREADS',
    'INTRA_OP_THREADS_ENV',
    'MAX_INTRA_OP_THREADS',
    'WorkerProcess',
    'check_context_runs',
    'check_single_aggregation_stage',
    'confinement_status',
    'create_async_simulation_context',
    'create_simulation_context',
    'drop_unused_assertion_reports',
    'intra_op_threads',
    'is_loopback_host',
    'pid_exists',
    'private_dir',
    'remove_stale_files',
    'set_async_simulation_context',
    'set_multi_worker_context',
    'set_simulation_context',
    'set_up_entry_point',
    'shutdown',
    'simulation_context_applies',
    'start_local_workers',
    'stop_all_workers',
    'worker_binary_path',
]
