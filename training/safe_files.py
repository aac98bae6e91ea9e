"""Writing a run's files so that nobody else's symbolic link can redirect them.

A run writes into `--output_dir`. Were that directory writable by other users, one of them could plant a link
named `summary.json` (or `metrics.csv`, `.run.lock`...) pointing at a file of the run's user, and the run would
overwrite it. So:

* `check_output_dir` refuses an output directory that other users may write into (group- or world-writable)
  unless it is the run user's own and sticky (as /tmp is: others cannot then remove or rename the run's files),
  and refuses one in which any of the names the run writes is already a symbolic link (TFF's release and state
  managers, which write `metrics.csv`, `tensorboard/` and `checkpoints/`, follow links);
* `write_atomic` writes the run's own files as a new file made with O_EXCL | O_NOFOLLOW beside the target, then
  renamed over it: a rename replaces a link at the target, it never writes through it, and a reader sees the old
  file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Iterable
from typing import Optional

# What a run creates in its output directory (its own files and TFF's), checked for planted links up front.
RUN_OUTPUTS = ('config.json', 'summary.json', 'metrics.csv', 'accuracy.png', 'audit.md', 'membership.json',
               'tensorboard', 'checkpoints', 'personal', 'control_variate', '.run.lock')


class UnsafeOutputError(RuntimeError):
  """The output directory could let another user redirect the run's writes (the message says how)."""


def check_output_dir(directory: str, names: Iterable[str] = RUN_OUTPUTS) -> None:
  """Raises `UnsafeOutputError` if `directory` (when it exists) or one of `names` in it is unsafe to write."""
  try:
    info = os.lstat(directory)
  except FileNotFoundError:
    return  # Created by the run, with the user's umask.
  if stat.S_ISLNK(info.st_mode):
    real = os.path.realpath(directory)
    check_output_dir(real, names)  # A link to a directory is fine when that directory is safe.
    return
  others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  sticky_and_own = info.st_mode & stat.S_ISVTX and info.st_uid == os.geteuid()
  if others_write and not sticky_and_own:
    raise UnsafeOutputError(
        f'{directory} is writable by other users (mode {stat.filemode(info.st_mode)}): one of them could plant '
        f'links that redirect the run\'s writes. Use a directory only you can write to (chmod go-w), or one of '
        f'yours with the sticky bit')
  for name in names:
    path = os.path.join(directory, name)
    if os.path.islink(path):
      raise UnsafeOutputError(f'{path} is a symbolic link (to {os.readlink(path)}); a run does not write through '
                              f'one. Remove it, or use another --output_dir')


def output_dir_problem(directory: str, flag: str = 'output_dir', shown: Optional[str] = None) -> Optional[str]:
  """Why `directory` could not be created or written into (None: it can), naming `flag`; nothing is created.

  An empty path; a file; a path under a file; a nearest existing ancestor that this user may not write into, or
  that lies on a read-only file system (which even root cannot write). `shown`: the flag's value, when that is
  not `directory` itself (a file's path, whose directory is checked).
  """
  if not isinstance(directory, str) or not directory.strip():
    return f'{flag} is empty: give the directory the run writes into'
  named = f'{flag} {directory}' if shown is None else f'{flag} {shown}: {directory}'
  path = os.path.abspath(directory)
  if os.path.exists(path) and not os.path.isdir(path):
    return f'{named} is a file, not a directory'
  parent = path
  while not os.path.exists(parent):  # The nearest existing ancestor: the run creates the rest.
    parent = os.path.dirname(parent)
  named = f'{flag} {shown or directory}'
  if not os.path.isdir(parent):
    return f'{named}: {parent} is a file, not a directory'
  try:
    read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
  except OSError:
    read_only = False
  if read_only:
    return f'{named}: {parent} is on a read-only file system'
  if not os.access(parent, os.W_OK | os.X_OK):
    return f'{named}: {parent} is not writable by this user'
  return None


def output_file_problem(path: str, flag: str) -> Optional[str]:
  """Why the file `path` (or files with `path` as their prefix) could not be written (None: it could)."""
  if not isinstance(path, str) or not path.strip():
    return f'{flag} is empty: give the path to write'
  if os.path.isdir(path):
    return f'{flag} {path} is a directory; give a file\'s path'
  return output_dir_problem(os.path.dirname(os.path.abspath(path)), flag, shown=path)


# TensorFlow's file system reports an errno as `tf.errors.OpError` 'CONTEXT; STRERROR' (tsl's errors::IOError).
_ERRNO_OF_STRERROR = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}


def os_error_of(error: BaseException) -> Optional[OSError]:
  """The `OSError` that a TensorFlow file-system error stands for, or None.

  TensorFlow (and TFF's release and state managers, which write through it) raise a failed write as a
  `tf.errors.OpError` whose message is the path and the C library's text ('/run/metrics.csv_temp1666; No space
  left on device'), not as an `OSError`: this gives it back its errno and path, so a caller handles both alike.
  """
  message = getattr(error, 'message', None)
  if not isinstance(message, str):
    return None
  context, separator, reason = message.strip().rpartition('; ')
  code = _ERRNO_OF_STRERROR.get(reason)
  if not separator or code is None:
    return None
  return OSError(code, reason, context)


def read_json_object(path: str) -> dict:
  """The JSON object in `path`; ValueError saying why when the file is not one (invalid JSON or text, another
  JSON value). OSError as `open` raises it."""
  try:
    with open(path) as f:
      value = json.load(f)
  except UnicodeDecodeError as e:
    raise ValueError(str(e)) from None
  if not isinstance(value, dict):
    raise ValueError('not a JSON object')
  return value


def write_atomic(path: str, data: bytes | str) -> None:
  """Writes `data` to `path` without following a link there: a fresh file beside it, renamed over it."""
  directory, name = os.path.split(path)
  tmp = os.path.join(directory, f'.{name}.{secrets.token_hex(6)}.tmp')
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data.encode('utf-8') if isinstance(data, str) else data)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
