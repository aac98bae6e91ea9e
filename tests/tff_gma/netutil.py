"""Test helpers: this host's addresses, a process's listening TCP ports, and connection probes (local only)."""

import errno
import fcntl
import os
import socket
import struct

_SIOCGIFADDR = 0x8915


def host_addresses() -> list[str]:
  """This host's non-loopback addresses (IPv4, and global IPv6), in the caller's network namespace."""
  addresses = []
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      if name == 'lo':
        continue
      try:
        reply = fcntl.ioctl(s, _SIOCGIFADDR, struct.pack('256s', name.encode()[:15]))
      except OSError:
        continue
      addresses.append(socket.inet_ntoa(reply[20:24]))
  try:
    with open('/proc/net/if_inet6') as f:
      for line in f:
        raw, _, _, scope, _, name = line.split()
        if name != 'lo' and scope == '00':  # Global scope (link-local addresses need an interface).
          addresses.append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(raw)))
  except OSError:
    pass
  return addresses


def _socket_inodes(pid: int) -> set[int]:
  inodes = set()
  for fd in os.listdir(f'/proc/{pid}/fd'):
    try:
      link = os.readlink(f'/proc/{pid}/fd/{fd}')
    except OSError:
      continue
    if link.startswith('socket:['):
      inodes.add(int(link[len('socket:['):-1]))
  return inodes


def _listening(table_pid) -> dict[int, int]:
  """inode -> port of the TCP sockets in LISTEN state in the network namespace of `table_pid` ('self' ok)."""
  result = {}
  for table in ('tcp', 'tcp6'):
    try:
      with open(f'/proc/{table_pid}/net/{table}') as f:
        next(f)
        for line in f:
          fields = line.split()
          if fields[3] == '0A':
            result[int(fields[9])] = int(fields[1].rsplit(':', 1)[1], 16)
    except FileNotFoundError:
      continue
  return result


def listening_ports(pid: int) -> set[int]:
  """TCP ports that process `pid` listens on, in its own network namespace."""
  inodes = _socket_inodes(pid)
  return {port for inode, port in _listening(pid).items() if inode in inodes}


def host_listening_ports(pid: int) -> set[int]:
  """TCP ports that process `pid` listens on in the caller's (the host's) network namespace."""
  inodes = _socket_inodes(pid)
  return {port for inode, port in _listening('self').items() if inode in inodes}


def connect(address: str, port: int, timeout: float = 3.0) -> str:
  """'connected', 'refused', or another failure's name, for a TCP connection from this process."""
  family = socket.AF_INET6 if ':' in address else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.settimeout(timeout)
    try:
      s.connect((address, port))
      return 'connected'
    except ConnectionRefusedError:
      return 'refused'
    except socket.timeout:
      return 'timeout'
    except OSError as e:
      return errno.errorcode.get(e.errno, str(e))


def unix_connect_as(path: str, uid: int, gid: int) -> str:
  """Connects to the Unix socket `path` from a forked process running as uid/gid (needs root)."""
  pid = os.fork()
  if pid == 0:  # Only system calls here: the parent may have threads.
    code = 1
    try:
      os.setgroups([])
      os.setgid(gid)
      os.setuid(uid)
      with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
      code = 0
    except PermissionError:
      code = 13
    except BaseException:  # pylint: disable=broad-except
      code = 2
    os._exit(code)  # pylint: disable=protected-access
  _, status = os.waitpid(pid, 0)
  return {0: 'connected', 13: 'permission denied'}.get(os.waitstatus_to_exitcode(status), 'error')


_READ_RESULTS = {0: 'eof', 1: 'data', 2: 'reset', 3: 'timeout', 4: 'connect failed'}
_libc = None


def first_read_as(address, uid: int, gid: int, timeout: float = 5.0, keep_root_files: bool = False) -> str:
  """Connects to `address` ((host, port) for TCP, a path for a Unix socket) from a forked process running as
  uid/gid, and reads once: 'eof' (closed at once), 'data' (the other end spoke), 'reset', 'timeout', or
  'connect failed'. Needs root. `keep_root_files`: only the effective uid changes (the file-system uid stays 0),
  so the process can reach a path in root's private directory while `SO_PEERCRED` reports `uid`."""
  global _libc
  import ctypes  # pylint: disable=g-import-not-at-top
  if _libc is None:
    _libc = ctypes.CDLL(None, use_errno=True)  # Loaded here, not in the child (no dlopen after fork).
  unix = isinstance(address, str)
  family = socket.AF_UNIX if unix else (socket.AF_INET6 if ':' in address[0] else socket.AF_INET)
  pid = os.fork()
  if pid == 0:  # Only system calls here: the parent may have threads.
    code = 5
    try:
      os.setgroups([])
      if keep_root_files:
        os.setresgid(0, gid, 0)
        os.setresuid(0, uid, 0)
        _libc.setfsgid(0)
        _libc.setfsuid(0)
      else:
        os.setgid(gid)
        os.setuid(uid)
      s = socket.socket(family, socket.SOCK_STREAM)
      s.settimeout(timeout)
      try:
        s.connect(address)  # A numeric (ASCII) address: no codec is imported after the uid change.
      except OSError:
        os._exit(4)  # pylint: disable=protected-access
      try:
        code = 1 if s.recv(64) else 0
      except ConnectionResetError:
        code = 2
      except socket.timeout:
        code = 3
    except BaseException:  # pylint: disable=broad-except
      code = 5
    os._exit(code)  # pylint: disable=protected-access
  _, status = os.waitpid(pid, 0)
  return _READ_RESULTS.get(os.waitstatus_to_exitcode(status), 'error')
