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
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import errno
import gc
import itertools
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
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

from tff_gma import confinement

# Same limits as TFF's local executor factory: models cross the channel as single messages.
_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_BYTES),
]
_PR_SET_PDEATHSIG = 1
_STARTUP_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0  # For workers this process does not own (`set_multi_worker_context`).
_ALL_INTERFACES = ('', '0.0.0.0', '::')
_RUN_DIR_PREFIX = 'tff_gma_worker_'
# Per-process private directories (`<prefix><pid>_<random>`) and the per-process logs of older versions
# (`<prefix><pid>.log`).
_STALE_NAME = re.compile(re.escape(_RUN_DIR_PREFIX) + r'(\d+)(?:_\w+|\.log)')
_MAX_SOCKET_DIR_LEN = 80  # sun_path holds 107 bytes; the socket's name adds about 20.

_logger = logging.getLogger(__name__)


def worker_binary_path() -> str:
  """Path of the C++ worker shipped in the tensorflow-federated wheel."""
  path = os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeError(f'TFF worker binary not found at {path}; is tensorflow-federated installed?')
  return path


def _die_with_parent_of(parent_pid: int):
  def preexec() -> None:
    """Runs in the child between fork and exec: default SIGINT/SIGQUIT, and a SIGKILL when the parent dies."""
    confinement.reset_signal_dispositions()
    try:
      libc = ctypes.CDLL('libc.so.6', use_errno=True)
      libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # Not Linux: the atexit hook still stops the worker on a normal exit.
      return
    if os.getppid() != parent_pid:  # The parent died before prctl took effect.
      os._exit(1)  # pylint: disable=protected-access
  return preexec


def _pid_alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie does not)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
  except FileNotFoundError:
    return False
  except OSError:
    return pid_exists(pid)


def pid_exists(pid: int) -> bool:
  """Whether a process `pid` exists (one of another user counts)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


# --- Private per-process directory: default logs and the workers' Unix sockets. ---------------------------------

_dir_lock = threading.Lock()
_run_dir: Optional[str] = None
_run_dir_pid: Optional[int] = None
_socket_names = itertools.count()


def remove_stale_files(directory: Optional[str] = None) -> list[str]:
  """Removes the private directories and logs that processes of this user, now dead, left in `directory`.

  A process killed without running its exit hooks (SIGKILL, OOM) leaves them behind. Only entries owned by this
  user whose pid is gone are removed; symbolic links are never followed. Returns the removed paths.
  """
  directory = directory or tempfile.gettempdir()
  removed = []
  try:
    names = os.listdir(directory)
  except OSError:
    return removed
  for name in names:
    match = _STALE_NAME.fullmatch(name)
    if not match or int(match.group(1)) == os.getpid():
      continue
    path = os.path.join(directory, name)
    try:
      st = os.lstat(path)
      if st.st_uid != os.geteuid() or pid_exists(int(match.group(1))):
        continue
      if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # Does not follow symbolic links inside.
      elif stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        os.unlink(path)
      else:
        continue
      removed.append(path)
    except OSError:
      continue
  return removed


def private_dir() -> str:
  """This process's private directory (mode 0700, random name), created on first use, removed at exit."""
  global _run_dir, _run_dir_pid
  with _dir_lock:
    if _run_dir is None or _run_dir_pid != os.getpid() or not os.path.isdir(_run_dir):
      base = tempfile.gettempdir()
      remove_stale_files(base)
      if len(base) > _MAX_SOCKET_DIR_LEN - 30 and os.path.isdir('/tmp'):
        base = '/tmp'  # Unix socket paths are short.
        remove_stale_files(base)
      _run_dir = tempfile.mkdtemp(prefix=f'{_RUN_DIR_PREFIX}{os.getpid()}_', dir=base)
      _run_dir_pid = os.getpid()
    return _run_dir


def _remove_private_dir() -> None:
  global _run_dir
  with _dir_lock:
    if _run_dir is not None and _run_dir_pid == os.getpid():
      shutil.rmtree(_run_dir, ignore_errors=True)
    _run_dir = None


def _open_log(path: str) -> IO[bytes]:
  """Opens `path` for appending without following a symbolic link there (mode 0600 if created); only a regular
  file. Non-blocking while it checks: opening a FIFO for writing would otherwise wait for a reader forever."""
  flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
  try:
    fd = os.open(path, flags, 0o600)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise RuntimeError(f'TFF worker log {path} is a symbolic link; refusing to follow it') from e
    if e.errno == errno.ENXIO:  # A FIFO (or socket) with no reader.
      raise RuntimeError(f'TFF worker log {path} is not a regular file (a FIFO or socket); refusing it') from e
    raise
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    os.close(fd)
    raise RuntimeError(f'TFF worker log {path} is not a regular file; refusing it')
  os.set_blocking(fd, True)
  return os.fdopen(fd, 'ab')


# --- Confinement state (per process). ---------------------------------------------------------------------------

_confinement_lock = threading.Lock()
_confinement_unavailable: Optional[str] = None  # Why the kernel refused the namespace, once known.
_unconfined_warned = False


def confinement_status() -> str:
  """'available', 'unavailable: <reason>' or 'unknown' (no worker started yet) for this process."""
  if _confinement_unavailable is not None:
    return f'unavailable: {_confinement_unavailable}'
  if any(w.confined for w in list(_live_workers)):
    return 'available'
  return 'unknown'


def _allow_unconfined(worker: 'WorkerProcess', setting: str) -> None:
  """Raises if the worker may not run unconfined; otherwise warns (once per process) that it is exposed."""
  global _unconfined_warned
  reason = (f'{confinement.ENV_VAR}=off' if setting == 'off'
            else f'{confinement.unavailable_advice()}: {_confinement_unavailable}')
  if setting == 'require':
    chosen = (f'{confinement.ENV_VAR}=require' if os.environ.get(confinement.ENV_VAR, '').strip()
              else f'the default; {confinement.ENV_VAR} is unset')
    raise RuntimeError(
        f'TFF worker confinement is required ({chosen}) but unavailable: {reason}. Unconfined, the worker would '
        f'listen on all interfaces without authentication, so any host that reaches this one could run code in '
        f'it. Allow network namespaces for this user (or run as root), or opt in to the exposed worker with '
        f'{confinement.ENV_VAR}=off (or auto: confined where the kernel allows it).')
  # Unconfined, the worker itself listens on all interfaces and no forwarder checks who connects: a listener
  # restricted to loopback, an address or a Unix socket would only pretend to restrict it. Running the forwarder
  # anyway would not help either: the worker's own port on all interfaces (127.0.0.1 included) stays open to every
  # local user and every host. So those are refused, and the exposed worker stays an explicit opt-in.
  if worker.unix_path is not None:
    raise RuntimeError(
        f'cannot serve the TFF worker on the Unix socket {worker.unix_path}: confinement is unavailable ({reason}), '
        f'so the worker itself would listen on all interfaces, to any local user and any host')
  if worker.listen_host not in (None,) + _ALL_INTERFACES:
    raise RuntimeError(
        f'cannot restrict the TFF worker to {worker.listen_host}: the worker itself listens on all interfaces, '
        f'and confinement is unavailable ({reason}); use a firewall or a private network instead')
  with _confinement_lock:
    if _unconfined_warned:
      return
    _unconfined_warned = True
  _logger.warning(
      'TFF worker NOT confined (%s). It listens on all interfaces of its port without authentication: any host '
      'that can reach this machine, and any local process, can run TensorFlow graphs in it as uid %d. '
      'Set %s=require to refuse to run instead (docs/runtime.md: "The TFF worker process").',
      reason, os.geteuid(), confinement.ENV_VAR)


def _read_status(fd: int, process: subprocess.Popen, timeout: float) -> Optional[dict]:
  """The helper's one JSON status line, or None if it ended (or timed out) without one. Closes `fd`."""
  deadline = time.monotonic() + timeout
  data = b''
  try:
    while b'\n' not in data:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return None
      ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
      if ready:
        chunk = os.read(fd, 4096)
        if not chunk:
          break
        data += chunk
      elif process.poll() is not None:
        break
  finally:
    os.close(fd)
  line = data.split(b'\n', 1)[0]
  return json.loads(line) if line else None


def _tcp_listener(host: str, port: int) -> socket.socket:
  """A listening TCP socket on host:port ('' = all interfaces, IPv6 and IPv4 where possible)."""
  if host in ('', '::') and socket.has_ipv6:
    try:
      sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
      sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind(('::', port))
      return sock
    except OSError:
      sock.close()
  family, kind, proto, _, address = socket.getaddrinfo(
      host or '0.0.0.0', port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
  sock = socket.socket(family, kind, proto)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind(address)
  except OSError:
    sock.close()
    raise
  return sock


def is_loopback_host(host: Optional[str]) -> bool:
  """Whether `host` (a --bind value) names this host's loopback."""
  return host is not None and (host == 'localhost' or host.startswith('127.') or host in ('::1', '[::1]'))


def _unix_listener(path: str) -> socket.socket:
  """A Unix socket bound at `path` (mode 0600), in a directory of this user's with mode 0700, created if missing.

  Raises RuntimeError (one line) when the directory is another user's, a symbolic link or open to others, or
  when something that is not a stale socket lies at `path`.
  """
  path = os.path.abspath(path)
  if len(os.fsencode(path)) > 107:
    raise RuntimeError(f'Unix socket path {path} is {len(os.fsencode(path))} bytes long; at most 107 fit')
  directory = os.path.dirname(path)
  try:
    os.mkdir(directory, 0o700)
    os.chmod(directory, 0o700)  # Whatever the umask.
  except FileExistsError:
    pass
  except OSError as e:
    raise RuntimeError(f'cannot create the Unix socket\'s directory {directory}: {e.strerror}') from None
  st = os.lstat(directory)
  if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
    raise RuntimeError(f'the Unix socket\'s directory {directory} is not a directory (a symbolic link is refused)')
  if st.st_uid != os.geteuid():
    raise RuntimeError(f'the Unix socket\'s directory {directory} belongs to uid {st.st_uid}, not to this user '
                       f'(uid {os.geteuid()}); use a directory of your own with mode 0700')
  if stat.S_IMODE(st.st_mode) != 0o700:
    raise RuntimeError(f'the Unix socket\'s directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}; it must be '
                       f'0700 (chmod 700 {directory}), so that no other user can reach the socket')
  try:
    existing = os.lstat(path)
  except FileNotFoundError:
    existing = None
  if existing is not None:
    if not stat.S_ISSOCK(existing.st_mode):
      raise RuntimeError(f'{path} exists and is not a socket; refusing to replace it')
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
      try:
        probe.connect(path)
        serving = True
      except OSError:  # ECONNREFUSED: a socket left by a dead process.
        serving = False
    if serving:
      raise RuntimeError(f'another process serves on {path}; stop it or pick another path')
    os.unlink(path)
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    listener.bind(path)
    os.chmod(path, 0o600)
  except OSError as e:
    listener.close()
    raise RuntimeError(f'cannot serve on the Unix socket {path}: {e.strerror}') from None
  return listener


INTRA_OP_THREADS_ENV = 'TFF_GMA_WORKER_INTRA_OP_THREADS'
# One intra-op thread per op in the worker. The worker runs a round's client computations side by side on its
# inter-op pool, so splitting each small op over the cores as well makes them contend. Measured on this 2-core
# machine (one run each, interleaved, the study paused): LeNet on Fashion-MNIST, 10 clients of 600 a round, 0.69 s
# a round's training against 0.86-1.05 s with TensorFlow's default (a thread per core); the digits CNN 0.31-0.38 s
# against 0.40-0.41 s. Like the core count under the default, the count changes how some kernels split their
# sums, so results differ in the last bits between settings; with 1, they no longer depend on the machine's cores.
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
    if host is None or host in _ALL_INTERFACES:
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
    everywhere = self.listen_host in (None,) + _ALL_INTERFACES
    where = f'port {self.port} on ' + ('all interfaces' if everywhere else f'{self.listen_host} only')
    if self._confined:
      return (f'{where} (forwarded into a private {self._confined}; the worker itself listens nowhere else); '
              f'from this host only processes of {owner} (the forwarder refuses other users\' sockets)'
              + ('' if is_loopback_host(self.listen_host) else '; from other hosts anyone who reaches it'))
    return f'{where} (the worker itself listens there: NOT confined; any local user and any host that reaches it)'

  def running(self) -> bool:
    if self._process is None or self._process.poll() is not None:
      return False
    return self._worker_pid is None or _pid_alive(self._worker_pid)

  def start(self) -> 'WorkerProcess':
    """Starts the worker and blocks until its gRPC service answers."""
    global _confinement_unavailable
    if self.running():
      return self
    self._release()  # A dead previous worker: its socket and helper.
    if self.unix_path is not None and self.listen_host is not None:
      raise ValueError(f'a worker serves on a Unix socket ({self.unix_path}) or on TCP '
                       f'({self.listen_host or "all interfaces"}), not both')
    setting = confinement.mode(self.confinement)
    self.intra_op_threads = intra_op_threads(self.intra_op_threads)
    if self.log_path == 'stderr':
      out = sys.stderr
    elif self.log_path is None:
      out = subprocess.DEVNULL
    else:
      if self._log_file is None:
        self._log_file = _open_log(self.log_path)
      out = self._log_file
    try:
      started = False
      if setting != 'off' and _confinement_unavailable is None:
        reason = self._start_confined(out)
        if reason is None:
          started = True
        else:
          with _confinement_lock:
            _confinement_unavailable = reason
      if not started:
        _allow_unconfined(self, setting)
        self._start_unconfined(out)
      self._wait_until_serving()
    except BaseException:
      self._release()
      if self._log_file is not None:  # Kept (not removed) for the reason of the failure.
        self._log_file.close()
        self._log_file = None
      raise
    return self

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
        preexec_fn=_die_with_parent_of(os.getpid()),
    )
    self._process = process
    self._owner_pid = os.getpid()
    _live_workers.add(self)
    return process

  def _worker_flags(self) -> list[str]:
    return [f'--max_concurrent_computation_calls={self.max_concurrent_computation_calls}']

  def _start_confined(self, out) -> Optional[str]:
    """Starts the helper and the worker in its namespace; returns why confinement is unavailable, or None."""
    requested_port = self.port
    if self.unix_path is not None:
      listener = _unix_listener(self.unix_path)
      self._socket_path = os.path.abspath(self.unix_path)
    elif self.listen_host is None:
      path = os.path.join(private_dir(), f'worker_{next(_socket_names)}.sock')
      listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      try:
        listener.bind(path)
        os.chmod(path, 0o600)
      except OSError:
        listener.close()
        raise
      self._socket_path = path
    else:
      listener = _tcp_listener(self.listen_host, self.port or 0)
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
    status = _read_status(read_fd, process, _STARTUP_TIMEOUT_S)
    if status is not None and status.get('ok'):
      self._worker_pid = int(status['pid'])
      self._confined = status.get('how', 'network namespace')
      return None
    if status is not None and status.get('unavailable'):
      process.wait()
      self._release()
      self.port = requested_port
      return str(status.get('reason'))
    code = process.poll()
    raise RuntimeError(
        f'the TFF worker (confinement helper pid {process.pid}) did not start'
        + (f': {status.get("reason")}' if status else f' (exit code {code})') + f'; its log: {self.log_path}')

  def _start_unconfined(self, out) -> None:
    if not self.port:
      self.port = portpicker.pick_unused_port()
    process = self._popen([worker_binary_path(), f'--port={self.port}'] + self._worker_flags(), out)
    self._worker_pid = process.pid
    self._confined = None

  def _wait_until_serving(self) -> None:
    channel = grpc.insecure_channel(self.target, _GRPC_OPTIONS)
    try:
      grpc.channel_ready_future(channel).result(timeout=_STARTUP_TIMEOUT_S)
    except grpc.FutureTimeoutError as e:
      code = self._process.poll()
      raise RuntimeError(
          f'TFF worker on {self.target} did not start within {_STARTUP_TIMEOUT_S:.0f}s '
          f'(exit code {code}); its log: {self.log_path}') from e
    finally:
      channel.close()

  def stub(self) -> tff.framework.RemoteExecutorGrpcStub:
    return tff.framework.RemoteExecutorGrpcStub(grpc.insecure_channel(self.target, _GRPC_OPTIONS))

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
        while _pid_alive(worker_pid) and time.monotonic() < deadline:
          time.sleep(0.01)
    if self._socket_path is not None:
      try:
        os.unlink(self._socket_path)
      except OSError:
        pass
      self._socket_path = None
    self._confined = None
    _live_workers.discard(self)

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


_live_workers: set[WorkerProcess] = set()
_lock = threading.Lock()
_current_worker: Optional[WorkerProcess] = None
_current_context = None  # The synchronous simulation context on `_current_worker`.
_current_program_context = None  # The `tff.program` context on `_current_worker`.


def stop_all_workers() -> None:
  """Stops every worker this process started, and removes its private directory. Registered with `atexit` when
  the first worker starts."""
  for worker in list(_live_workers):
    if worker._owner_pid == os.getpid():  # pylint: disable=protected-access  # Not a forked parent's.
      worker.stop()
  _remove_private_dir()


_exit_hook_pid: Optional[int] = None


def _register_exit_hook() -> None:
  """Registers `stop_all_workers` with `atexit`, once per process, when this module starts its first process (a
  forked child registers its own)."""
  global _exit_hook_pid
  with _dir_lock:
    if _exit_hook_pid == os.getpid():
      return
    _exit_hook_pid = os.getpid()
  atexit.register(stop_all_workers)


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
      # The worker died (e.g. OOM-killed): start a fresh one rather than fail every later call.
      if worker.listen_host is None:
        worker.port = None
      worker.start()
      stub_holder.clear()
    if worker is not None and stub_holder.get('target') != worker.target:
      stub_holder.clear()  # The worker was restarted elsewhere (e.g. with other intra-op threads).
    if 'stub' not in stub_holder:
      stub_holder['stub'] = worker.stub() if worker is not None else tff.framework.RemoteExecutorGrpcStub(
          grpc.insecure_channel(target, _GRPC_OPTIONS))
      stub_holder['target'] = worker.target if worker is not None else target
    executor = tff.framework.RemoteExecutor(stub_holder['stub'])
    executor.set_cardinalities(cardinalities)
    return executor

  return tff.framework.ResourceManagingExecutorFactory(executor_stack_fn=stack_fn)


_log_names = itertools.count()


def _default_log_path() -> Optional[str]:
  """`TFF_GMA_WORKER_LOG`: unset -> a new file in the private directory; 'none' -> discard; 'stderr' -> ours."""
  setting = os.environ.get('TFF_GMA_WORKER_LOG')
  if setting is None:
    return os.path.join(private_dir(), f'worker_{next(_log_names)}.log')
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


def create_async_simulation_context(
    worker: WorkerProcess, default_num_clients: int = 0) -> tff.framework.AsyncExecutionContext:
  """The asynchronous form of `create_simulation_context` (same worker, compiler and executors): its `invoke` is
  a coroutine. Wrapped in `tff.program.NativeFederatedContext` it runs TFF programs (`set_async_simulation_context`)."""
  return tff.framework.AsyncExecutionContext(
      executor_fn=_executor_factory(worker, default_num_clients),
      compiler_fn=_compile_for_simulation,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result,
  )


def _owned_worker(log_path: Optional[str], threads: Optional[int] = None) -> WorkerProcess:
  """The worker of the simulation contexts, started (with fresh contexts) if there is none, it died, or `threads`
  asks for other intra-op threads than it runs with (`None`: any running worker; a new one gets
  `intra_op_threads()`). Called with `_lock` held."""
  global _current_worker, _current_context, _current_program_context
  threads = None if threads is None else intra_op_threads(threads)
  if (threads is not None and _current_worker is not None and _current_worker.running()
      and _current_worker.intra_op_threads != threads):
    # Restarted as the same object (callers may hold it), with fresh contexts (its address changes).
    _current_context = _current_program_context = None
    _current_worker.stop()
    _current_worker.intra_op_threads = threads
    if _current_worker.listen_host is None:
      _current_worker.port = None
    _current_worker.start()
  if _current_worker is None or not _current_worker.running():
    default_log = log_path is None and os.environ.get('TFF_GMA_WORKER_LOG') is None
    _current_worker = WorkerProcess(log_path=log_path or _default_log_path(),
                                    remove_log_on_stop=default_log, intra_op_threads=threads).start()
    _install_sigterm_handler()
    _current_context = _current_program_context = None
  return _current_worker


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


def _stop_tff_worker_of_default_context() -> None:
  """Before this module replaces TFF's default context: stops the worker that context started, if it is one of
  TFF's local C++ contexts (native or test) that ran a computation; leaves it unreaped.

  TFF stops that worker only from the context's `__del__`, which runs when the context is replaced: it sends SIGINT
  and then waits without a limit. In a background job (`nohup cmd &`, a script's `cmd &`) the worker ignores
  SIGINT, and that wait never ends. So the worker is stopped here first by the bounded escalation, and left a
  zombie: TFF's `__del__` then signals it without error and reaps it at once. Anything unexpected in TFF's objects
  leaves them alone (TFF's own behaviour)."""
  stack = tff.framework.get_context_stack()
  frames = getattr(stack, '_stack', None) or [None]  # The bottom frame is the default (TFF 0.87's layout).
  context = frames[0]
  context = getattr(context, '_context', context)  # `tff.program.NativeFederatedContext`.
  context = getattr(context, '_async_context', context)  # A synchronous context's asynchronous one.
  stack_fn = getattr(getattr(context, '_executor_factory', None), '_executor_stack_fn', None)
  try:
    cells = dict(zip(stack_fn.__code__.co_freevars, stack_fn.__closure__ or ()))
    process = cells['service_manager'].cell_contents._process  # pylint: disable=protected-access
  except (AttributeError, KeyError, ValueError):
    return  # Not TFF's local C++ executor factory (or not as TFF 0.87 builds it).
  if not isinstance(process, subprocess.Popen) or process.returncode is not None:
    return
  for signum in confinement.STOP_SIGNALS[1:]:  # SIGINT is the one such a worker may ignore.
    if not _pid_alive(process.pid):
      return
    try:
      os.kill(process.pid, signum)  # Not `process.send_signal`: it would reap the zombie TFF's `__del__` waits for.
    except ProcessLookupError:
      return
    deadline = time.monotonic() + confinement.STOP_WAIT_S
    while _pid_alive(process.pid) and time.monotonic() < deadline:
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
    _stop_tff_worker_of_default_context()
    stack.set_default_context(runtime_error_context.RuntimeErrorContext())
    gc.collect()


def _install_default(context) -> None:
  drop_unused_assertion_reports()
  _stop_tff_worker_of_default_context()
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
  global _current_context
  with _lock:
    worker = _owned_worker(log_path, intra_op_threads)
    if _current_context is None:
      _current_context = create_simulation_context(worker, default_num_clients)
    _install_default(_current_context)
    return worker


def simulation_context_applies() -> bool:
  """Whether TFF's current context is this module's simulation context or TFF's native synchronous context (the
  kind TFF installs at import, which cannot run the secure intrinsics): not a context the caller installed
  instead (several workers, a program context, TFF's test context)."""
  from tff_gma import _default_context  # pylint: disable=g-import-not-at-top
  current = tff.framework.get_context_stack().current
  return (_current_context is not None and current is _current_context) or _default_context.is_native_sync_context(
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
  comp = process if isinstance(process, tff.Computation) else getattr(process, 'next', process)
  intrinsics = _default_context.secure_intrinsics(comp)
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
  global _current_program_context
  with _lock:
    worker = _owned_worker(log_path)
    if _current_program_context is None:
      _current_program_context = tff.program.NativeFederatedContext(
          create_async_simulation_context(worker, default_num_clients))
    _install_default(_current_program_context)
    return worker


class _MergeableContext(tff.framework.MergeableCompExecutionContext):
  """TFF's mergeable context, returning results in the Python containers of the computation's result type.

  TFF's version converts results with the type of the compiled `after_merge` part, which has lost the
  containers (a learning process's `next` then returns an OrderedDict instead of a `LearningProcessOutput`).
  """

  def invoke(self, comp, arg=None):
    result = super().invoke(comp, arg)
    if isinstance(comp, tff.Computation) and isinstance(result, (structure.Struct, list, tuple, dict)):
      result = type_conversions.type_to_py_container(
          structure.from_container(result, recursive=True), comp.type_signature.result)
    return result


def _check_target(target: str) -> None:
  """Raises ValueError unless `target` is 'host:port' (IPv6 hosts in brackets) or 'unix:/absolute/path'."""
  if target.startswith('unix:'):
    if not target[len('unix:'):].lstrip('/'):
      raise ValueError(f'targets: {target!r} names no socket path')
    return
  host, _, port = target.rpartition(':')
  if not host or not port.isdigit():
    raise ValueError(f'targets: {target!r} is not host:port')


def _connect_probe(target: str, timeout: float) -> None:
  """A plain connection to `target` (no gRPC), so that nothing listening fails at once, naming the address."""
  try:
    if target.startswith('unix:'):
      path = target[len('unix:'):]
      if path.startswith('//'):
        path = path[2:]
      with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
    else:
      host, _, port = target.rpartition(':')
      socket.create_connection((host.strip('[]'), int(port)), timeout=timeout).close()
  except (OSError, ValueError) as e:
    reason = 'timed out' if isinstance(e, socket.timeout) else (getattr(e, 'strerror', None) or str(e))
    raise RuntimeError(
        f'no TFF worker answers at {target}: {reason} (start one there with `python -m tff_gma.worker`)') from e


def _compile_for_workers(comp):
  """The multi-worker context's compiler (TFF caches its result per computation)."""
  # A computation that aggregates in several sequential stages (multi-pass RFA) cannot take TFF's mergeable form:
  # refused here, where it is invoked, with the reason and the way out, not with TFF's "Detected one aggregate
  # dependent on another" and a dump of building blocks.
  check_single_aggregation_stage(comp)
  # Lower the secure intrinsics before splitting into mergeable form (as the per-worker compiler does): TFF's
  # mergeable compiler only recognises the plain aggregation intrinsics.
  return mergeable_comp_compiler.compile_to_mergeable_comp_form(
      test_compiler.replace_secure_intrinsics_with_bodies(comp))


def set_multi_worker_context(targets: Sequence[str], *, default_num_clients: int = 0,
                             connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
  """Distributes each computation's clients over the TFF workers at `targets` ('host:port', ...).

  TFF's own distributed runtime: one asynchronous context per worker and TFF's mergeable-computation context,
  which compiles a computation to `MergeableCompForm` (the work before the aggregation runs on every worker
  on its share of the clients, the partial aggregates are merged, the rest runs once). Limit of that form: one
  aggregation stage per computation, so multi-pass aggregates (RFA with more than one pass) cannot run on it
  (`check_single_aggregation_stage` says so before training, and the context itself when such a computation is
  invoked: a ValueError naming the number of stages). The workers are not owned here: start them with
  `start_local_workers` on this host (their `target`s are private Unix sockets, 'unix:/path'), or
  `python -m tff_gma.worker --port=P` (target 'host:P') or `--unix=PATH` (target 'unix:PATH'): on this host only
  their owner can connect to those; other hosts that reach a TCP one can, unauthenticated, by design: see its
  start-up message and docs/runtime.md for how to restrict them.

  Each worker must answer within `connect_timeout_s`; otherwise a RuntimeError names its address (a refused
  connection fails at once).
  """
  if not targets:
    raise ValueError('targets must name at least one worker (host:port)')
  for target in targets:
    _check_target(target)
  for target in targets:
    _connect_probe(target, connect_timeout_s)
    channel = grpc.insecure_channel(target, _GRPC_OPTIONS)
    try:
      grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError as e:
      raise RuntimeError(f'no TFF worker answers at {target} within {connect_timeout_s:g}s '
                         f'(something listens there, but no gRPC service answered)') from e
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
  context = _MergeableContext(async_contexts=contexts, compiler_fn=_compile_for_workers)
  drop_unused_assertion_reports()
  _stop_tff_worker_of_default_context()
  tff.framework.get_context_stack().set_default_context(context)
  gc.collect()


def start_local_workers(count: int, *, log_dir: Optional[str] = None) -> list[WorkerProcess]:
  """Starts `count` owned workers on this host (stopped at exit like the simulation context's worker).

  Each is confined like the simulation context's worker: pass their `target`s ('unix:/path' where confined,
  else '127.0.0.1:port') to `set_multi_worker_context`.
  """
  if count < 1:
    raise ValueError(f'count must be positive, got {count}')
  workers = []
  default_log = log_dir is None and os.environ.get('TFF_GMA_WORKER_LOG') is None
  for i in range(count):
    log = os.path.join(log_dir, f'worker_{i}.log') if log_dir else _default_log_path()
    workers.append(WorkerProcess(log_path=log, remove_log_on_stop=default_log).start())
  _install_sigterm_handler()
  drop_unused_assertion_reports()
  return workers


def check_single_aggregation_stage(process) -> int:
  """Raises ValueError if `process.next` (or `process`, a computation) aggregates client data in more than one
  sequential stage.

  TFF's mergeable-computation context (several workers) supports a single stage; the count comes from the
  static audit of the computation (`tff_gma.audit.static`). Returns the number of stages.
  """
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  passes = static.audit_computation(process, policy=static.AuditPolicy(allow_plain_sum=True)).aggregation_passes
  if passes > 1:
    subject = 'computation' if isinstance(process, tff.Computation) else 'process'
    raise ValueError(
        f'this {subject} aggregates in {passes} sequential client-to-server stages; TFF\'s multi-worker '
        f'(mergeable-computation) runtime runs one stage per computation: use one worker, or a one-stage '
        f'aggregator (mean, gma, rfa_one_step)')
  return passes


def shutdown() -> None:
  """Stops the worker started by `set_simulation_context` or `set_async_simulation_context` (the next call starts
  a fresh one)."""
  global _current_worker, _current_context, _current_program_context
  with _lock:
    if _current_worker is not None:
      _current_worker.stop()
      _current_worker = None
    _current_context = _current_program_context = None
