"""An exclusive lock on a run's output directory: one run at a time writes into it.

Two runs in one --output_dir would interleave their rows and checkpoints. `DirectoryLock` flocks `.run.lock` (and the
directory): a second run fails at once naming the holder's pid, a dead holder's lock is taken over, and it is
released on every exit path. Guarantees and their reasons: docs/experiments.md#the-output-directorys-lock"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from typing import Optional

from absl import logging

from tff_gma.runtime import files as runtime_files

LOCK_FILE = '.run.lock'
_RETRIES = 50


class DirectoryLockedError(RuntimeError):
  """Another run holds the output directory (the message names the directory and the holder's pid)."""


def _read_holder(fd: int) -> dict[str, str]:
  try:
    text = os.pread(fd, 4096, 0).decode('utf-8', 'replace')
  except OSError:
    return {}
  holder = {}
  for line in text.splitlines():
    key, sep, value = line.partition('=')
    if sep:
      holder[key.strip()] = value.strip()
  return holder


def _describe(holder: dict[str, str]) -> str:
  pid = holder.get('pid')
  if not pid or not pid.isdigit():
    return 'a process that has not written its pid yet'
  host = holder.get('host')
  text = f'pid {pid}'
  if int(pid) == os.getpid() and host in (None, socket.gethostname()):
    return text + ', this process'
  if host and host != socket.gethostname():
    return f'{text} on host {host}'
  if not runtime_files.pid_exists(int(pid)):
    # The flock is held, so someone holds it: a process of another PID namespace, or a child that inherited it.
    return f'{text}, not running in this PID namespace (another container, or a child process holds the lock)'
  return text


class DirectoryLock:
  """`with DirectoryLock(path):` holds `path/.run.lock` exclusively (docs/experiments.md#the-output-directorys-lock)."""

  def __init__(self, directory: str):
    self.directory = directory
    self.path = os.path.join(directory, LOCK_FILE)
    self.stale_holder: Optional[str] = None  # Set by `acquire` when it took over a dead process's lock file.
    self._fd: Optional[int] = None
    self._dir_fd: Optional[int] = None  # The directory, flocked while the lock is held (survives the file's removal).
    self._created: list[str] = []  # Directories `acquire` created (deepest first), removed again if left empty.

  @property
  def held(self) -> bool:
    return self._fd is not None

  def _make_dirs(self) -> None:
    missing = []
    path = os.path.abspath(self.directory)
    while not os.path.isdir(path):
      missing.append(path)
      parent = os.path.dirname(path)
      if parent == path:
        break
      path = parent
    os.makedirs(self.directory, exist_ok=True)
    self._created = self._created or missing

  def acquire(self) -> 'DirectoryLock':
    """Takes the lock, or raises `DirectoryLockedError` at once. Creates the directory if needed."""
    if self._fd is not None:
      raise RuntimeError(f'{self.path} is already held by this DirectoryLock')
    for _ in range(_RETRIES):
      self._make_dirs()
      try:
        dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
      except FileNotFoundError:  # Removed meanwhile (a released lock's cleanup): retry.
        continue
      try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(dir_fd)
        self._refuse_if_held(e, self._holder_from_file())
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
      except FileNotFoundError:  # The directory was removed meanwhile (a released lock's cleanup): retry.
        os.close(dir_fd)
        continue
      except OSError as e:
        os.close(dir_fd)
        if e.errno == errno.ELOOP:
          self._remove_created_dirs()
          raise DirectoryLockedError(f'{self.path} is a symbolic link; a run does not write through one. Remove '
                                     f'it, or use another --output_dir.') from None
        raise
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _read_holder(fd)
        os.close(fd)
        os.close(dir_fd)
        self._refuse_if_held(e, holder)
      try:
        same_file = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same_file = False
      if not same_file:  # Its holder removed the file on release before we got the flock: lock the new one.
        os.close(fd)
        os.close(dir_fd)
        continue
      previous = _read_holder(fd)
      if previous.get('pid'):
        self.stale_holder = f'pid {previous["pid"]}' + (
            f' on host {previous["host"]}' if previous.get('host') not in (None, socket.gethostname()) else '')
      os.ftruncate(fd, 0)
      os.pwrite(fd, f'pid={os.getpid()}\nhost={socket.gethostname()}\n'.encode(), 0)
      self._fd, self._dir_fd = fd, dir_fd
      return self
    raise DirectoryLockedError(f'{self.directory}: could not take {self.path} ({_RETRIES} attempts; its file kept '
                               'being replaced)')

  def release(self) -> None:
    """Removes the lock file and releases the lock (idempotent). A lock file that cannot be removed (a directory
    made read-only under the run) is left, logged: the flock is what locks, and the next run takes the file over;
    so an error that ended the run is never replaced by this cleanup's."""
    fd, self._fd = self._fd, None
    if fd is None:
      return
    try:
      try:
        os.unlink(self.path)
      except FileNotFoundError:  # The directory was moved or removed under the run.
        pass
      except OSError as e:
        logging.info('%s: lock file left (%s); the next run takes it over', self.path, e.strerror or e)
    finally:
      os.close(fd)  # Releases the flocks.
      dir_fd, self._dir_fd = self._dir_fd, None
      if dir_fd is not None:
        os.close(dir_fd)
      self._remove_created_dirs()

  def _refuse_if_held(self, error: OSError, holder: dict[str, str]) -> None:
    """After a failed flock: `DirectoryLockedError` naming the holder when another holds it; else re-raises."""
    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      raise error
    self._remove_created_dirs()
    raise DirectoryLockedError(
        f'{self.directory} is in use by another run ({_describe(holder)}; lock file {self.path}). Wait for it to '
        f'end, or use another --output_dir.') from None

  def _holder_from_file(self) -> dict[str, str]:
    try:
      fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
      return {}
    try:
      return _read_holder(fd)
    finally:
      os.close(fd)

  def _remove_created_dirs(self) -> None:
    for path in self._created:  # Deepest first; a directory that holds anything stays.
      try:
        os.rmdir(path)
      except OSError:
        break
    self._created = []

  def __enter__(self) -> 'DirectoryLock':
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()
