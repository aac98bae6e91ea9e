"""TFF execution contexts that run this library's computations, on TFF C++ workers this process owns.

`set_simulation_context()` (calls from Python) and `set_async_simulation_context()` (`tff.program`) lower the
secure-sum intrinsics to plain sums with overflow checks, as TFF's test backend does, and run them on one worker that
is confined, logs to a file and is stopped at exit; `set_multi_worker_context` splits each round's clients over
several workers. Importing the package installs nothing: no context, exit hook or signal handler.
"""

from tff_gma.runtime.contexts import check_context_runs
from tff_gma.runtime.contexts import create_async_simulation_context
from tff_gma.runtime.contexts import create_simulation_context
from tff_gma.runtime.contexts import set_async_simulation_context
from tff_gma.runtime.contexts import set_simulation_context
from tff_gma.runtime.contexts import set_up_entry_point
from tff_gma.runtime.contexts import shutdown
from tff_gma.runtime.multi_worker import check_single_aggregation_stage
from tff_gma.runtime.multi_worker import set_multi_worker_context
from tff_gma.runtime.multi_worker import start_local_workers
from tff_gma.runtime.worker_process import WorkerProcess

__all__ = [
    'WorkerProcess',
    'check_context_runs',
    'check_single_aggregation_stage',
    'create_async_simulation_context',
    'create_simulation_context',
    'set_async_simulation_context',
    'set_multi_worker_context',
    'set_simulation_context',
    'set_up_entry_point',
    'shutdown',
    'start_local_workers',
]
