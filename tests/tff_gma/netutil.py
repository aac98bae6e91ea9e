"""Test helpers: this host's addresses, a process's listening TCP ports, and connection probes (local only)."""

import errno
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys

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


# The probes below change user, so they run in a process of their own. They start a fresh interpreter rather than
# fork this one: a fork of a process with gRPC threads (the TFF runtime) can abort in gRPC's fork handlers (seen in
# CI: "Mutex::Fer while waiting on Condition"), which read as a failed probe. `subprocess` without `preexec_fn`,
# `user` or `group` starts the child by vfork/exec, so no fork handler runs in this process's image.
_PROBE = r"""
import ctypes, json, os, socket, sys
kind, address, uid, gid, timeout, keep_root_files = json.loads(sys.argv[1])
os.setgroups([])
if keep_root_files:  # Only the effective uid changes: the file-system uid stays 0 (SO_PEERCRED reports uid).
  libc = ctypes.CDLL(None, use_errno=True)
  os.setresgid(0, gid, 0)
  os.setresuid(0, uid, 0)
  libc.setfsgid(0)
  libc.setfsuid(0)
else:
  os.setgid(gid)
  os.setuid(uid)
if isinstance(address, str):
  family = socket.AF_UNIX
else:
  address = tuple(address)
  family = socket.AF_INET6 if ':' in address[0] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.settimeout(timeout)
try:
  s.connect(address)
except PermissionError:
  print('permission denied'); sys.exit()
except OSError:
  print('connect failed'); sys.exit()
if kind == 'connect':
  print('connected'); sys.exit()
try:
  print('data' if s.recv(64) else 'eof')
except ConnectionResetError:
  print('reset')
except socket.timeout:
  print('timeout')
"""


def _probe_as(kind: str, address, uid: int, gid: int, timeout: float, keep_root_files: bool = False) -> str:
  args = json.dumps([kind, address, uid, gid, timeout, keep_root_files])
  done = subprocess.run([sys.executable, '-I', '-c', _PROBE, args], capture_output=True, text=True,
                        stdin=subprocess.DEVNULL, timeout=timeout + 60, check=False)
  if done.returncode != 0 or not done.stdout.strip():
    raise AssertionError(f'the probe itself failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}')
  return done.stdout.strip()


def unix_connect_as(path: str, uid: int, gid: int, timeout: float = 5.0) -> str:
  """'connected', 'permission denied' or 'connect failed', for a connection to the Unix socket `path` from a
  process running as uid/gid (needs root)."""
  return _probe_as('connect', path, uid, gid, timeout)


def first_read_as(address, uid: int, gid: int, timeout: float = 5.0, keep_root_files: bool = False) -> str:
  """Connects to `address` ((host, port) for TCP, a path for a Unix socket) from a process running as uid/gid,
  and reads once: 'eof' (closed at once), 'data' (the other end spoke), 'reset', 'timeout', or 'connect failed'
  (a refused connection, the socket's permissions included). Needs root. `keep_root_files`: only the effective
  uid changes (the file-system uid stays 0), so the process can reach a path in root's private directory while
  `SO_PEERCRED` reports `uid`."""
  result = _probe_as('read', address, uid, gid, timeout, keep_root_files)
  return 'connect failed' if result == 'permission denied' else result
