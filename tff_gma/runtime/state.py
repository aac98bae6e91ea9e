"""What `tff_gma.runtime` keeps per process, in one object.

The runtime's API is module functions (`set_simulation_context()`, ...) over TFF's one default context per process,
so the worker and contexts they install, the workers this process started, its private directory and what it
learnt about confinement belong to the process. They live in one `RuntimeState`, `STATE`, which the package's
modules read and write; creating it starts and installs nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any, Optional


@dataclasses.dataclass(eq=False)
class RuntimeState:
  """The runtime's per-process state. The pids guard against a forked child acting on its parent's directory
  and hooks: each is compared with `os.getpid()` where it is used."""

  # The simulation contexts (`contexts.py`), under `lock`.
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  worker: Any = None  # The `WorkerProcess` of `set_simulation_context` and `set_async_simulation_context`.
  context: Any = None  # The synchronous simulation context on `worker`.
  program_context: Any = None  # The `tff.program` context on `worker`.

  # Every worker this process started and has not stopped (`worker_process.py`); stopped at exit.
  live_workers: set = dataclasses.field(default_factory=set)

  # The private directory (`files.py`) and the exit hook, under `files_lock`.
  files_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  run_dir: Optional[str] = None
  run_dir_pid: Optional[int] = None  # The process that created `run_dir`.
  exit_hook_pid: Optional[int] = None  # The process that registered the exit hook.
  sigterm_received: bool = False  # A SIGTERM came: its handler is not set again (`worker_process`).
  socket_names: Any = dataclasses.field(default_factory=itertools.count)
  log_names: Any = dataclasses.field(default_factory=itertools.count)

  # Confinement (`listeners.py`), under `confinement_lock`.
  confinement_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
  confinement_unavailable: Optional[str] = None  # Why the kernel refused the namespace, once known.
  unconfined_warned: bool = False  # The one warning per process about an unconfined worker was logged.


STATE = RuntimeState()
