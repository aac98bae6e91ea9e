"""`WorkerProcess`: one TFF C++ worker owned by this process, from its start to its stop.

TFF's own contexts start `worker_binary` inheriting the caller's pipes, stop it only from a `__del__`, and leave it
listening on all interfaces. A `WorkerProcess` starts it confined where the kernel allows (`listeners.py`), logging
to a file, in its own session with default SIGINT/SIGQUIT and a `PR_SET_PDEATHSIG`, and stops it by a bounded
escalation; once one has started, an exit hook stops every live one and SIGTERM becomes a normal exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import IO, Optional

import grpc
import portpicker
import tensorflow_federated as tff

from tff_gma import confinement
from tff_gma.runtime import files
from tff_gma.runtime import listeners
from tff_gma.runtime.state import STATE

# Same limits as TFF's local executor factory: models cross the channel as single messages.
_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
GRPC_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_BYTES),
]
STARTUP_TIMEOUT_S = 120.0

# The name the runtime logged under as one module: kept, so that what a user configured for it still applies.
_logger = logging.getLogger('tff_gma.runtime')


def worker_binary_path() -> str:
  """Path of the C++ worker shipped in the tensorflow-federated wheel."""
  path = os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeError(f'TFF worker binary not found at {path}; is tensorflow-federated installed?')
  return path


INTRA_OP_THREADS_ENV = 'TFF_GMA_WORKER_INTRA_OP_THREADS'
# One intra-op thread per op in the worker. The worker runs a round's client computations side by side on its
# inter-op pool, so splitting each small op over the cores as well makes them contend, and a small round trains
# faster with one thread than with TensorFlow's default (a thread per core). Like the core count under the default,
# the count changes how some kernels split their sums, so results differ in the last bits between settings; with 1,
# they do not depend on the machine's cores.
DEFAULT_INTRA_OP_THREADS = 1
MAX_INTRA_OP_THREADS = 1024  # A pool the worker creates at start: a larger count is a typo, not a setting.


def intra_op_threads(value: Optional[int] = None) -> int:
  """The worker's intra-op threads: `value`, else `$TFF_GMA_WORKER_INTRA_OP_THREADS`, else the default (1).
  0 means TensorFlow's default. Raises ValueError naming the setting when it is not a non-negative integer."""
  name = 'intra_op_threads'
  if value is None:
    raw = os.environ.get(INTRA_OP_THREADS_ENV, '').strip()
    if not raw:
      return DEFAULT_INTRA_OP_THREADS
    name = f'${INTRA_OP_THREADS_ENV}'
    value = int(raw) if raw.lstrip('-').isdigit() else raw  # Not a number: refused below, as given.
  if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INTRA_OP_THREADS:
    raise ValueError(f'{name} must be an integer in [0, {MAX_INTRA_OP_THREADS}] (0: TensorFlow\'s default), got '
                     f'{value!r}')
  return value


@dataclasses.dataclass
class WorkerProcess:
  """One TFF C++ worker owned by this Python process, confined to a private network namespace where possible.

  Attributes:
    log_path: where the worker's stdout/stderr go; `None` discards them; the string `'stderr'` lets the
      worker write into this process's stderr (for debugging only: then it shares the caller's pipe). A
      symbolic link there is refused.
    port: the host TCP port, for a worker with `listen_host` (picked when `None` or 0), or for an unconfined
      one; a confined worker without `listen_host` has none (`None`).
    max_concurrent_computation_calls: passed to the worker; nonpositive means unlimited.
    remove_log_on_stop: remove `log_path` when the worker is stopped (for the default per-process logs).
    listen_host: `None` (default): reachable only through a Unix socket in this process's private directory
      (`target` is `unix:<path>`), from this user. Otherwise the TCP address to serve on ('' for all
      interfaces): for workers that other hosts' drivers use (`python -m tff_gma.worker`).
    unix_path: serve on a Unix socket at this path instead (`python -m tff_gma.worker --unix=PATH`): created
      0600 in a directory that must be this user's with mode 0700 (created so if missing). Not with
      `listen_host`.
    In every case the confinement helper admits, among this host's users, only this process's (effective) user:
    a connection from another local user's socket is closed before it reaches the worker
    (`confinement.PeerCheck`); TCP connections from other hosts are not identified (TFF has no authentication).
    Unconfined (opt-in), there is no such check, so only `listen_host` all interfaces is allowed then.
    confinement: 'require', 'auto' or 'off'; `None` reads `$TFF_GMA_WORKER_CONFINEMENT` (default 'require').
    intra_op_threads: the worker's TensorFlow intra-op threads (`TF_NUM_INTRAOP_THREADS` in its environment);
      0 leaves TensorFlow's default (one per core, or the caller's own `TF_NUM_INTRAOP_THREADS`); `None` reads
      `$TFF_GMA_WORKER_INTRA_OP_THREADS` (default `DEFAULT_INTRA_OP_THREADS`, see `intra_op_threads`).
  """

  log_path: Optional[str] = None
  port: Optional[int] = None
  max_concurrent_computation_calls: int = -1
  remove_log_on_stop: bool = False
  listen_host: Optional[str] = None
  confinement: Optional[str] = None
  unix_path: Optional[str] = None
  intra_op_threads: Optional[int] = None
  _process: Optional[subprocess.Popen] = dataclasses.field(default=None, init=False, repr=False)
  _log_file: Optional[IO[bytes]] = dataclasses.field(default=None, init=False, repr=False)
  _worker_pid: Optional[int] = dataclasses.field(default=None, init=False, repr=False)
  _socket_path: Optional[str] = dataclasses.field(default=None, init=False, repr=False)
  _confined: Optional[str] = dataclasses.field(default=None, init=False, repr=False)
  _owner_pid: Optional[int] = dataclasses.field(default=None, init=False, repr=False)  # The process that started it.

  @property
  def pid(self) -> Optional[int]:
    """The pid of the `worker_binary` process (not of the confinement helper that forwards to it)."""
    return self._worker_pid if self._process is not None else None

  @property
  def helper_pid(self) -> Optional[int]:
    """The pid of the confinement helper (the worker's parent), or None for an unconfined worker."""
    if self._process is None or self._process.pid == self._worker_pid:
      return None
    return self._process.pid

  @property
  def confined(self) -> Optional[str]:
    """How the running worker is confined ('network namespace', 'user and network namespace'), or None."""
    return self._confined if self._process is not None else None

  @property
  def target(self) -> str:
    """The gRPC target that reaches the worker: `unix:<path>` or `host:port`."""
    if self._socket_path is not None:
      return f'unix:{self._socket_path}'
    host = self.listen_host
    if host is None or host in listeners.ALL_INTERFACES:
      host = '127.0.0.1'
    if ':' in host:
      host = f'[{host}]'
    return f'{host}:{self.port}'

  def exposure(self) -> str:
    """Who can connect to this running worker, in words."""
    if self._process is None:
      return 'not running'
    owner = f'uid {os.geteuid()}'
    if self._socket_path is not None:
      return (f'Unix socket {self._socket_path} (0600 in a 0700 directory, and the forwarder admits only peers of '
              f'{owner}); the worker runs in a private {self._confined} with no other interface')
    everywhere = self.listen_host in (None,) + listeners.ALL_INTERFACES
    where = f'port {self.port} on ' + ('all interfaces' if everywhere else f'{self.listen_host} only')
    if self._confined:
      return (f'{where} (forwarded into a private {self._confined}; the worker itself listens nowhere else); '
              f'from this host only processes of {owner} (the forwarder refuses other users\' sockets)'
              + ('' if listeners.is_loopback_host(self.listen_host) else '; from other hosts anyone who reaches it'))
    return f'{where} (the worker itself listens there: NOT confined; any local user and any host that reaches it)'

  def running(self) -> bool:
    if self._process is None or self._process.poll() is not None:
      return False
    return self._worker_pid is None or files.pid_alive(self._worker_pid)

  def start(self) -> 'WorkerProcess':
    """Starts the worker and blocks until its gRPC service answers."""
    if self.running():
      return self
    self._release()  # A dead previous worker: its socket and helper.
    if self.unix_path is not None and self.listen_host is not None:
      raise ValueError(f'a worker serves on a Unix socket ({self.unix_path}) or on TCP '
                       f'({self.listen_host or "all interfaces"}), not both')
    setting = confinement.mode(self.confinement)
    self.intra_op_threads = intra_op_threads(self.intra_op_threads)
    out = self._output()
    try:
      started = False
      if setting != 'off' and STATE.confinement_unavailable is None:
        reason = self._start_confined(out)
        if reason is None:
          started = True
        else:
          with STATE.confinement_lock:
            STATE.confinement_unavailable = reason
      if not started:
        listeners.allow_unconfined(self, setting)
        self._start_unconfined(out)
      self._wait_until_serving()
    except BaseException as e:
      self._release()
      if self._log_file is not None:  # Kept (not removed) for the reason of the failure.
        self._log_file.close()
        self._log_file = None
      if isinstance(e, RuntimeError) and "can't start new thread" in str(e):  # A limit, not a bug: named.
        message = f'the TFF worker did not start: this process cannot start a thread ({THREAD_LIMIT_HINT})'
        raise RuntimeError(message) from e
      raise
    return self

  def _output(self):
    """Where the worker's stdout and stderr go, per `log_path`; a log file stays open until `stop`."""
    if self.log_path == 'stderr':
      return sys.stderr
    if self.log_path is None:
      return subprocess.DEVNULL
    if self._log_file is None:
      self._log_file = files.open_log(self.log_path)
    return self._log_file

  def _popen(self, argv: list[str], out, pass_fds=()) -> subprocess.Popen:
    _register_exit_hook()  # Before the process exists: stopped at exit whatever happens next.
    env = None  # Inherited (the confinement helper passes its environment on to the worker).
    if self.intra_op_threads:
      env = {**os.environ, 'TF_NUM_INTRAOP_THREADS': str(self.intra_op_threads)}
    process = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT if out is not sys.stderr else sys.stderr,
        close_fds=True,
        pass_fds=pass_fds,
        start_new_session=True,
        preexec_fn=confinement.die_with_parent_of(os.getpid()),
    )
    self._process = process
    self._owner_pid = os.getpid()
    STATE.live_workers.add(self)
    return process

  def _worker_flags(self) -> list[str]:
    return [f'--max_concurrent_computation_calls={self.max_concurrent_computation_calls}']

  def _start_confined(self, out) -> Optional[str]:
    """Starts the helper and the worker in its namespace; returns why confinement is unavailable, or None."""
    requested_port = self.port
    if self.unix_path is not None:
      listener = listeners.unix_listener(self.unix_path)
      self._socket_path = os.path.abspath(self.unix_path)
    elif self.listen_host is None:
      path = files.socket_path()
      listener = listeners.private_unix_listener(path)
      self._socket_path = path
    else:
      listener = listeners.tcp_listener(self.listen_host, self.port or 0)
      self.port = listener.getsockname()[1]
    read_fd, write_fd = os.pipe()
    try:
      listener.listen(128)
      process = self._popen(
          confinement.helper_command() + [str(listener.fileno()), str(write_fd), worker_binary_path()]
          + self._worker_flags(), out, pass_fds=(listener.fileno(), write_fd))
    except BaseException:
      os.close(read_fd)
      raise
    finally:
      os.close(write_fd)
      listener.close()
    status = listeners.read_status(read_fd, process, STARTUP_TIMEOUT_S)
    if status is not None and status.get('ok'):
      self._worker_pid = int(status['pid'])
      self._confined = status.get('how', 'network namespace')
      return None
    if status is not None and status.get('unavailable'):
      process.wait()
      self._release()
      self.port = requested_port
      return str(status.get('reason'))
    reason = status.get('reason') if status else f'its confinement helper {describe_exit(process.poll())}'
    raise RuntimeError(f'the TFF worker did not start: {_with_signal_name(str(reason))}{self._failure_log()}')

  def _start_unconfined(self, out) -> None:
    if not self.port:
      self.port = portpicker.pick_unused_port()
    process = self._popen([worker_binary_path(), f'--port={self.port}'] + self._worker_flags(), out)
    self._worker_pid = process.pid
    self._confined = None

  def _wait_until_serving(self) -> None:
    """Until the worker's gRPC service answers; a worker that exits meanwhile fails at once, not at the timeout."""
    channel = grpc.insecure_channel(self.target, GRPC_OPTIONS)
    ready = grpc.channel_ready_future(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
      while True:
        try:
          ready.result(timeout=0.25)
          return
        except grpc.FutureTimeoutError:
          code = self._process.poll()
          if code is None and time.monotonic() < deadline:
            continue
        how = f'not serving within {STARTUP_TIMEOUT_S:.0f}s' if code is None else describe_exit(code)
        raise RuntimeError(f'the TFF worker on {self.target} did not start: {how}{self._failure_log()}')
    finally:
      ready.cancel()
      channel.close()

  def _failure_log(self) -> str:
    """The end of a start failure's message: the log to read (one that outlives this process: a default log is
    moved out of the private directory, which is removed at exit), and a thread fault it shows, named."""
    if self.log_path is None:
      return ' (its output was discarded; a log path keeps it)'
    if self.log_path == 'stderr':
      return ' (its log is above, on stderr)'
    if self.remove_log_on_stop:
      kept = files.keep_log(self.log_path)
      if kept is not None:
        self.log_path, self.remove_log_on_stop = kept, False
    if self._log_file is not None:
      self._log_file.flush()
    return f'{_thread_fault_in(self.log_path)}; log: {self.log_path}'

  def stub(self) -> tff.framework.RemoteExecutorGrpcStub:
    return tff.framework.RemoteExecutorGrpcStub(grpc.insecure_channel(self.target, GRPC_OPTIONS))

  def _release(self) -> None:
    """Stops the processes (SIGINT, SIGTERM, then SIGKILL, each after a short wait: `confinement.stop_process`),
    removes the socket; keeps the log. Bounded (about 3 x `confinement.STOP_WAIT_S`, then up to 5 s for the worker
    to follow its helper), even for a process that ignores signals."""
    process, self._process = self._process, None
    worker_pid, self._worker_pid = self._worker_pid, None
    if process is not None:
      # The helper stops its worker (the same escalation) and exits; SIGKILLed, its worker follows it
      # (PR_SET_PDEATHSIG).
      if confinement.stop_process(process) is None:
        _logger.warning('TFF worker process %d did not end within the stop escalation (SIGINT, SIGTERM, SIGKILL)',
                        process.pid)
      if worker_pid is not None and worker_pid != process.pid:
        deadline = time.monotonic() + 5.0
        while files.pid_alive(worker_pid) and time.monotonic() < deadline:
          time.sleep(0.01)
    if self._socket_path is not None:
      try:
        os.unlink(self._socket_path)
      except OSError:
        pass
      self._socket_path = None
    self._confined = None
    STATE.live_workers.discard(self)

  def stop(self) -> None:
    """Stops the worker (SIGINT, SIGTERM, then SIGKILL; bounded waits). Safe to call more than once."""
    self._release()
    if self._log_file is not None:
      self._log_file.close()
      self._log_file = None
      if self.remove_log_on_stop and self.log_path and os.path.lexists(self.log_path):
        os.remove(self.log_path)

  def __hash__(self) -> int:
    return id(self)

  def __eq__(self, other) -> bool:
    return self is other


THREAD_LIMIT_HINT = "the process's thread or address-space limit: ulimit -u / -v"
# What TensorFlow, gRPC and glibc log before aborting when a thread cannot be created.
_THREAD_FAULT = re.compile(r'pthread_create|cannot allocate memory for thread|Could not create [^\n]*thread')


def describe_exit(code: Optional[int]) -> str:
  """'exited with code 1', 'exited with code -6 (SIGABRT)': a signal that ended it named (also in the confinement
  helper's 128 + the signal that ended its worker)."""
  if code is None:
    return 'still running'
  if code < 0 or 128 < code < 128 + signal.NSIG:
    return f'exited with code {code} ({_signal_name(-code if code < 0 else code - 128)})'
  return f'exited with code {code}'


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f'signal {number}'


def _with_signal_name(reason: str) -> str:
  """The helper's reason ('the worker exited with code -6 at start') with the signal named."""
  return re.sub(r'exited with code (-\d+)', lambda m: describe_exit(int(m.group(1))), reason)


def _thread_fault_in(log_path: str) -> str:
  """': it could not start a thread (<the limits>)' when the log's end says so (TensorFlow aborts then), else ''.
  Read as the log was opened: not through a link, and only a regular file (a FIFO's read would wait)."""
  try:
    fd = os.open(log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return ''
  with os.fdopen(fd, 'rb') as f:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return ''
    f.seek(max(0, st.st_size - 16384))
    tail = f.read().decode('utf-8', 'replace')
  if _THREAD_FAULT.search(tail):
    return f': it could not start a thread ({THREAD_LIMIT_HINT})'
  return ''


def stop_all_workers() -> None:
  """Stops every worker this process started, and removes its private directory. Registered with `atexit` when
  the first worker starts."""
  for worker in list(STATE.live_workers):
    if worker._owner_pid == os.getpid():  # pylint: disable=protected-access  # Not a forked parent's.
      worker.stop()
  files.remove_private_dir()


def _register_exit_hook() -> None:
  """Registers `stop_all_workers` with `atexit`, once per process, when this module starts its first process (a
  forked child registers its own)."""
  with STATE.files_lock:
    if STATE.exit_hook_pid == os.getpid():
      return
    STATE.exit_hook_pid = os.getpid()
  atexit.register(stop_all_workers)


# After a SIGTERM, how long the normal exit it starts may take (a checkpoint finished, workers stopped) before the
# process ends anyway: a caller that catches the SystemExit (pytest records it as the test's failure and goes on)
# would otherwise outlive the SIGTERM that, without the library, ends it at once.
SIGTERM_GRACE_S = 30.0


def _sigterm_to_exit(signum, frame):
  del frame
  # Turn SIGTERM into a normal exit so the atexit hook stops the workers. (If the process is killed without
  # running Python code, PR_SET_PDEATHSIG still takes the worker down.) A second SIGTERM gets the default action,
  # and the grace period bounds the first: both as without the library.
  STATE.sigterm_received = True
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  threading.Thread(target=_exit_after, args=(SIGTERM_GRACE_S, 128 + signum), daemon=True,
                   name='tff_gma-sigterm-grace').start()
  raise SystemExit(128 + signum)


def _exit_after(seconds: float, code: int) -> None:
  time.sleep(seconds)
  try:  # The workers' sockets and default logs, which the exit hook would have removed; never blocks the exit.
    files.remove_private_dir(lock_timeout=1.0)
  finally:
    os._exit(code)  # Past the grace: no more Python code runs; PR_SET_PDEATHSIG takes the workers down.


def install_sigterm_handler() -> None:
  """Turns SIGTERM into a normal exit (which runs the exit hook), unless another handler is set, this is not the
  main thread (where Python cannot set one), or a SIGTERM already came (its grace period is running)."""
  if threading.current_thread() is not threading.main_thread() or STATE.sigterm_received:
    return
  if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _sigterm_to_exit)
