"""The sockets a confined worker is reached through, and the confinement glue around them.

A confined worker listens nowhere on the host: `tff_gma.confinement`'s helper accepts on a listener made here
(a Unix socket in the private directory, a Unix socket at a path the user chose, or a TCP port) and forwards
into the worker's private network namespace, after telling this process, in one JSON status line, whether the
namespace was available. Where it was not, `allow_unconfined` decides whether the exposed worker may run.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import stat
import subprocess
import time
from typing import Optional

from tff_gma import confinement
from tff_gma.runtime.state import STATE

ALL_INTERFACES = ('', '0.0.0.0', '::')

# The name the runtime logged under as one module: kept, so that what a user configured for it still applies.
_logger = logging.getLogger('tff_gma.runtime')


def confinement_status() -> str:
  """'available', 'unavailable: <reason>' or 'unknown' (no worker started yet) for this process."""
  if STATE.confinement_unavailable is not None:
    return f'unavailable: {STATE.confinement_unavailable}'
  if any(w.confined for w in list(STATE.live_workers)):
    return 'available'
  return 'unknown'


def allow_unconfined(worker, setting: str) -> None:
  """Raises if `worker` (a `WorkerProcess`) may not run unconfined under `setting` (`confinement.mode`);
  otherwise warns (once per process) that it is exposed."""
  reason = (f'{confinement.ENV_VAR}=off' if setting == 'off'
            else f'{confinement.unavailable_advice()}: {STATE.confinement_unavailable}')
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
  if worker.listen_host not in (None,) + ALL_INTERFACES:
    raise RuntimeError(
        f'cannot restrict the TFF worker to {worker.listen_host}: the worker itself listens on all interfaces, '
        f'and confinement is unavailable ({reason}); use a firewall or a private network instead')
  with STATE.confinement_lock:
    if STATE.unconfined_warned:
      return
    STATE.unconfined_warned = True
  _logger.warning(
      'TFF worker NOT confined (%s). It listens on all interfaces of its port without authentication: any host '
      'that can reach this machine, and any local process, can run TensorFlow graphs in it as uid %d. '
      'Set %s=require to refuse to run instead.',
      reason, os.geteuid(), confinement.ENV_VAR)


def read_status(fd: int, process: subprocess.Popen, timeout: float) -> Optional[dict]:
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


def tcp_listener(host: str, port: int) -> socket.socket:
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


def unix_listener(path: str) -> socket.socket:
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


def private_unix_listener(path: str) -> socket.socket:
  """A Unix socket bound at `path`, a new name in this process's private (0700) directory, with mode 0600."""
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    listener.bind(path)
    os.chmod(path, 0o600)
  except OSError:
    listener.close()
    raise
  return listener
