"""The TFF simulation execution context, with the C++ worker's lifecycle and exposure owned by this process.

TFF's own test context runs the secure intrinsics on a worker that inherits the caller's pipes, is stopped only from
a `__del__` and listens unauthenticated on all interfaces; this builds the same contexts around a worker it owns:
confined, logging to a file, stopped at exit by a bounded escalation. Importing it installs nothing. Which context
when: docs/runtime.md#contexts; the package's modules by job: docs/architecture.md#the-library-tff_gma.
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
