"""This process's private directory (the workers' default logs and Unix sockets), its logs, and stale files.

The directory is mode 0700 with a random name, so no other user can read a worker's log or reach its socket;
it is removed at exit. A process killed without running its exit hooks leaves it behind: the next process of
the same user that starts a worker removes it (`remove_stale_files`), which needs to know which pids are gone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from typing import IO, Optional

from tff_gma.runtime.state import STATE

_RUN_DIR_PREFIX = 'tff_gma_worker_'
# Per-process private directories (`<prefix><pid>_<random>`) and the per-process logs of older versions
# (`<prefix><pid>.log`).
_STALE_NAME = re.compile(re.escape(_RUN_DIR_PREFIX) + r'(\d+)(?:_\w+|\.log)')
_MAX_SOCKET_DIR_LEN = 80  # sun_path holds 107 bytes; the socket's name adds about 20.


def pid_alive(pid: int) -> bool:
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
  with STATE.files_lock:
    if STATE.run_dir is None or STATE.run_dir_pid != os.getpid() or not os.path.isdir(STATE.run_dir):
      base = tempfile.gettempdir()
      remove_stale_files(base)
      if len(base) > _MAX_SOCKET_DIR_LEN - 30 and os.path.isdir('/tmp'):
        base = '/tmp'  # Unix socket paths are short.
        remove_stale_files(base)
      STATE.run_dir = tempfile.mkdtemp(prefix=f'{_RUN_DIR_PREFIX}{os.getpid()}_', dir=base)
      STATE.run_dir_pid = os.getpid()
    return STATE.run_dir


def remove_private_dir(lock_timeout: Optional[float] = None) -> None:
  """Removes this process's private directory (not a forked parent's), if it made one. With `lock_timeout`, gives
  up (leaving the directory to the next process's stale-file sweep) if another thread holds the lock that long."""
  if not STATE.files_lock.acquire(timeout=-1 if lock_timeout is None else lock_timeout):
    return
  try:
    if STATE.run_dir is not None and STATE.run_dir_pid == os.getpid():
      shutil.rmtree(STATE.run_dir, ignore_errors=True)
    STATE.run_dir = None
  finally:
    STATE.files_lock.release()


def keep_log(path: str) -> Optional[str]:
  """Moves a log out of the private directory (which is removed at exit) next to it, as
  `tff_gma_failed_worker_<pid>_<random>.log` (mode 0600; a name the stale-file sweep leaves alone, for the user
  to read); returns the new path, or None when it cannot (the log is then left where it is)."""
  if os.path.dirname(os.path.abspath(path)) != STATE.run_dir or not os.path.isfile(path):
    return None
  try:
    fd, kept = tempfile.mkstemp(prefix=f'tff_gma_failed_worker_{os.getpid()}_', suffix='.log',
                                dir=os.path.dirname(STATE.run_dir))
  except OSError:
    return None
  os.close(fd)
  try:
    os.replace(path, kept)
  except OSError:
    os.unlink(kept)
    return None
  return kept


def socket_path() -> str:
  """A new path for a worker's Unix socket in the private directory."""
  return os.path.join(private_dir(), f'worker_{next(STATE.socket_names)}.sock')


def default_log_path() -> Optional[str]:
  """`TFF_GMA_WORKER_LOG`: unset -> a new file in the private directory; 'none' -> discard; 'stderr' -> ours."""
  setting = os.environ.get('TFF_GMA_WORKER_LOG')
  if setting is None:
    return os.path.join(private_dir(), f'worker_{next(STATE.log_names)}.log')
  if setting.lower() in ('none', 'off', ''):
    return None
  return setting


def open_log(path: str) -> IO[bytes]:
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
