"""Network confinement of the TFF C++ worker: a private network namespace, reached through one listener.

TFF 0.87's `worker_binary` has one network flag, `--port`, listens on all interfaces and has no authentication:
whoever can connect runs TensorFlow graphs in it, as the user who started it. This module runs the unmodified
binary in a network namespace of its own (only a loopback interface, nothing else; the worker can neither be
reached from outside nor reach out) and forwards one listening socket into it:

* a Unix socket in a private (0700) directory for the workers of a local simulation: only this user (and root)
  can connect; no TCP port is open on the host at all;
* a TCP socket bound to an address the caller picks (`python -m tff_gma.worker --bind=...`), for the workers of a
  multi-host run, which must be reachable by design.

The forwarder is a small helper process (this file, run as a stdlib-only script: `python -I -S confinement.py`)
that receives the listening socket from the driver, enters a new network namespace (`unshare(CLONE_NEWNET)`,
or `unshare(CLONE_NEWUSER | CLONE_NEWNET)` without root where the kernel allows user namespaces), brings its
loopback up, starts the worker on a loopback port there and copies bytes between the two with `splice(2)`.
Sockets belong to the namespace they were created in, so the listening socket the driver created stays on the
host while every connection to the worker is made inside the namespace.

`TFF_GMA_WORKER_CONFINEMENT` chooses what happens where the kernel refuses the namespace (Docker's default seccomp
profile, Ubuntu's restricted user namespaces): `require` (the default) refuses to start a worker, with an error
that names the opt-ins, since an unconfined worker listens on all interfaces without authentication and no default
may leave it reachable from another host; `auto` (opt-in) warns once and runs the worker unconfined there (as TFF
does); `off` (opt-in) does not try (and warns once).

Nothing here imports TensorFlow: the helper starts in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

ENV_VAR = 'TFF_GMA_WORKER_CONFINEMENT'
MODES = ('require', 'auto', 'off')
DEFAULT_MODE = 'require'  # No default leaves a worker reachable from another host.

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_PR_SET_PDEATHSIG = 1
_F_SETPIPE_SZ = 1031
_CHUNK = 1 << 20
_WORKER_STOP_TIMEOUT_S = 8.0

# Exit status of the helper when the namespace could not be made (the driver then knows it is unavailable).
EXIT_UNAVAILABLE = 3


def mode(value: str | None = None) -> str:
  """The confinement mode: `value`, else `$TFF_GMA_WORKER_CONFINEMENT`, else `DEFAULT_MODE` ('require')."""
  setting = (value if value is not None else os.environ.get(ENV_VAR, DEFAULT_MODE)).strip().lower() or DEFAULT_MODE
  if setting not in MODES:
    raise ValueError(f'{ENV_VAR}={setting!r}: expected one of {", ".join(MODES)}')
  return setting


def helper_command() -> list[str]:
  """The command that runs the helper: this file as a script, isolated from the environment, stdlib only."""
  return [sys.executable, '-I', '-S', os.path.abspath(__file__)]


def unavailable_advice() -> str:
  return ('the kernel refused a private network namespace (Docker\'s default seccomp profile, '
          '`kernel.unprivileged_userns_clone=0`, `user.max_user_namespaces=0` or Ubuntu\'s '
          '`kernel.apparmor_restrict_unprivileged_userns=1` do this without root)')


# ---------------------------------------------------------------------------------------------------------------
# The helper process (runs as a script; stdlib only).


def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _unshare(libc, flags: int) -> int:
  """0 on success, else the errno."""
  if libc.unshare(ctypes.c_int(flags)) == 0:
    return 0
  return ctypes.get_errno() or errno.EPERM


def _write(path: str, text: str) -> None:
  with open(path, 'w') as f:
    f.write(text)


def enter_private_network_namespace() -> str:
  """Moves this (single-threaded) process into a new network namespace with only `lo`, up. Returns how.

  Raises OSError with a readable message when the kernel refuses.
  """
  try:
    libc = _libc()
    libc.unshare  # pylint: disable=pointless-statement
  except (OSError, AttributeError) as e:
    raise OSError(errno.ENOSYS, f'no unshare(2) here: {e}') from e
  uid, gid = os.geteuid(), os.getegid()
  err_net = _unshare(libc, _CLONE_NEWNET)
  if err_net == 0:
    how = 'network namespace'
  else:
    err_user = _unshare(libc, _CLONE_NEWUSER | _CLONE_NEWNET)
    if err_user:
      raise OSError(err_user, f'unshare(CLONE_NEWNET): {os.strerror(err_net)}; '
                    f'unshare(CLONE_NEWUSER|CLONE_NEWNET): {os.strerror(err_user)}')
    how = 'user and network namespace'
    try:  # The same ids inside as outside: the worker sees (and files get) this user's ids.
      _write('/proc/self/setgroups', 'deny')
      _write('/proc/self/uid_map', f'{uid} {uid} 1\n')
      _write('/proc/self/gid_map', f'{gid} {gid} 1\n')
    except OSError as e:
      raise OSError(e.errno, f'user namespace id maps: {e}') from e
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      request = struct.pack('16sH22x', b'lo', 0)
      flags = struct.unpack('16sH22x', fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
      fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack('16sH22x', b'lo', flags | _IFF_UP))
    except OSError as e:
      raise OSError(e.errno, f'bringing up the namespace\'s loopback: {e.strerror}') from e
  names = sorted(name for _, name in socket.if_nameindex())
  if names != ['lo']:
    raise OSError(errno.EEXIST, f'the new network namespace is not private: interfaces {names}')
  return how


def _pump(src: socket.socket, dst: socket.socket, done) -> None:
  """Copies src to dst until EOF (then half-closes dst) or an error (then shuts both down)."""
  r, w = os.pipe()
  try:
    try:
      fcntl.fcntl(w, _F_SETPIPE_SZ, _CHUNK)
    except OSError:
      pass
    use_splice = hasattr(os, 'splice')
    buf = bytearray(_CHUNK)
    while True:
      if use_splice:
        try:
          n = os.splice(src.fileno(), w, _CHUNK)
        except OSError as e:
          if e.errno != errno.EINVAL:
            raise
          use_splice = False
          continue
        if n == 0:
          break
        while n:
          n -= os.splice(r, dst.fileno(), n)
      else:
        n = src.recv_into(buf)
        if n == 0:
          break
        dst.sendall(memoryview(buf)[:n])
    try:
      dst.shutdown(socket.SHUT_WR)
    except OSError:
      pass
  except OSError:
    for s in (src, dst):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
  finally:
    os.close(r)
    os.close(w)
    done()


def _serve_connection(client: socket.socket, port: int) -> None:
  try:
    upstream = socket.create_connection(('127.0.0.1', port))
  except OSError:
    client.close()
    return
  for s in (client, upstream):
    if s.family in (socket.AF_INET, socket.AF_INET6):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  lock = threading.Lock()
  remaining = [2]

  def done():
    with lock:
      remaining[0] -= 1
      last = remaining[0] == 0
    if last:
      client.close()
      upstream.close()

  threading.Thread(target=_pump, args=(upstream, client, done), daemon=True).start()
  _pump(client, upstream, done)


def _accept_loop(listener: socket.socket, port: int) -> None:
  while True:
    try:
      client, _ = listener.accept()
    except OSError as e:
      if e.errno in (errno.EINTR, errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
        time.sleep(0.01)
        continue
      return
    threading.Thread(target=_serve_connection, args=(client, port), daemon=True).start()


def _die_with_parent_of(parent_pid: int):
  def preexec():
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # The parent died before prctl: nobody would kill us.
      os._exit(1)  # pylint: disable=protected-access
  return preexec


def helper_main(argv: list[str]) -> int:
  """`confinement.py LISTEN_FD STATUS_FD WORKER_BINARY [WORKER_FLAGS...]`."""
  listen_fd, status_fd, worker_argv = int(argv[0]), int(argv[1]), argv[2:]
  status = os.fdopen(status_fd, 'w')

  def report(**message) -> None:
    try:
      status.write(json.dumps(message) + '\n')
      status.flush()
    except OSError:
      pass

  state = {'worker': None, 'stopping': False}

  def on_signal(signum, frame):
    del frame
    state['stopping'] = True
    worker = state['worker']
    if worker is None:
      os._exit(128 + signum)  # pylint: disable=protected-access
    if worker.poll() is None:
      worker.terminate()
      timer = threading.Timer(_WORKER_STOP_TIMEOUT_S, worker.kill)
      timer.daemon = True
      timer.start()

  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)

  try:
    how = enter_private_network_namespace()
  except OSError as e:
    report(ok=False, unavailable=True, reason=str(e))
    return EXIT_UNAVAILABLE
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
    probe.bind(('127.0.0.1', 0))  # In the fresh namespace: any free loopback port.
    port = probe.getsockname()[1]
  # Started before any thread of ours, from the main thread, which lives as long as this process does
  # (PR_SET_PDEATHSIG fires when the forking thread ends).
  worker = subprocess.Popen(
      worker_argv + [f'--port={port}'], stdin=subprocess.DEVNULL, close_fds=True,
      preexec_fn=_die_with_parent_of(os.getpid()))
  state['worker'] = worker
  if state['stopping']:
    on_signal(signal.SIGTERM, None)
  while True:  # Until the worker accepts connections on its port (or dies).
    if worker.poll() is not None:
      report(ok=False, unavailable=False, reason=f'the worker exited with code {worker.returncode} at start')
      return 1
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1.0).close()
      break
    except OSError:
      time.sleep(0.02)
  listener = socket.socket(fileno=listen_fd)
  threading.Thread(target=_accept_loop, args=(listener, port), daemon=True).start()
  report(ok=True, pid=worker.pid, port=port, how=how)
  status.close()
  code = worker.wait()
  # os._exit: the pump threads are daemons; do not wait for them or run interpreter teardown.
  os._exit(128 - code if code < 0 else code)  # pylint: disable=protected-access


if __name__ == '__main__':
  sys.exit(helper_main(sys.argv[1:]))
