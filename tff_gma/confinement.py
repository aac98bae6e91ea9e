"""Network confinement of the TFF C++ worker: a private network namespace, reached through one listener.

TFF 0.87's `worker_binary` listens on all interfaces with no authentication: whoever connects runs TensorFlow graphs
in it. This runs the unmodified binary in a network namespace of its own, behind a forwarder that admits only the
worker's owner among this host's users (`PeerCheck`). Run as a stdlib-only script (`python -I -S confinement.py`),
it imports no TensorFlow.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import ipaddress
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
_WORKER_STOP_WAIT_S = 3.0  # Per step of the helper's escalation (`stop_process`).

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


# Stopping a process: SIGINT, then SIGTERM, then SIGKILL, each followed by up to this many seconds' wait.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
STOP_WAIT_S = 4.0
# Dispositions a started process must not inherit: a command started with `&` by a non-interactive shell (a script,
# `nohup cmd &`) runs with SIGINT and SIGQUIT ignored, and a child keeps that across exec.
DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGQUIT)


def reset_signal_dispositions() -> None:
  """For a child between fork and exec: SIGINT and SIGQUIT back to their defaults, and unblocked (with SIGTERM).

  A worker started from a background job would otherwise ignore SIGINT, the first signal `stop_process` (and TFF)
  sends. Handled signals are reset by exec anyway; ignored ones and the signal mask are inherited.
  """
  for signum in DEFAULT_SIGNALS:
    signal.signal(signum, signal.SIG_DFL)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, DEFAULT_SIGNALS + (signal.SIGTERM,))


def stop_process(process: subprocess.Popen, wait_s: float = STOP_WAIT_S) -> int | None:
  """Stops `process` by a bounded escalation: SIGINT, then SIGTERM, then SIGKILL, each followed by up to `wait_s`
  seconds' wait for it to end; never waits longer (a process that ignores or handles SIGINT and SIGTERM is killed
  about `2 * wait_s` seconds in). Returns its exit status (negative: the signal that ended it), or None when it is
  still there after the last wait (a process in uninterruptible sleep that even SIGKILL has not ended yet)."""
  for signum in STOP_SIGNALS:
    if process.poll() is not None:
      return process.returncode
    try:
      process.send_signal(signum)
    except ProcessLookupError:  # Ended (not yet reaped) between the poll and the signal.
      pass
    deadline = time.monotonic() + wait_s
    while process.poll() is None and time.monotonic() < deadline:
      time.sleep(0.01)
  return process.poll()


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


# ---------------------------------------------------------------------------------------------------------------
# Who may connect: the peer-owner check (in the helper, on every connection, before a byte reaches the worker).

_TCP_LISTEN = 0x0A
TcpEntry = collections.namedtuple('TcpEntry', 'local remote state uid inode')
TcpEntry.__doc__ = 'One socket of /proc/net/tcp{,6}: (address, port) pairs, TCP state, owner uid, inode (0: closed).'


def _normal(address):
  """An ipaddress address from a string ('fe80::1%eth0' ok) or address; IPv4-mapped IPv6 becomes IPv4."""
  if isinstance(address, str):
    address = ipaddress.ip_address(address.split('%', 1)[0])
  if address.version == 6 and address.ipv4_mapped is not None:
    return address.ipv4_mapped
  return address


def _proc_net_address(field: str):
  """'0100007F:1F40' (an address of /proc/net/tcp or tcp6) -> (address, port)."""
  hex_address, hex_port = field.split(':')
  if len(hex_address) not in (8, 32):
    raise ValueError(f'not an address of /proc/net/tcp: {field!r}')
  # The kernel prints the address as 32-bit words in host byte order: packing them natively restores its bytes.
  raw = b''.join(struct.pack('=I', int(hex_address[i:i + 8], 16)) for i in range(0, len(hex_address), 8))
  return _normal(ipaddress.ip_address(raw)), int(hex_port, 16)


def parse_proc_net_tcp(text: str) -> list:
  """The sockets listed in the text of /proc/net/tcp or /proc/net/tcp6 (a header line, then one per socket)."""
  entries = []
  for line in text.splitlines()[1:]:
    fields = line.split()
    if len(fields) < 10:
      continue
    try:
      entries.append(TcpEntry(_proc_net_address(fields[1]), _proc_net_address(fields[2]), int(fields[3], 16),
                              int(fields[7]), int(fields[9])))
    except ValueError:  # Unreadable line: its socket counts as not found (a local peer is then refused).
      continue
  return entries


def parse_fib_trie_local(text: str) -> list:
  """The IPv4 networks that are local to the host (type LOCAL: its addresses, 127/8, AnyIP routes), from the
  text of /proc/net/fib_trie ('|-- KEY' lines, each followed by its '/PREFIX SCOPE TYPE' lines)."""
  networks = set()
  key = None
  for line in text.splitlines():
    item = line.strip()
    if item.startswith('|-- '):
      key = item[4:].strip()
    elif item.startswith('/') and key is not None:
      fields = item.split()
      if len(fields) >= 3 and fields[2] == 'LOCAL':
        try:
          networks.add(ipaddress.ip_network(f'{key}{fields[0]}', strict=False))
        except ValueError:
          pass
    else:
      key = None
  return sorted(networks)


def parse_if_inet6(text: str) -> list:
  """The host's IPv6 addresses, as /128 networks, from the text of /proc/net/if_inet6."""
  networks = []
  for line in text.splitlines():
    fields = line.split()
    try:
      networks.append(ipaddress.ip_network(ipaddress.ip_address(bytes.fromhex(fields[0]))))
    except (IndexError, ValueError):
      continue
  return networks


def tcp_peer_verdict(peer, ours, entries, local_networks, owner_uid: int) -> tuple:
  """(admit, why) for a TCP connection to the listener from `peer` ((address, port)) arriving at `ours`.

  `entries`: the host's sockets (`parse_proc_net_tcp`; an iterable, read up to the peer's socket: a connection's
  two ends are unique among the host's sockets); `local_networks()`: the host's local networks (called only when
  the peer's socket is not among `entries`). The peer's socket is the one whose local end is `peer` and remote
  end `ours`. Admitted: a peer socket of `owner_uid`; a peer on another host (an address that is not
  this host's), whose user cannot be known. Refused: a peer socket of another uid; one that its process has
  already closed (inode 0: TIME_WAIT and orphaned sockets, listed with uid 0, have no owner left); and a peer at
  an address of this host whose socket is not listed (fail closed).
  """
  peer_address, peer_port = _normal(peer[0]), int(peer[1])
  our_address, our_port = _normal(ours[0]), int(ours[1])
  found = next(([e] for e in entries if e.state != _TCP_LISTEN and e.local == (peer_address, peer_port)
                and e.remote == (our_address, our_port)), [])
  owners = {e.uid for e in found if e.inode}
  if owners == {owner_uid}:
    return True, f'a local socket of uid {owner_uid}'
  if owners:
    return False, 'a local socket of uid ' + ', '.join(str(uid) for uid in sorted(owners - {owner_uid}))
  if found:
    return False, 'a local socket already closed by its process (no owner left)'
  if (peer_address.is_loopback or peer_address == our_address
      or any(peer_address in network for network in local_networks())):
    return False, 'an address of this host whose socket is not listed (its owner is unknown)'
  return True, 'another host'


class PeerCheck:
  """Admits, among the users of this host, only the worker's owner (this process's effective uid).

  Made before the helper leaves the host's namespaces: it keeps the host's /proc/net/tcp, tcp6, fib_trie and
  if_inet6 open (a /proc/net file shows the network namespace it was opened in, at every re-read, and its uids
  as seen from the user namespace it was opened in, where the owner is `os.geteuid()` of now).
  A Unix peer is checked by its `SO_PEERCRED` uid, a TCP peer by `tcp_peer_verdict`. Root is no exception (when
  the owner is another user): root could enter the worker by other means anyway, but is not let in by this one.
  (Where the helper runs in its own user namespace, `SO_PEERCRED` shows another user's uid as the overflow uid,
  65534: still refused, unless the owner is that very uid; the socket's 0700 directory keeps them out anyway.)
  """

  def __init__(self, proc_net: str = '/proc/self/net', tcp: bool = True):
    """`tcp`: whether TCP peers will be checked (a Unix listener needs none of the tables)."""
    self.owner_uid = os.geteuid()
    self._lock = threading.Lock()
    self._fds = {}
    for name in ('tcp', 'tcp6', 'fib_trie', 'if_inet6') if tcp else ():
      try:
        self._fds[name] = os.open(os.path.join(proc_net, name), os.O_RDONLY | os.O_CLOEXEC)
      except OSError:  # No IPv6 on this host: no tcp6 peer either.
        pass
    if tcp and 'tcp' not in self._fds:
      raise OSError(errno.ENOENT, f'{proc_net}/tcp is unreadable: the owners of local peers cannot be checked')

  def _read(self, name: str) -> str:
    fd = self._fds.get(name)
    if fd is None:
      return ''
    chunks = []
    with self._lock:
      os.lseek(fd, 0, os.SEEK_SET)
      while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          break
        chunks.append(chunk)
    return b''.join(chunks).decode('ascii', 'replace')

  def _local_networks(self) -> list:
    return parse_fib_trie_local(self._read('fib_trie')) + parse_if_inet6(self._read('if_inet6'))

  def refusal(self, conn: socket.socket):
    """None to admit the connection `conn`; otherwise a line saying whom it came from and why it is refused."""
    try:
      if conn.family == socket.AF_UNIX:
        pid, uid, _ = struct.unpack('3i', conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize('3i')))
        if uid == self.owner_uid:
          return None
        return f'a process (pid {pid}) of uid {uid} on the Unix socket'
      if conn.family not in (socket.AF_INET, socket.AF_INET6) or 'tcp' not in self._fds:
        return f'a socket of family {conn.family!r} that this check was not made for'
      peer, ours = conn.getpeername()[:2], conn.getsockname()[:2]
      # Reading a table walks the kernel's whole socket hash (tens of ms on a big host): tcp6 only when needed.
      # An IPv4 peer (mapped ones included) is an IPv4 socket, or an IPv6 one connected to a mapped address.
      tables = ('tcp', 'tcp6') if _normal(peer[0]).version == 4 else ('tcp6',)
      entries = (entry for name in tables for entry in parse_proc_net_tcp(self._read(name)))
      admit, why = tcp_peer_verdict(peer, ours, entries, self._local_networks, self.owner_uid)
      return None if admit else f'{_normal(peer[0])}:{peer[1]}, {why}'
    except (OSError, ValueError) as e:  # Fail closed.
      return f'a peer whose owner could not be read ({e})'


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


def _serve_connection(client: socket.socket, port: int, check: PeerCheck | None = None) -> None:
  if check is not None:
    refused = check.refusal(client)
    if refused is not None:  # Closed before a byte is read or forwarded.
      client.close()
      try:
        print(f'tff_gma confinement: refused a connection from {refused}: only the worker\'s owner (uid '
              f'{check.owner_uid}) may connect from this host', file=sys.stderr, flush=True)
      except (OSError, ValueError):
        pass
      return
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


def _accept_loop(listener: socket.socket, port: int, check: PeerCheck | None = None) -> None:
  while True:
    try:
      client, _ = listener.accept()
    except OSError as e:
      if e.errno in (errno.EINTR, errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
        time.sleep(0.01)
        continue
      return
    threading.Thread(target=_serve_connection, args=(client, port, check), daemon=True).start()


def die_with_parent_of(parent_pid: int):
  """A `preexec_fn` (runs in the child between fork and exec): SIGINT and SIGQUIT back to their defaults and
  unblocked with SIGTERM (`reset_signal_dispositions`), and a SIGKILL when the parent `parent_pid` dies
  (`PR_SET_PDEATHSIG`); exits at once if the parent is already gone. The one place every process this library
  starts (the helper, the TFF worker, the audit's child) gets this from."""
  try:  # Looked up here, in the parent: the forked child of a threaded process should not dlopen.
    prctl = _libc().prctl
  except (OSError, AttributeError):  # Not Linux: the atexit hook still stops the child on a normal exit.
    prctl = None

  def preexec():
    reset_signal_dispositions()  # A background job's ignored SIGINT would pass on; exec resets handlers, not SIG_IGN.
    if prctl is None:
      return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
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

  state = {'worker': None, 'stopping': False, 'stopper': None}

  def on_signal(signum, frame):
    del frame
    state['stopping'] = True
    worker = state['worker']
    if worker is None:
      os._exit(128 + signum)  # pylint: disable=protected-access
    if state['stopper'] is None:  # Once: a second signal does not restart the escalation.
      # In a thread: the main thread, which this handler interrupts, holds the worker's wait lock.
      state['stopper'] = threading.Thread(target=stop_process, args=(worker, _WORKER_STOP_WAIT_S), daemon=True)
      state['stopper'].start()

  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)

  listener = socket.socket(fileno=listen_fd)
  try:
    check = PeerCheck(tcp=listener.family != socket.AF_UNIX)  # In the host's namespaces, before leaving them.
  except OSError as e:
    report(ok=False, unavailable=False, reason=str(e))
    return 1
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
      preexec_fn=die_with_parent_of(os.getpid()))
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
  threading.Thread(target=_accept_loop, args=(listener, port, check), daemon=True).start()
  report(ok=True, pid=worker.pid, port=port, how=how)
  status.close()
  code = worker.wait()
  # os._exit: the pump threads are daemons; do not wait for them or run interpreter teardown.
  os._exit(128 - code if code < 0 else code)  # pylint: disable=protected-access


if __name__ == '__main__':
  sys.exit(helper_main(sys.argv[1:]))
